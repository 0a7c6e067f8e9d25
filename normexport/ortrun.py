"""onnxruntime sessions: `inference_session` is the one place normexport makes an
onnxruntime InferenceSession (threads, providers, external data, memory rules and logging are
its parameters; tests/test_one_session_maker.py keeps it the only one). On top of it: quiet
one-off CPU sessions (bfloat16 in and out as ml_dtypes arrays), what normexport.sizes and the
rewriter's checks run models with (`session`, `run`), and a deployed file's session
(`file_session`)."""

from __future__ import annotations

import ctypes
import os
import tempfile
from typing import Sequence

import numpy as np
import onnx

from .dtypes import BF16


#: a ModelProto at least this large goes to onnxruntime through a file with external data (protobuf's limit)
_SERIALISE_LIMIT = 1_500_000_000


def inference_session(source, *, providers: Sequence[str] | None = None, log_level: int | None = 4,
                      threads: int | None = None, prepacking: bool = True, external_folder=None):
    """An onnxruntime InferenceSession of `source`: the only place normexport makes one.

    - `source`: a path (str / os.PathLike: external data read from beside it), serialised model
      bytes, or an onnx.ModelProto (serialised here; one over protobuf's limit, without
      `external_folder`, goes through a temporary file with external data);
    - `providers`: execution providers, in order (default: the CPU provider alone);
    - `log_level`: onnxruntime's log severity (4: nothing; errors come back as exceptions, which
      the callers quote in one line); None: onnxruntime's default;
    - `threads`: intra- and inter-op threads (None: onnxruntime's default);
    - `prepacking`: False for no second, pre-packed copy of the MatMul / Conv weights (one-off
      runs, a few steps: prepacking a 4 GiB file's weights takes seconds and memory);
    - `external_folder`: the folder a model's external-data locations are relative to (its
      weights are then read by onnxruntime from there, never copied into the proto)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if external_folder is not None:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(external_folder))
    if log_level is not None:
        so.log_severity_level = log_level
    if threads is not None:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = threads
    if not prepacking:
        so.add_session_config_entry("session.disable_prepacking", "1")
    providers = list(providers) if providers else ["CPUExecutionProvider"]
    if isinstance(source, onnx.ModelProto):
        if external_folder is None and source.ByteSize() >= _SERIALISE_LIMIT:
            with tempfile.TemporaryDirectory() as tmp:  # protobuf limit: go through a file with external data
                path = os.path.join(tmp, "m.onnx")
                onnx.save(source, path, save_as_external_data=True, location="m.data")
                return ort.InferenceSession(path, so, providers=providers)
        source = source.SerializeToString()
    elif not isinstance(source, (bytes, bytearray)):
        source = os.fspath(source)
    return ort.InferenceSession(source, so, providers=providers)


def session(model: onnx.ModelProto, external_folder: str | None = None):
    """A quiet onnxruntime CPU session for `model` (one thread, logs nothing, no prepacked copy of
    the weights: a one-off run). `external_folder`: where the model's external-data locations are
    relative to (`inference_session`)."""
    return inference_session(model, log_level=4, threads=1, prepacking=False, external_folder=external_folder)


def run_session(sess, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of `sess` on `feeds` (bfloat16 in and out as ml_dtypes arrays)."""
    import onnxruntime as ort

    ro = ort.RunOptions()
    ro.log_severity_level = 4
    names = [o.name for o in sess.get_outputs()]
    if not any(a.dtype == BF16 for a in feeds.values()) and all(o.type != "tensor(bfloat16)" for o in sess.get_outputs()):
        return dict(zip(names, sess.run(names, feeds, ro)))
    values = {k: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint16), onnx.TensorProto.BFLOAT16)
              if a.dtype == BF16 else ort.OrtValue.ortvalue_from_numpy(a) for k, a in feeds.items()}
    return {n: _from_ort(v) for n, v in zip(names, sess.run_with_ort_values(names, values, ro))}


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return run_session(session(model), feeds)


def _from_ort(v) -> np.ndarray:
    """A CPU OrtValue as numpy; bfloat16 copied out bit for bit as ml_dtypes.bfloat16."""
    if v.data_type() != "tensor(bfloat16)":
        return v.numpy()
    shape = tuple(v.shape())
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return np.zeros(shape, dtype=BF16)
    raw = np.ctypeslib.as_array((ctypes.c_uint16 * n).from_address(v.data_ptr()))
    return raw.copy().view(BF16).reshape(shape)


def file_session(path, providers: list[str] | None = None):
    """An onnxruntime session for a file on disk (its external data read from beside it), for
    running a deployed model: the runtime's own thread count, graph optimisations on, quiet."""
    return inference_session(str(path), providers=providers, log_level=4)
