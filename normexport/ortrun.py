"""Quiet one-off onnxruntime CPU sessions (bfloat16 in and out as ml_dtypes arrays): what
normexport.sizes and the rewriter's checks run models with."""

from __future__ import annotations

import ctypes
import os
import tempfile

import numpy as np
import onnx

from .dtypes import BF16


def session(model: onnx.ModelProto, external_folder: str | None = None):
    """A quiet onnxruntime CPU session for `model` (one thread, logs nothing: its errors come
    back as exceptions, which the callers quote in one line). `external_folder`: where the
    model's external-data locations are relative to (its weights are then read by onnxruntime
    from there, never copied into the proto)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if external_folder is not None:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(external_folder))
    so.log_severity_level = 4
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    # a one-off run: no second, pre-packed copy of the MatMul / Conv weights
    so.add_session_config_entry("session.disable_prepacking", "1")
    if external_folder is not None or model.ByteSize() < 1_500_000_000:
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory() as tmp:  # protobuf limit: go through a file with external data
        path = os.path.join(tmp, "m.onnx")
        onnx.save(model, path, save_as_external_data=True, location="m.data")
        return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


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
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    return ort.InferenceSession(str(path), so, providers=providers or ["CPUExecutionProvider"])
