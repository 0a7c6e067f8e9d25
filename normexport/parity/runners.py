"""Runners: the ONNX model as a file, onnxruntime (CPU, CUDA) and TensorRT (through normexport.trt)
sessions, and whether each backend can run here."""

from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
import torch

from ..errors import UsageError
from ._util import _short, _to_numpy

BACKENDS = ("ort", "ort-cuda", "trt")


class _ModelSource:
    """The ONNX model as a path (written to a temp folder when given in memory)."""

    def __init__(self, onnx_model):
        self._tmp: str | None = None
        if isinstance(onnx_model, onnx.ModelProto):
            self.proto = onnx_model
            self.path: str | None = None
            self.label = "<in-memory model>"
        else:
            from ..io import load_onnx

            p = Path(os.fspath(onnx_model))
            if not p.is_file():
                raise UsageError(f"ONNX file not found: '{p}': check the path")
            try:
                self.proto = onnx.load(str(p), load_external_data=False)
            except Exception as e:  # corrupt file
                load_onnx(p)  # raises the project's one-line UsageError
                raise UsageError(f"cannot read '{p}' as ONNX ({_short(e)})") from None
            self.path = str(p)
            self.label = str(p)

    def file(self) -> str:
        if self.path is None:
            from ..io import save_onnx

            self._tmp = tempfile.mkdtemp(prefix="normexport-check-")
            self.path = str(save_onnx(self.proto, Path(self._tmp) / "model.onnx"))
        return self.path

    def close(self):
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


def _ort_feed(session, names: list[str], inputs: Sequence[torch.Tensor]):
    import onnxruntime as ort

    feed = {}
    for meta, name, t in zip(session.get_inputs(), names, inputs):
        want = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(double)": torch.float64,
                "tensor(bfloat16)": torch.bfloat16, "tensor(int64)": torch.int64, "tensor(int32)": torch.int32,
                "tensor(bool)": torch.bool}.get(meta.type)
        if want is not None and t.dtype != want:
            t = t.to(want)
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            feed[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(t.view(torch.uint16).numpy(), onnx.TensorProto.BFLOAT16)
        else:
            feed[name] = t.numpy()
    return feed


#: said on every row of a bfloat16 model that onnxruntime ran widened (DESIGN §8)
WIDENED = ("bfloat16 run widened to float32 in onnxruntime (its CPU provider has no bfloat16 kernels for this "
           "model); eager's own bf16 error vs float64 is the precision question")


class _OrtBackend:
    def __init__(self, source: _ModelSource, provider: str):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 4  # quiet: its errors reach the user through the report's one-line reasons
        path_or_bytes = source.path if source.path else source.file()
        self.widened = False
        try:
            self.session = ort.InferenceSession(path_or_bytes, so, providers=[provider])
        except Exception as e:  # noqa: BLE001
            if provider != "CPUExecutionProvider" or not _has_bf16(source.proto) or "NOT_IMPLEMENTED" not in str(e):
                raise
            self.session = self._widened(source, so, provider)
            self.widened = True
        if provider not in self.session.get_providers():
            raise RuntimeError(f"onnxruntime fell back to {self.session.get_providers()}")
        self.names = [i.name for i in self.session.get_inputs()]

    def run(self, inputs: Sequence[torch.Tensor]) -> list[np.ndarray]:
        import onnxruntime as ort

        ro = ort.RunOptions()
        ro.log_severity_level = 4
        return self.session.run(None, _ort_feed(self.session, self.names, inputs), ro)


    @staticmethod
    def _widened(source: _ModelSource, so, provider: str):
        """A session of the model with every bfloat16 tensor, input, output and Cast made float32."""
        import onnxruntime as ort

        from ..rewriter.local import _retype

        full = onnx.load(source.path) if source.path else source.proto
        wide = _retype(full, {onnx.TensorProto.BFLOAT16}, onnx.TensorProto.FLOAT)
        with tempfile.TemporaryDirectory(prefix="normexport-widened-") as tmp:
            path = os.path.join(tmp, "wide.onnx")
            onnx.save_model(wide, path, save_as_external_data=True, location="wide.onnx.data", size_threshold=1024)
            del wide
            return ort.InferenceSession(path, so, providers=[provider])


def _has_bf16(model: onnx.ModelProto) -> bool:
    g = model.graph
    return any(vi.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16 for vi in list(g.input) + list(g.output)) or \
        any(t.data_type == onnx.TensorProto.BFLOAT16 for t in g.initializer) or \
        any(a.name == "to" and a.i == onnx.TensorProto.BFLOAT16 for n in g.node for a in n.attribute)


class _TrtBackend:
    """normexport.trt: one engine per input shape set (its optimisation profiles are min = opt =
    max), built on first use; fp16 / bf16 builder flags when the model has such tensors."""

    def __init__(self, source: _ModelSource, plugin: str | None, first_shape: dict[str, list[int]], names: list[str]):
        from .. import trt as ntrt

        self._ntrt = ntrt
        self.path = source.file()
        self.plugin = plugin
        self.names = names
        types = {vi.type.tensor_type.elem_type for vi in list(source.proto.graph.input) + list(source.proto.graph.output)}
        params = inspect.signature(ntrt.build_engine).parameters
        self.kwargs: dict[str, Any] = {}
        if "fp16" in params and onnx.TensorProto.FLOAT16 in types:
            self.kwargs["fp16"] = True
        if "bf16" in params and onnx.TensorProto.BFLOAT16 in types:
            self.kwargs["bf16"] = True
        self._shape_kw = "input_shapes" if "input_shapes" in params else None
        self.engines: dict[tuple, Any] = {}
        self._engine(first_shape)  # parse / build errors surface as "cannot load the model"

    def _engine(self, shape: dict[str, list[int]]):
        key = tuple(tuple(shape[n]) for n in self.names)
        if key not in self.engines:
            kwargs = dict(self.kwargs)
            if self._shape_kw:
                kwargs[self._shape_kw] = {n: tuple(shape[n]) for n in self.names}
            self.engines[key] = self._ntrt.build_engine(self.path, self.plugin, **kwargs)
        return self.engines[key]

    def run(self, inputs: Sequence[torch.Tensor]) -> list:
        engine = self._engine({n: list(t.shape) for n, t in zip(self.names, inputs)})
        feed = {n: _to_numpy(t) for n, t in zip(self.names, inputs)}  # bfloat16 goes as float32
        out = self._ntrt.run_engine(engine, feed)
        if isinstance(out, dict):
            return list(out.values())
        return list(out)


def _availability(backend: str) -> str | None:
    """None when `backend` can run here, else the reason it cannot."""
    if backend == "ort":
        return None if importlib.util.find_spec("onnxruntime") else "onnxruntime not importable"
    if backend == "ort-cuda":
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return "onnxruntime CUDAExecutionProvider not available (install onnxruntime-gpu on a machine with a GPU)"
        return None
    if backend == "trt":
        try:
            from .. import trt as ntrt
        except Exception as e:
            return f"normexport.trt not importable ({_short(e)})"
        ok, why = ntrt.is_available()
        return None if ok else str(why)
    return f"unknown backend '{backend}'"


def _backend_list(backends) -> list[str]:
    if isinstance(backends, str):
        backends = (backends,)
    out: list[str] = []
    for b in backends:
        for x in (BACKENDS if b == "all" else (b,)):
            if x not in BACKENDS:
                raise UsageError(f"unknown backend '{x}': use ort, ort-cuda, trt or all")
            if x not in out:
                out.append(x)
    return out
