"""Runners, after Polygraphy's runner interface (comparators apart: verdict.py): one runner per
runtime, each a `Runner` (`activate()` loads, `infer(inputs)` gives the flat outputs,
`deactivate()` releases; a context manager too): `EagerRunner` (the reference module as given),
`Float64Runner` (its float64 copy: reference.py), `OrtRunner` / `OrtCudaRunner` (onnxruntime's
CPU / CUDA provider, sessions made by normexport.ortrun) and `TrtRunner` (TensorRT through
normexport.trt). `RUNNERS` maps each `--backend` name to its runner class (`check` picks from it);
a class's `availability()` says whether it can run here. Also the ONNX model as a file
(`_ModelSource`)."""

from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, ClassVar, Sequence

import numpy as np
import onnx
import torch

from ..errors import UsageError
from ..ortrun import inference_session
from ._util import _flatten, _short, _to_numpy
from .widen import _Chunked, _has_bf16


class Runner:
    """One runtime (Polygraphy's BaseRunner, small): `activate()` loads the model (a session, an
    engine), `infer(inputs)` runs it on positional tensors and gives its outputs as a flat list
    (activating first where needed), `deactivate()` releases what activate made. `availability()`
    is None where the runtime can run here, else why not."""

    name: ClassVar[str] = "runner"
    #: set by a runner that ran the model in another dtype than the file's (said on every row)
    widened = False

    def __init__(self):
        self.is_active = False

    @classmethod
    def availability(cls) -> str | None:
        return None

    def activate(self) -> None:
        if not self.is_active:
            self.activate_impl()
            self.is_active = True

    def infer(self, inputs: Sequence[torch.Tensor]) -> list:
        if not self.is_active:
            self.activate()
        return self.infer_impl(inputs)

    def deactivate(self) -> None:
        if self.is_active:
            self.deactivate_impl()
            self.is_active = False

    def activate_impl(self) -> None:
        pass

    def infer_impl(self, inputs: Sequence[torch.Tensor]) -> list:
        raise NotImplementedError

    def deactivate_impl(self) -> None:
        pass

    def __enter__(self):
        self.activate()
        return self

    def __exit__(self, *exc):
        self.deactivate()
        return False


class EagerRunner(Runner):
    """The reference module itself, in its own dtype, without autograd: its outputs flattened."""

    name = "eager"

    def __init__(self, module):
        super().__init__()
        self.module = module

    def infer_impl(self, inputs):
        with torch.no_grad():
            return _flatten(self.module(*inputs))


class NoFloat64(Exception):
    """The float64 reference cannot be computed; `reason` says why (recorded in the report)."""

    def __init__(self, reason: str | None):
        super().__init__(reason)
        self.reason = reason


class Float64Runner(Runner):
    """The reference module in float64 (reference._Float64Reference: a float64 copy made on
    activate, or its weights upcast module by module while it runs); `infer` raises NoFloat64 with
    the reason where the model cannot run in float64."""

    name = "float64"

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.reference = None

    def activate_impl(self):
        from .reference import _Float64Reference

        self.reference = _Float64Reference(self.module)

    def infer_impl(self, inputs):
        outs, why = self.reference(tuple(inputs))
        if outs is None:
            raise NoFloat64(why)
        return outs

    def deactivate_impl(self):
        self.reference = None


class _ModelSource:
    """The ONNX model as a path (written to a temp folder when given in memory)."""

    def __init__(self, onnx_model):
        self._tmp: str | None = None
        if isinstance(onnx_model, onnx.ModelProto):
            self.proto = onnx_model
            self.path: str | None = None
            self.label = "<in-memory model>"
        else:
            from ..io import read_checked

            p = Path(os.fspath(onnx_model))
            self.proto = read_checked(p)  # missing, corrupt, unsafe or short data, damaged: one line, exit 2
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


#: said on every row of a bfloat16 model that onnxruntime ran widened (docs/design.md §8)
WIDENED = ("bfloat16 run widened to float32 in onnxruntime (its CPU provider has no bfloat16 kernels for this "
           "model); eager's own bf16 error vs float64 is the precision question")


class OrtRunner(Runner):
    """onnxruntime with one provider (`provider`; the CPU provider here), quiet (its errors reach
    the user through the report's one-line reasons). A bfloat16 model the CPU provider has no
    kernels for runs widened to float32, piece by piece where widened whole it would not fit
    (`_Chunked`, docs/design.md §8). `OrtRunner.of_session`: the same runner over a session made
    elsewhere of the same file."""

    name = "ort"
    provider: ClassVar[str] = "CPUExecutionProvider"

    def __init__(self, source: _ModelSource, *, plugin: str | None = None, first_shape=None, names=None):
        super().__init__()
        self.source = source
        self.session = None
        self.chunked = None
        self.names: list[str] = []

    @classmethod
    def availability(cls) -> str | None:
        return None if importlib.util.find_spec("onnxruntime") else "onnxruntime not importable"

    @classmethod
    def of_session(cls, session) -> "OrtRunner":
        """An active runner over `session`, made elsewhere (e.g. by the attention fusion's check)."""
        runner = cls.__new__(cls)
        Runner.__init__(runner)
        runner.source, runner.session, runner.chunked = None, session, None
        runner.names = [i.name for i in session.get_inputs()]
        runner.is_active = True
        return runner

    def activate_impl(self):
        source, provider = self.source, self.provider
        path_or_bytes = source.path if source.path else source.file()
        self.widened = False
        self.chunked = None
        if provider == "CPUExecutionProvider" and _has_bf16(source.proto) and \
                2 * weight_bytes(source.proto) > WIDEN_WHOLE_LIMIT:
            # widened whole it would not fit: run it piece by piece (docs/design.md §8)
            self.chunked = _Chunked(path_or_bytes)
            self.widened = True
            self.names = self.chunked.input_names
            return
        try:
            self.session = inference_session(path_or_bytes, providers=[provider], log_level=4)
        except Exception as e:  # noqa: BLE001
            if provider != "CPUExecutionProvider" or not _has_bf16(source.proto) or "NOT_IMPLEMENTED" not in str(e):
                raise
            self.session = self._widened(source, provider)
            self.widened = True
        if provider not in self.session.get_providers():
            raise RuntimeError(f"onnxruntime fell back to {self.session.get_providers()}")
        self.names = [i.name for i in self.session.get_inputs()]

    def infer_impl(self, inputs: Sequence[torch.Tensor]) -> list[np.ndarray]:
        import onnxruntime as ort

        if self.chunked is not None:
            return self.chunked.run(dict(zip(self.names, inputs)))
        ro = ort.RunOptions()
        ro.log_severity_level = 4
        return self.session.run(None, _ort_feed(self.session, self.names, inputs), ro)

    def deactivate_impl(self):
        self.session = None
        self.chunked = None

    @staticmethod
    def _widened(source: _ModelSource, provider: str):
        """A session of the model with every bfloat16 tensor, input, output and Cast made float32."""
        from ..rewriter.local import _retype

        full = onnx.load(source.path) if source.path else source.proto
        wide = _retype(full, {onnx.TensorProto.BFLOAT16}, onnx.TensorProto.FLOAT)
        with tempfile.TemporaryDirectory(prefix="normexport-widened-") as tmp:
            path = os.path.join(tmp, "wide.onnx")
            onnx.save_model(wide, path, save_as_external_data=True, location="wide.onnx.data", size_threshold=1024)
            del wide
            return inference_session(path, providers=[provider], log_level=4)


class OrtCudaRunner(OrtRunner):
    """onnxruntime's CUDA provider."""

    name = "ort-cuda"
    provider = "CUDAExecutionProvider"

    @classmethod
    def availability(cls) -> str | None:
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return "onnxruntime CUDAExecutionProvider not available (install onnxruntime-gpu on a machine with a GPU)"
        return None


#: a bfloat16 model whose weights widened to float32 exceed this runs in onnxruntime piece by piece
WIDEN_WHOLE_LIMIT = 4 << 30


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the model's initializers, external data included (read from the proto's
    external-data entries: nothing is loaded)."""
    total = 0
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            total += next((int(e.value) for e in t.external_data if e.key == "length"), 0)
        else:
            total += len(t.raw_data) or t.ByteSize()
    return total



class TrtRunner(Runner):
    """normexport.trt: one engine per input shape set (its optimisation profiles are min = opt =
    max), the first (`first_shape`) built on activate, the others on first use; fp16 / bf16 builder
    flags when the model has such tensors."""

    name = "trt"

    def __init__(self, source: _ModelSource, *, plugin: str | None = None, first_shape: dict[str, list[int]],
                 names: list[str]):
        super().__init__()
        self.source = source
        self.plugin = plugin
        self.first_shape = first_shape
        self.names = names
        self.engines: dict[tuple, Any] = {}

    @classmethod
    def availability(cls) -> str | None:
        try:
            from .. import trt as ntrt
        except Exception as e:
            return f"normexport.trt not importable ({_short(e)})"
        ok, why = ntrt.is_available()
        return None if ok else str(why)

    def activate_impl(self):
        from .. import trt as ntrt

        source = self.source
        self._ntrt = ntrt
        self.path = source.file()
        types = {vi.type.tensor_type.elem_type for vi in list(source.proto.graph.input) + list(source.proto.graph.output)}
        params = inspect.signature(ntrt.build_engine).parameters
        self.kwargs: dict[str, Any] = {}
        if "fp16" in params and onnx.TensorProto.FLOAT16 in types:
            self.kwargs["fp16"] = True
        if "bf16" in params and onnx.TensorProto.BFLOAT16 in types:
            self.kwargs["bf16"] = True
        self._shape_kw = "input_shapes" if "input_shapes" in params else None
        self.engines = {}
        self._engine(self.first_shape)  # parse / build errors surface as "cannot load the model"

    def deactivate_impl(self):
        self.engines = {}

    def _engine(self, shape: dict[str, list[int]]):
        key = tuple(tuple(shape[n]) for n in self.names)
        if key not in self.engines:
            kwargs = dict(self.kwargs)
            if self._shape_kw:
                kwargs[self._shape_kw] = {n: tuple(shape[n]) for n in self.names}
            self.engines[key] = self._ntrt.build_engine(self.path, self.plugin, **kwargs)
        return self.engines[key]

    def infer_impl(self, inputs: Sequence[torch.Tensor]) -> list:
        engine = self._engine({n: list(t.shape) for n, t in zip(self.names, inputs)})
        feed = {n: _to_numpy(t) for n, t in zip(self.names, inputs)}  # bfloat16 goes as float32
        out = self._ntrt.run_engine(engine, feed)
        if isinstance(out, dict):
            return list(out.values())
        return list(out)


#: `--backend` name -> its runner class (`check` picks runners from this table)
RUNNERS: dict[str, type[Runner]] = {"ort": OrtRunner, "ort-cuda": OrtCudaRunner, "trt": TrtRunner}
BACKENDS = tuple(RUNNERS)


def runner_for(backend: str, source: _ModelSource, *, plugin: str | None = None,
               first_shape: dict[str, list[int]] | None = None, names: list[str] | None = None) -> Runner:
    """The (inactive) runner of `backend` for the model `source`."""
    return RUNNERS[backend](source, plugin=plugin, first_shape=first_shape, names=names)


def _availability(backend: str) -> str | None:
    """None when `backend` can run here, else the reason it cannot."""
    cls = RUNNERS.get(backend)
    return f"unknown backend '{backend}'" if cls is None else cls.availability()


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
