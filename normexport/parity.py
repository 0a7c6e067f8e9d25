"""`normexport check`: parity of an ONNX model against its eager PyTorch reference, in
onnxruntime (CPU, CUDA) and TensorRT, measured against a float64 reference (DESIGN §5, §7).

How a result is judged (one row = one backend x one input shape x one output):

* The errors (`max_abs_err`, `max_rel_err` = max_abs_err / max|ref|, `mean_abs_err`) compare
  the backend's output with the **float64 reference**: a deep copy of the reference module in
  float64, run on the inputs upcast to float64. While it runs, every cast to a lower float
  dtype (`.float()`, `.to(torch.float32)`, `dtype=torch.float32` in factories) is kept in
  float64 and the normexport custom ops are computed with their float64 numpy reference
  (the torch ops compute their statistics in float32), so "statistics in float32" code does
  not hide float32 rounding in the reference. When the model cannot run in float64, the
  reference is eager's own output, `ref_err_fp64` is null and the reason is recorded.
* `ref_err_fp64` is eager's own max abs error (in the model's dtype) against that reference.
* `tolerance` (DESIGN §7) = rtol x max|ref| + atol with, unless `rtol` / `atol` are given:
  float32 rtol 1e-5, atol 1e-6; float16 rtol 2e-3; bfloat16 rtol 1.6e-2 (atol 0); float64
  rtol 1e-10, atol 1e-12. Integer and bool outputs must match exactly.
* `limit` = min(tolerance, max(2 x ref_err_fp64, floor)) (DESIGN §7: within tolerance *and* not
  more than 2x eager's own error in the same dtype). The floor keeps an eager that happens to be
  nearly exact from making the bound ~0 (two correct implementations may round differently):
    - float32 / float64: floor = 4 x eps(dtype) x max|ref| (eps = machine epsilon, 2**-23 for
      float32; 4 eps x max|ref| is 4 to 8 units in the last place at the largest output);
    - float16 / bfloat16: floor = 1 x eps(dtype) x max|ref| (1 to 2 ulp there). Their DESIGN
      tolerances (2e-3, 1.6e-2) are only ~2 eps x max|ref|, so a 4 eps floor would switch the
      2x rule off; eager's own error in these dtypes includes the rounding of its output to
      the dtype, so 2 x eager is rarely below this floor anyway.
  Without a float64 reference the 2x rule cannot be applied and limit = tolerance.
* The dtype: the reference module and the floating inputs are cast to `dtype` (`--dtype`); when
  it is not given, the ONNX model's first floating input decides (a float16 ONNX file is judged
  against eager float16), applied when the given inputs are of another float dtype. The float64
  reference is computed from the cast module and inputs, in float64.
* Shapes: the given shape, plus `extra_shapes` more along the dynamic axes. An extra shape the
  reference module rejects is skipped (listed with the reason); the summary line says how many
  shapes were checked and skipped, and why no extra shape was checked when there are none.
* A row passes when max_abs_err <= limit, the shapes match and non-finite values (nan, inf)
  sit at the same places with the same values as in the reference.
* A backend that cannot run here is listed under `skipped` with the reason, never as passed;
  the report passes when at least one backend ran, and every backend that ran passed every row
  and actually compared at least one row with elements (zero comparisons is a failure).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import inspect
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import UsageError, first_line

BACKENDS = ("ort", "ort-cuda", "trt")

#: (rtol, atol) per dtype, DESIGN §7
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-6),
    torch.float16: (2e-3, 0.0),
    torch.bfloat16: (1.6e-2, 0.0),
    torch.float64: (1e-10, 1e-12),
}

_ONNX_TO_TORCH = {
    onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16, onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.INT64: torch.int64, onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT16: torch.int16, onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8, onnx.TensorProto.BOOL: torch.bool,
}
_LOW_FLOATS = (torch.float32, torch.float16, torch.bfloat16)

#: the floor of the 2x-eager limit, in eps(dtype) x max|ref| (module docstring)
FLOOR_EPS: dict[torch.dtype, float] = {
    torch.float32: 4.0, torch.float64: 4.0, torch.float16: 1.0, torch.bfloat16: 1.0,
}
LIMIT_RULE = ("limit = min(tolerance, max(2 x ref_err_fp64, floor)); floor = 4 x eps x max|ref| "
              "(float32, float64), 1 x eps x max|ref| (float16, bfloat16); limit = tolerance without "
              "a float64 reference")


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---- report --------------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    """One backend x one input shape x one output."""

    backend: str
    shape_index: int
    input_shapes: dict[str, list[int]]
    output: str
    dtype: str
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    mean_abs_err: float | None = None
    ref_err_fp64: float | None = None
    tolerance: float | None = None
    limit: float | None = None
    max_abs_ref: float | None = None
    passed: bool = False
    worst_index: list[int] | None = None
    worst_value: float | None = None
    worst_ref: float | None = None
    worst_eager: float | None = None
    elements: int = 0  # elements compared (0: nothing was compared)
    reason: str | None = None  # why it failed, or how it was judged

    @property
    def compared(self) -> bool:
        return self.max_abs_err is not None and self.elements > 0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        del d["backend"], d["output"]
        return {k: _json_number(v) for k, v in d.items()}


def _json_number(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # strict JSON has no inf / nan; `reason` says what happened
    return v


@dataclasses.dataclass
class CheckReport:
    command: str
    onnx_model: str
    reference: str
    inputs: list[dict]  # name, shape, dtype (the given inputs)
    shapes: list[dict]  # per checked input shape: {"index", "inputs": {name: shape}, "skipped"?}
    backends: list[str]
    rows: list[Row] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    fp64_reference: dict = dataclasses.field(default_factory=dict)  # {"available": bool, "reason"?}
    backend_errors: dict[str, str] = dataclasses.field(default_factory=dict)
    dtype: str | None = None  # the dtype eager ran in when cast (None: as given)
    dtype_source: str | None = None  # "--dtype" / "argument", or "ONNX input '<name>'"
    no_extra_shapes: str | None = None  # why only the given shape was checked

    @property
    def ran(self) -> list[str]:
        return [b for b in self.backends if b not in self.skipped]

    def compared(self, backend: str) -> int:
        """Rows of `backend` where outputs were actually compared (elements > 0)."""
        return sum(1 for r in self.rows if r.backend == backend and r.compared)

    def backend_passed(self, backend: str) -> bool:
        rows = [r for r in self.rows if r.backend == backend]
        return (bool(rows) and backend not in self.backend_errors and all(r.passed for r in rows)
                and self.compared(backend) > 0)

    @property
    def passed(self) -> bool:
        return bool(self.ran) and all(self.backend_passed(b) for b in self.ran)

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.passed]

    def to_dict(self) -> dict:
        from . import __version__

        results: dict[str, dict[str, list[dict]]] = {}
        for r in self.rows:
            results.setdefault(r.backend, {}).setdefault(r.output, []).append(r.to_dict())
        status = {}
        for b in self.backends:
            if b in self.skipped:
                status[b] = {"status": "skipped", "reason": self.skipped[b]}
            else:
                status[b] = {"status": "passed" if self.backend_passed(b) else "failed",
                             "rows_compared": self.compared(b)}
                if b in self.backend_errors:
                    status[b]["error"] = self.backend_errors[b]
                elif not self.compared(b):
                    status[b]["error"] = "nothing was compared"
        return {
            "normexport_version": __version__,
            "command": self.command,
            "onnx_model": self.onnx_model,
            "reference": self.reference,
            "inputs": self.inputs,
            "dtype": self.dtype,
            "dtype_source": self.dtype_source,
            "shapes": self.shapes,
            "shapes_summary": self.shapes_summary(),
            "limit_rule": LIMIT_RULE,
            "fp64_reference": self.fp64_reference,
            "backends": status,
            "results": results,
            "skipped": [{"backend": b, "reason": why} for b, why in self.skipped.items()],
            "passed": self.passed,
        }

    def write_json(self, path: str | os.PathLike) -> Path:
        from .io import write_json

        return write_json(self.to_dict(), path)

    def table(self) -> str:
        head = ("backend", "shape", "output", "dtype", "max_abs_err", "max_rel_err", "mean_abs_err",
                "eager_vs_fp64", "limit", "tolerance", "result")
        lines = []
        for r in self.rows:
            shape = " ".join(f"{k}={'x'.join(map(str, v)) or 'scalar'}" for k, v in r.input_shapes.items())
            if len(shape) > 34:
                shape = f"#{r.shape_index} " + shape[: 30] + ".."
            lines.append((r.backend, shape, r.output, r.dtype, _fmt(r.max_abs_err), _fmt(r.max_rel_err),
                          _fmt(r.mean_abs_err), _fmt(r.ref_err_fp64), _fmt(r.limit), _fmt(r.tolerance),
                          "PASS" if r.passed else "FAIL"))
        widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
        in_dtype = f", eager in {self.dtype} ({self.dtype_source})" if self.dtype else ""
        out = [f"parity check: {self.onnx_model} vs {self.reference} "
               f"(errors against the float64 reference{'' if self.fp64_reference.get('available') else ' -- unavailable, against eager'}"
               f"{in_dtype})"]
        out.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        out.extend("  ".join(str(x).ljust(w) for x, w in zip(line, widths)) for line in lines)
        for r in self.rows:
            if not r.passed and r.reason:
                out.append(f"  FAIL {r.backend} {r.output} shape #{r.shape_index}: {r.reason}")
        for b, err in self.backend_errors.items():
            out.append(f"  ERROR {b}: {err}")
        for s in self.shapes:
            if s.get("skipped"):
                out.append(f"  shape #{s['index']} not checked: {s['skipped']}")
        if not self.fp64_reference.get("available", True):
            out.append(f"  no float64 reference: {self.fp64_reference.get('reason')}")
        for b, why in self.skipped.items():
            out.append(f"  skipped {b}: {why}")
        verdict = "PASSED" if self.passed else "FAILED"
        if not self.ran:
            verdict += " (no backend could run)"
        nothing = [b for b in self.ran if not self.compared(b)]
        if nothing:
            verdict += f" (nothing compared in {', '.join(nothing)})"
        out.append(f"{verdict}: {len(self.ran)} backend(s) x {self.shapes_summary()}, "
                   f"{len(self.rows) - len(self.failures)}/{len(self.rows)} rows within limits")
        return "\n".join(out)

    def shapes_summary(self) -> str:
        """'3 shape(s) checked (0 skipped)', '1 shape(s) checked (2 skipped: ...)', or why only one."""
        checked = sum(1 for s in self.shapes if not s.get("skipped"))
        skipped = [s["skipped"] for s in self.shapes if s.get("skipped")]
        text = f"{checked} shape(s) checked"
        if skipped:
            whys = sorted(set(skipped))
            why = whys[0] if len(whys) == 1 else "the reference model rejects them, reasons listed above"
            text += f" ({len(skipped)} skipped: {why})"
        elif self.no_extra_shapes:
            text += f" (no extra shapes: {self.no_extra_shapes})"
        else:
            text += " (0 skipped)"
        return text


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.3g}" if v == 0 or abs(v) >= 1e-3 and abs(v) < 1e4 else f"{v:.2e}"


# ---- float64 reference -----------------------------------------------------------------------
def _fp64_custom_op(func, args, kwargs):
    """float64 implementations of the normexport custom ops (their numpy references), or None."""
    name = getattr(func, "__name__", "")
    ns = getattr(func, "namespace", None)
    if ns != "normexport" or not args or not isinstance(args[0], torch.Tensor) or args[0].dtype != torch.float64:
        return None
    from .ops import SPECS

    def np_(t):
        return None if t is None else t.detach().cpu().numpy().astype(np.float64)

    bound = {a.name: v for a, v in zip(func._schema.arguments, args)}
    bound.update(kwargs)
    if name.startswith("rms_norm"):
        y = SPECS["RMSNorm"].reference(np_(bound["x"]), np_(bound["scale"]), epsilon=bound["epsilon"], axis=bound["axis"])
    elif name.startswith("adaln_zero"):
        y = SPECS["AdaLNZero"].reference(np_(bound["x"]), np_(bound["shift"]), np_(bound["scale"]),
                                         np_(bound.get("weight")), np_(bound.get("bias")), epsilon=bound["epsilon"])
    else:
        return None
    return torch.from_numpy(np.ascontiguousarray(y)).to(args[0].device)


class _Float64Mode(TorchDispatchMode):
    """Keep a float64 computation in float64: casts and factories asking for a lower float dtype
    get float64, normexport ops use their float64 references."""

    _KEEP = ("aten::view.dtype",)  # bit reinterpretation: leave alone

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        y = _fp64_custom_op(func, args, kwargs)
        if y is not None:
            return y
        if str(func._schema.name) + "." + func._overloadname not in self._KEEP:
            if kwargs.get("dtype") in _LOW_FLOATS:
                kwargs["dtype"] = torch.float64
            args = tuple(torch.float64 if a in _LOW_FLOATS else a for a in args)
        return func(*args, **kwargs)


def _to_fp64(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


#: a float64 copy larger than this is not made (the reference is then eager itself)
FP64_COPY_LIMIT_BYTES = 4 * 2**30


class _Float64Reference:
    """A float64 deep copy of the reference, made once, run per input shape."""

    def __init__(self, reference: nn.Module):
        self.module = None
        self.reason: str | None = None
        try:
            n = sum(t.numel() for t in list(reference.parameters()) + list(reference.buffers()) if t.is_floating_point())
        except Exception:
            n = 0
        if n * 8 > FP64_COPY_LIMIT_BYTES:
            self.reason = f"the model is too large for a float64 copy ({n * 8 / 2**30:.1f} GiB)"
            return
        try:
            self.module = copy.deepcopy(reference).double()
        except Exception as e:  # exotic modules
            self.reason = f"cannot make a float64 copy of the reference ({_short(e)})"

    def __call__(self, inputs: tuple):
        """(flat float64 outputs, None) or (None, reason)."""
        if self.module is None:
            return None, self.reason
        args = tuple(_to_fp64(t) for t in inputs)
        errors = []
        for mode in (_Float64Mode, contextlib.nullcontext):
            try:
                with torch.no_grad(), mode():
                    out = _flatten(self.module(*args))
                return [o.double() if o.is_floating_point() else o for o in out], None
            except Exception as e:
                errors.append(_short(e))
        return None, f"the reference does not run in float64 ({errors[-1]})"


# ---- helpers -----------------------------------------------------------------------------------
def _cast_reference(reference, dtype: torch.dtype):
    """`reference` with its floating parameters and buffers in `dtype` (a copy when any differ)."""
    try:
        tensors = list(reference.parameters()) + list(reference.buffers())
    except Exception:
        tensors = []
    if all(t.dtype == dtype for t in tensors if t.is_floating_point()):
        return reference
    try:
        return copy.deepcopy(reference).to(dtype)
    except Exception as e:
        raise UsageError(f"cannot cast the reference model to {_dtype_name(dtype)} ({_short(e)}): "
                         "pass a reference in that dtype, or --dtype matching it") from None


def _short(e: BaseException) -> str:
    return first_line(e, 200)


def _flatten(out) -> list[torch.Tensor]:
    leaves, _ = pytree.tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def _dims(vi: onnx.ValueInfoProto) -> list[int | str | None]:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return []
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]


def _elem_dtype(vi: onnx.ValueInfoProto):
    return _ONNX_TO_TORCH.get(vi.type.tensor_type.elem_type)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    return t.numpy()


def _as_float64(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        return (a.double() if a.is_floating_point() or a.dtype == torch.bool else a.to(torch.float64)).numpy()
    a = np.asarray(a)
    if a.dtype.kind == "V" or str(a.dtype) == "bfloat16":
        a = a.astype(np.float32)
    return a.astype(np.float64)


def _resolve_dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    from .inputs import DTYPES

    if str(dtype).replace("torch.", "") not in DTYPES:
        raise UsageError(f"unknown dtype '{dtype}': use float32, float16 or bfloat16")
    return DTYPES[str(dtype).replace("torch.", "")]


# ---- backends ----------------------------------------------------------------------------------
class _ModelSource:
    """The ONNX model as a path (written to a temp folder when given in memory)."""

    def __init__(self, onnx_model):
        self._tmp: str | None = None
        if isinstance(onnx_model, onnx.ModelProto):
            self.proto = onnx_model
            self.path: str | None = None
            self.label = "<in-memory model>"
        else:
            from .io import load_onnx

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
            from .io import save_onnx

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


class _OrtBackend:
    def __init__(self, source: _ModelSource, provider: str):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        path_or_bytes = source.path if source.path else source.file()
        self.session = ort.InferenceSession(path_or_bytes, so, providers=[provider])
        if provider not in self.session.get_providers():
            raise RuntimeError(f"onnxruntime fell back to {self.session.get_providers()}")
        self.names = [i.name for i in self.session.get_inputs()]

    def run(self, inputs: Sequence[torch.Tensor]) -> list[np.ndarray]:
        return self.session.run(None, _ort_feed(self.session, self.names, inputs))


class _TrtBackend:
    """normexport.trt: one engine per input shape set (its optimisation profiles are min = opt =
    max), built on first use; fp16 / bf16 builder flags when the model has such tensors."""

    def __init__(self, source: _ModelSource, plugin: str | None, first_shape: dict[str, list[int]], names: list[str]):
        from . import trt as ntrt

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
        if importlib.util.find_spec("tensorrt") is None:
            return "tensorrt not importable"
        try:
            from . import trt as ntrt
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


# ---- shapes ------------------------------------------------------------------------------------
def _normalise_dynamic(dynamic_axes, names: list[str], ranks: list[int]) -> dict[str, dict[int, str | None]]:
    """{onnx input name: {axis: symbol or None}}; names may also be positional `input_<i>`."""
    out: dict[str, dict[int, str | None]] = {}
    for key, axes in (dynamic_axes or {}).items():
        if key in names:
            name = key
        elif isinstance(key, int) and 0 <= key < len(names):
            name = names[key]
        else:
            raise UsageError(f"dynamic axes name unknown input '{key}': the ONNX inputs are {names}")
        rank = ranks[names.index(name)]
        items = axes.items() if isinstance(axes, dict) else ((a, None) for a in axes)
        for a, sym in items:
            a = int(a)
            if not -rank <= a < rank:
                raise UsageError(f"dynamic axis {a} of '{name}' is out of range: it has rank {rank}")
            out.setdefault(name, {})[a % rank] = sym
    return out


def _extra_shapes(inputs: list[torch.Tensor], names: list[str], graph_inputs, dynamic, n: int) -> list[dict[str, list[int]]]:
    """`n` new shape sets. Dynamic axes sharing a symbol (the ONNX dim_param, the name given in
    dynamic_axes, else the same size) change together: size + 1, 2 x size, size + 3, ..."""
    groups: dict[Any, list[tuple[int, int]]] = {}
    for i, (name, t, vi) in enumerate(zip(names, inputs, graph_inputs)):
        graph_dims = _dims(vi)
        for axis, sym in dynamic.get(name, {}).items():
            gd = graph_dims[axis] if axis < len(graph_dims) else None
            key = ("sym", sym) if sym else (("param", gd) if isinstance(gd, str) else ("size", t.shape[axis]))
            groups.setdefault(key, []).append((i, axis))
    if not groups:
        return []

    def new_size(size: int, k: int) -> int:
        return [size + 1, 2 * size, size + 3, max(1, size - 1), 3 * size][k % 5] + (k // 5) * 5

    shapes = []
    for k in range(n):
        dims = [list(t.shape) for t in inputs]
        for members in groups.values():
            i0, a0 = members[0]
            size = new_size(inputs[i0].shape[a0], k)
            for i, axis in members:
                dims[i][axis] = size
        shapes.append({name: d for name, d in zip(names, dims)})
    return shapes


def _inputs_like(inputs: list[torch.Tensor], shape: dict[str, list[int]], names: list[str], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, t in zip(names, inputs):
        dims = shape[name]
        if list(t.shape) == dims:
            out.append(t)
        elif t.is_floating_point():
            tf = t.float()
            mean, std = (tf.mean().item(), tf.std().item()) if t.numel() > 1 else (0.0, 1.0)
            std = std if math.isfinite(std) and std > 0 else 1.0
            out.append((torch.randn(dims, generator=g) * std + mean).to(t.dtype))
        elif t.dtype == torch.bool:
            out.append(torch.randint(0, 2, dims, generator=g).bool())
        else:
            lo = int(t.min()) if t.numel() else 0
            hi = int(t.max()) if t.numel() else 1
            out.append(torch.randint(lo, hi + 1, dims, generator=g, dtype=t.dtype))
    return out


# ---- comparison --------------------------------------------------------------------------------
def tolerance_for(dtype: torch.dtype, max_abs_ref: float, rtol: float | None = None, atol: float | None = None) -> float:
    """DESIGN §7 tolerance for an output of `dtype` whose largest |reference| is `max_abs_ref`."""
    if not dtype.is_floating_point:
        return 0.0
    r, a = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.float32])
    r = r if rtol is None else rtol
    a = a if atol is None else atol
    return r * max_abs_ref + a


def floor_for(dtype: torch.dtype, max_abs_ref: float) -> float:
    """The least limit the 2x-eager rule gives: FLOOR_EPS[dtype] x eps(dtype) x max|ref|."""
    if not dtype.is_floating_point:
        return 0.0
    return FLOOR_EPS.get(dtype, 4.0) * torch.finfo(dtype).eps * max_abs_ref


def limit_for(dtype: torch.dtype, tolerance: float, max_abs_ref: float, eager_err: float | None) -> float:
    """min(tolerance, max(2 x eager's own error, floor)) (DESIGN §7); see the module docstring."""
    if eager_err is None or not dtype.is_floating_point:
        return tolerance
    return min(tolerance, max(2.0 * eager_err, floor_for(dtype, max_abs_ref)))


def _compare(row: Row, got, ref64: np.ndarray, eager64: np.ndarray, dtype: torch.dtype,
             eager_err: float | None, rtol, atol) -> Row:
    got = _as_float64(got)
    if got.shape != ref64.shape:
        row.reason = f"shape {list(got.shape)} != reference shape {list(ref64.shape)}"
        return row
    finite = np.isfinite(ref64)
    max_ref = float(np.abs(ref64[finite]).max()) if finite.any() else 0.0
    row.max_abs_ref = max_ref
    row.ref_err_fp64 = eager_err
    row.tolerance = tolerance_for(dtype, max_ref, rtol, atol)
    row.limit = limit_for(dtype, row.tolerance, max_ref, eager_err)
    if got.size == 0:
        row.max_abs_err = row.max_rel_err = row.mean_abs_err = 0.0
        row.passed = True
        row.reason = "empty output: nothing to compare"
        return row
    row.elements = int(got.size)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(got - ref64)
    # matching non-finite values (same nan / same inf at the same place) are not errors
    same_nonfinite = ~finite & ((np.isnan(ref64) & np.isnan(got)) | (ref64 == got))
    diff = np.where(same_nonfinite, 0.0, diff)
    diff = np.where(np.isnan(diff), np.inf, diff)
    flat = int(np.argmax(diff))
    idx = np.unravel_index(flat, diff.shape)
    row.max_abs_err = float(diff.reshape(-1)[flat])
    row.mean_abs_err = float(diff.mean())
    if max_ref > 0:
        row.max_rel_err = row.max_abs_err / max_ref
    else:
        row.max_rel_err = 0.0 if row.max_abs_err == 0 else float("inf")
    row.worst_index = [int(i) for i in idx]
    row.worst_value = float(got[idx])
    row.worst_ref = float(ref64[idx])
    row.worst_eager = float(eager64[idx]) if eager64.shape == got.shape else None
    if not math.isfinite(row.max_abs_err):
        row.reason = (f"non-finite mismatch at index {tuple(row.worst_index)}: got {row.worst_value}, "
                      f"reference {row.worst_ref}")
        return row
    row.passed = row.max_abs_err <= row.limit
    if not row.passed:
        if row.max_abs_err > row.tolerance:
            why = f"max_abs_err {row.max_abs_err:.3g} > tolerance {row.tolerance:.3g}"
        else:
            why = (f"max_abs_err {row.max_abs_err:.3g} > limit {row.limit:.3g} = max(2 x eager's own error "
                   f"{eager_err:.3g}, floor {floor_for(dtype, max_ref):.3g}): more than 2 x eager's error "
                   f"though within tolerance {row.tolerance:.3g}")
        row.reason = (f"{why}; worst at index {tuple(row.worst_index)}: got {row.worst_value:.7g}, "
                      f"reference {row.worst_ref:.7g}, eager {row.worst_eager if row.worst_eager is None else format(row.worst_eager, '.7g')}")
    return row


# ---- the check ---------------------------------------------------------------------------------
def check(onnx_model, reference: nn.Module, inputs, *, backends=("ort",), dynamic_axes: dict | None = None,
          extra_shapes: int = 2, rtol: float | None = None, atol: float | None = None, plugin: str | None = None,
          dtype=None, command: str = "check") -> CheckReport:
    """Compare `onnx_model` (path or ModelProto) with `reference` on `inputs` (positional tuple in
    the order of the ONNX graph inputs, or a dict keyed by ONNX input name) in each backend, on
    the given shape plus `extra_shapes` more when `dynamic_axes` ({input name: [axes]}) is given.
    `dtype` ("float32" / "float16" / "bfloat16" or a torch dtype) casts the reference and the float
    inputs; None: the ONNX model's first floating input decides when the inputs differ from it.

    Raises UsageError for bad input (unreadable model, input count mismatch, a reference that
    rejects the inputs); a failed comparison is a report with passed False."""
    source = _ModelSource(onnx_model)
    try:
        return _check(source, reference, inputs, backends=_backend_list(backends), dynamic_axes=dynamic_axes,
                      extra_shapes=extra_shapes, rtol=rtol, atol=atol, plugin=plugin, dtype=_resolve_dtype(dtype),
                      command=command)
    finally:
        source.close()


def _check(source: _ModelSource, reference, inputs, *, backends, dynamic_axes, extra_shapes, rtol, atol, plugin,
           dtype, command) -> CheckReport:
    graph_inputs = _graph_inputs(source.proto)
    names = [i.name for i in graph_inputs]
    if isinstance(inputs, dict):
        unknown = sorted(set(inputs) - set(names))
        missing = [n for n in names if n not in inputs]
        if unknown or missing:
            raise UsageError(f"inputs {sorted(inputs)} do not match the ONNX inputs {names}: name each ONNX input once")
        inputs = [inputs[n] for n in names]
    elif isinstance(inputs, torch.Tensor):
        inputs = [inputs]
    inputs = list(inputs)
    if len(inputs) != len(names):
        raise UsageError(f"the ONNX model has {len(names)} input(s) ({', '.join(names)}) but {len(inputs)} were given: "
                         "give one input per ONNX input, in order")
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        raise UsageError("inputs must be tensors")
    dtype_source = "argument" if dtype is not None else None
    if dtype is None:  # judge in the ONNX file's dtype (module docstring)
        first = next((vi for vi in graph_inputs if (_elem_dtype(vi) or torch.int64).is_floating_point), None)
        given = next((t.dtype for t in inputs if t.is_floating_point()), None)
        onnx_dtype = _elem_dtype(first) if first is not None else None
        if onnx_dtype in _LOW_FLOATS and given is not None and given != onnx_dtype:
            dtype, dtype_source = onnx_dtype, f"ONNX input '{first.name}'"
    if dtype is not None:
        reference = _cast_reference(reference, dtype)
        inputs = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    if isinstance(reference, torch.nn.Module) and reference.training:
        try:
            reference = reference.eval()
        except NotImplementedError:  # modules of torch.export programs refuse eval(); they are in eval form
            pass
    out_infos = list(source.proto.graph.output)
    out_names = [o.name for o in out_infos]

    dynamic = _normalise_dynamic(dynamic_axes, names, [t.dim() for t in inputs])
    base = {n: list(t.shape) for n, t in zip(names, inputs)}
    shape_sets = [base] + _extra_shapes(inputs, names, graph_inputs, dynamic, extra_shapes if dynamic else 0)
    no_extra = None
    if len(shape_sets) == 1:
        no_extra = ("no dynamic axes (static shapes)" if not dynamic
                    else "extra_shapes is 0" if extra_shapes == 0 else "none could be made")

    report = CheckReport(
        command=command, onnx_model=source.label, reference=type(reference).__name__,
        inputs=[{"name": n, "shape": list(t.shape), "dtype": _dtype_name(t.dtype)} for n, t in zip(names, inputs)],
        shapes=[], backends=list(backends), dtype=_dtype_name(dtype) if dtype is not None else None,
        dtype_source=dtype_source, no_extra_shapes=no_extra,
    )
    for b in backends:
        why = _availability(b)
        if why:
            report.skipped[b] = why

    # eager and float64 reference per shape
    cases = []  # (index, shape, inputs, eager outputs, reference outputs (float64), eager errors)
    fp64_reasons = []
    run_fp64 = _Float64Reference(reference)
    for k, shape in enumerate(shape_sets):
        entry: dict[str, Any] = {"index": k, "inputs": shape}
        report.shapes.append(entry)
        xs = inputs if k == 0 else _inputs_like(inputs, shape, names, seed=1000 + k)
        try:
            with torch.no_grad():
                eager = _flatten(reference(*xs))
        except Exception as e:
            if k == 0:
                shapes = ", ".join("x".join(map(str, t.shape)) for t in xs)
                raise UsageError(f"the reference model rejected inputs of shape {shapes} ({_short(e)}): fix the inputs") from None
            entry["skipped"] = f"the reference model rejects this shape ({_short(e)})"
            continue
        if len(eager) != len(out_names):
            raise UsageError(f"the reference returns {len(eager)} tensor(s) but the ONNX model has {len(out_names)} "
                             f"output(s) ({', '.join(out_names)}): check that they are the same model")
        ref64, why = run_fp64(tuple(xs))
        if ref64 is not None and [tuple(r.shape) for r in ref64] != [tuple(e.shape) for e in eager]:
            ref64, why = None, "the float64 run gives outputs of other shapes"
        if ref64 is None:
            fp64_reasons.append(why)
            refs = [_as_float64(e) for e in eager]
            errs: list[float | None] = [None] * len(eager)
        else:
            refs = [_as_float64(r) for r in ref64]
            errs = []
            for e, r in zip(eager, refs):
                if not e.is_floating_point():
                    errs.append(None)
                    continue
                d = np.abs(_as_float64(e) - r)
                d = d[np.isfinite(d)]
                errs.append(float(d.max()) if d.size else 0.0)
        cases.append((k, shape, xs, [_as_float64(e) for e in eager], refs, errs, [e.dtype for e in eager]))
    report.fp64_reference = ({"available": True} if not fp64_reasons
                             else {"available": False, "reason": fp64_reasons[0]})

    for b in backends:
        if b in report.skipped:
            continue
        try:
            if b == "ort":
                runner = _OrtBackend(source, "CPUExecutionProvider")
            elif b == "ort-cuda":
                runner = _OrtBackend(source, "CUDAExecutionProvider")
            else:
                runner = _TrtBackend(source, plugin, cases[0][1], names)
        except Exception as e:
            report.backend_errors[b] = f"cannot load the model: {type(e).__name__}: {_short(e)}"
            continue
        for k, shape, xs, eager, refs, errs, eager_dtypes in cases:
            try:
                outs = runner.run(xs)
                err = None
            except Exception as e:
                outs, err = None, f"run failed: {type(e).__name__}: {_short(e)}"
            for j, name in enumerate(out_names):
                odt = _elem_dtype(out_infos[j]) or eager_dtypes[j]
                row = Row(backend=b, shape_index=k, input_shapes=shape, output=name, dtype=_dtype_name(odt),
                          ref_err_fp64=errs[j])
                if outs is None or j >= len(outs):
                    row.reason = err or f"backend returned {0 if outs is None else len(outs)} outputs"
                else:
                    _compare(row, outs[j], refs[j], eager[j], odt, errs[j], rtol, atol)
                report.rows.append(row)
    return report


# ---- command line -------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("onnx_model", metavar="MODEL.onnx", help="the ONNX file to check")
    p.add_argument("--reference", required=True, metavar="MODEL",
                   help="the eager model: x.pt2 | x.pt/x.pth | package.module:callable")
    p.add_argument("--input", action="append", default=[], metavar="NAME:DIMS[:DTYPE]",
                   help="e.g. x:2x16x64 (positional, in the order of the ONNX inputs); default: the model's example inputs")
    p.add_argument("--dynamic", action="append", default=[], metavar="NAME:AXES",
                   help="dynamic axes of input NAME, e.g. x:0,1; default: the symbolic dims of the ONNX inputs")
    p.add_argument("--backend", choices=("ort", "ort-cuda", "trt", "all"), default="ort")
    p.add_argument("--plugin", metavar="LIB.so", help="TensorRT plugin library (libnormexport_plugins.so)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="run the eager reference and the inputs in this dtype (the float64 reference stays float64); "
                        "default: the dtype of the ONNX model's first floating input")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (x max|ref|); default per dtype, DESIGN §7")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance; default per dtype, DESIGN §7")
    p.add_argument("--extra-shapes", type=int, default=2, metavar="N", help="extra shapes to check along dynamic axes (default 2)")
    p.add_argument("--json", metavar="FILE", help="write the JSON report")
    p.add_argument("--weights", metavar="FILE", help="state dict for a module:callable reference (weights_only=True)")
    p.add_argument("--trust-pickle", action="store_true", help="allow unpickling a pickled nn.Module reference")


def _onnx_dynamic(graph_inputs) -> dict[str, list[int]]:
    out = {}
    for vi in graph_inputs:
        axes = [a for a, d in enumerate(_dims(vi)) if isinstance(d, str) or d is None]
        if axes:
            out[vi.name] = axes
    return out


def run(args) -> int:
    from . import loaders
    from .inputs import make_inputs, parse_dynamic, parse_input

    for v, flag in ((args.rtol, "--rtol"), (args.atol, "--atol")):
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise UsageError(f"{flag} must be a non-negative number, got {v}")
    if args.extra_shapes < 0:
        raise UsageError(f"--extra-shapes must be >= 0, got {args.extra_shapes}")
    if args.json:
        from .io import check_writable

        check_writable(args.json)
    if args.plugin and not os.path.isfile(args.plugin):
        raise UsageError(f"plugin library not found: '{args.plugin}': check the --plugin path")
    source = _ModelSource(args.onnx_model)  # UsageError for a missing / corrupt file, before loading torch models
    graph_inputs = _graph_inputs(source.proto)
    onnx_names = [i.name for i in graph_inputs]
    specs = [parse_input(s) for s in args.input]
    dynamic_given = [parse_dynamic(d) for d in args.dynamic]
    loaded = loaders.load(args.reference, trust_pickle=args.trust_pickle, weights=args.weights)

    if specs:
        inputs = make_inputs(specs)
        given_names = [s.name for s in specs]
    elif loaded.example_inputs is not None:
        inputs = tuple(loaded.example_inputs)
        given_names = list(loaded.input_names or [])
    else:
        raise UsageError(f"cannot tell the inputs of '{args.reference}': add --input NAME:DIMS[:DTYPE] for each of the "
                         f"{len(onnx_names)} ONNX input(s) ({', '.join(onnx_names)})")
    if len(inputs) != len(onnx_names):
        raise UsageError(f"'{args.onnx_model}' has {len(onnx_names)} input(s) ({', '.join(onnx_names)}) but "
                         f"{len(inputs)} were given: give one --input per ONNX input, in order")

    def onnx_name(name: str) -> str:
        if name in onnx_names:
            return name
        if name in given_names:
            return onnx_names[given_names.index(name)]
        raise UsageError(f"--dynamic names unknown input '{name}': the ONNX inputs are {', '.join(onnx_names)}")

    if dynamic_given:
        dynamic: dict[str, list[int]] = {}
        for name, axes in dynamic_given:
            dynamic.setdefault(onnx_name(name), []).extend(axes)
    else:
        dynamic = _onnx_dynamic(graph_inputs)

    dtype = getattr(args, "dtype", None)
    report = check(source.path, loaded.module, tuple(inputs), backends=(args.backend,), dynamic_axes=dynamic,
                   extra_shapes=args.extra_shapes, rtol=args.rtol, atol=args.atol, plugin=args.plugin, dtype=dtype,
                   command="check")
    if dtype:
        report.dtype_source = "--dtype"
    print(report.table())
    if args.json:
        report.write_json(args.json)
        print(f"wrote {args.json}")
    return 0 if report.passed else 1


__all__ = ["check", "CheckReport", "Row", "tolerance_for", "limit_for", "floor_for", "add_arguments", "run",
           "BACKENDS", "DEFAULT_TOLERANCES", "FLOOR_EPS", "LIMIT_RULE"]
