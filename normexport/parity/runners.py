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
            from ..io import check_external_data, load_onnx

            p = Path(os.fspath(onnx_model))
            if not p.is_file():
                raise UsageError(f"ONNX file not found: '{p}': check the path")
            try:
                self.proto = onnx.load(str(p), load_external_data=False)
            except Exception as e:  # corrupt file
                load_onnx(p)  # raises the project's one-line UsageError
                raise UsageError(f"cannot read '{p}' as ONNX ({_short(e)})") from None
            check_external_data(p, self.proto)  # data outside the model's folder, or short: one line, exit 2
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


class _OrtBackend:
    def __init__(self, source: _ModelSource, provider: str):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 4  # quiet: its errors reach the user through the report's one-line reasons
        path_or_bytes = source.path if source.path else source.file()
        self.widened = False
        self.chunked = None
        if provider == "CPUExecutionProvider" and _has_bf16(source.proto) and \
                2 * weight_bytes(source.proto) > WIDEN_WHOLE_LIMIT:
            # widened whole it would not fit: run it piece by piece (docs/design.md §8)
            self.chunked = _Chunked(path_or_bytes, so)
            self.widened = True
            self.names = self.chunked.input_names
            return
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

        if self.chunked is not None:
            return self.chunked.run(dict(zip(self.names, inputs)))
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


#: a bfloat16 model whose weights widened to float32 exceed this runs in onnxruntime piece by piece
WIDEN_WHOLE_LIMIT = 4 << 30
#: float32 bytes of weights per piece: a tenth of the model's (the check's peak stays near the
#: weights' size: docs/design.md §8), at least CHUNK_MIN_BYTES (fewer sessions), at most CHUNK_BYTES
CHUNK_BYTES = 1536 << 20
CHUNK_MIN_BYTES = 128 << 20
#: constants up to this size go into a piece as initializers; larger ones are fed as inputs
_EMBED_BYTES = 1 << 20


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


class _Chunked:
    """A bfloat16 model run in onnxruntime's CPU provider widened to float32 one piece at a time:
    the nodes in graph order cut into pieces of about CHUNK_BYTES of float32 weights; each piece a
    model of its own (weights fed as inputs, widened from the memory-mapped file as it runs), its
    outputs the values later pieces read. Holds one piece's weights in float32 at a time (an 8 B
    model's check does not need 30 GiB)."""

    def __init__(self, path: str, so):
        import onnx_ir as ir

        self.so = so
        self.model = ir.load(path)
        g = self.model.graph
        self.input_names = [v.name for v in g.inputs if v.name not in g.initializers]
        nodes = list(g)
        limit = min(CHUNK_BYTES, max(CHUNK_MIN_BYTES, sum(_f32_bytes(v) for v in g.initializers.values()) // 10))
        chunks: list[list] = [[]]
        size, counted = 0, set()
        for n in nodes:
            new = [v for v in n.inputs if v is not None and v.const_value is not None and v.producer() is None
                   and id(v) not in counted]
            b = sum(_f32_bytes(v) for v in new)
            if chunks[-1] and size + b > limit:
                chunks.append([])
                size, counted = 0, set()
            chunks[-1].append(n)
            size += b
            counted.update(id(v) for v in new)
        self.chunks = chunks
        index = {id(n): i for i, c in enumerate(chunks) for n in c}
        #: the last piece that reads each value (len(chunks): a graph output)
        self.last_use: dict[int, int] = {}
        for n in nodes:
            for v in n.inputs:
                if v is not None:
                    self.last_use[id(v)] = max(self.last_use.get(id(v), -1), index[id(n)])
        for v in g.outputs:
            self.last_use[id(v)] = len(chunks)
        self.values = {o.name: o for n in nodes for o in n.outputs if o.name}
        self.values.update({v.name: v for v in g.inputs})

    def run(self, feeds: dict) -> list[np.ndarray]:
        import onnx_ir as ir
        import onnxruntime as ort

        from ..rewriter.local import _retype

        env: dict[str, np.ndarray] = {}
        for name, t in feeds.items():
            t = t.detach().cpu()
            env[name] = (t.float() if t.dtype in (torch.bfloat16,) else t).numpy()
        g = self.model.graph
        for i, chunk in enumerate(self.chunks):
            made = {id(o) for n in chunk for o in n.outputs}
            ins, inits, fed, mapped, arr = [], [], {}, [], None
            seen = set()
            for n in chunk:
                for v in n.inputs:
                    if v is None or id(v) in made or id(v) in seen:
                        continue
                    seen.add(id(v))
                    elem = int(v.dtype.value) if v.dtype is not None else onnx.TensorProto.FLOAT
                    elem = onnx.TensorProto.FLOAT if elem == onnx.TensorProto.BFLOAT16 else elem
                    if v.const_value is not None and v.producer() is None:
                        mapped.append(v.const_value)
                        arr = _widened(v.const_value.numpy())
                        if arr.nbytes <= _EMBED_BYTES:
                            inits.append(onnx.numpy_helper.from_array(arr, v.name))
                            continue
                        fed[v.name] = arr
                    else:
                        fed[v.name] = env[v.name]
                    ins.append(onnx.helper.make_tensor_value_info(v.name, elem, None))
            outs = [onnx.helper.make_tensor_value_info(o.name, _elem_f32(o), None) for n in chunk for o in n.outputs
                    if o.name and self.last_use.get(id(o), -1) > i]
            graph = onnx.helper.make_graph([ir.serde.serialize_node(n) for n in chunk], f"piece{i}", ins, outs)
            proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v)
                                                                 for d, v in self.model.opset_imports.items()],
                                           ir_version=min(self.model.ir_version or 10, 10))
            proto.functions.extend(ir.serde.serialize_function(f) for f in self.model.functions.values())
            proto = _retype(proto, {onnx.TensorProto.BFLOAT16}, onnx.TensorProto.FLOAT)
            proto.graph.initializer.extend(inits)
            sess = ort.InferenceSession(proto.SerializeToString(), self.so, providers=["CPUExecutionProvider"])
            ro = ort.RunOptions()
            ro.log_severity_level = 4
            got = sess.run([o.name for o in outs], fed, ro)
            del sess, fed, arr
            _unmap(mapped)  # the piece's weights leave the process (its RSS stays one piece, not the file)
            env.update(zip([o.name for o in outs], got))
            for name in list(env):  # activations no later piece reads
                v = self.values.get(name)
                if v is not None and self.last_use.get(id(v), len(self.chunks)) <= i:
                    del env[name]
        return [env[v.name] for v in g.outputs]


def _unmap(tensors) -> None:
    """Close the memory maps of external tensors a piece read (onnx-ir maps the data file per
    tensor and keeps the pages until released): a later read maps them again."""
    for t in tensors:
        release = getattr(t, "release", None)
        if release is not None:
            try:
                release()
            except BufferError:  # a view is still alive somewhere: leave this one mapped
                pass


def _f32_bytes(v) -> int:
    try:
        n = int(np.prod(v.const_value.shape.numpy())) if v.const_value.shape is not None else 0
        return n * max(4, v.const_value.dtype.itemsize) if v.const_value.dtype.is_floating_point() else v.const_value.nbytes
    except Exception:  # noqa: BLE001
        return 0


def _widened(arr: np.ndarray) -> np.ndarray:
    return arr.astype(np.float32) if arr.dtype.name == "bfloat16" else arr


def _elem_f32(v) -> int:
    elem = int(v.dtype.value) if v.dtype is not None else onnx.TensorProto.FLOAT
    return onnx.TensorProto.FLOAT if elem == onnx.TensorProto.BFLOAT16 else elem


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
