"""Complex arithmetic carried as real (re, im) pairs, for any model, before export (docs/design.md §9).

ONNX has no complex arithmetic and neither torch.onnx exporter takes complex tensors, yet rotary
embeddings are often written with them: `torch.polar(ones, angles)`, `view_as_complex(x pairs) *
freqs_cis`, `view_as_real(...).flatten(-2)`, complex tables stored on modules, products split into
`.real` / `.imag`. `lower_complex(module, args, report)` returns a copy of the model's module tree
(weights shared, docs/design.md §8) whose forward runs under `complex_calls.RealComplexMode`: every complex
value is a `ComplexPair` (complex shape and dtype, real [..., 2] values) and every complex call is
computed with real ops, so the exporters trace only real ops.

* Stored complex tables (buffers, parameters, plain attributes, lists / tuples / dicts of them:
  Lumina2's `freqs_cis`, Qwen-Image's `pos_freqs`, the lifted constants of a `.pt2`) become
  ComplexPair constants on the copy (complex128 as float32 pairs: TensorRT has no float64
  arithmetic; the check below bounds the rounding).
* The forward is wrapped where it lives: the class's, or a bound method the instance set on itself
  (transformers-cache wrappers do); the wrapper keeps the original signature for torch.export.
* A `.pt2`'s module (ExportedProgram.module(), a GraphModule) is lowered the same way: its ATen calls
  reach the mode when the exporter traces it again.
* Which models: a scan of the stored tensors, of a traced graph's values and of the code of the
  model's classes and of the functions their modules import (names such as `polar`,
  `view_as_complex`, `complex64`) finds candidates; the others are returned as they came, without a
  run. A candidate is run lowered on the example inputs; when no complex value appears it is
  returned as it came.
* Complex inputs (issue 40: a RoPE table of complex64 a pipeline passes the transformer): the
  CallAdapter the call is made through (normexport.load.call) takes them as view_as_real's real
  pairs (the name kept, the shape + (2,)) and gives the model view_as_complex of them, which the
  mode makes a ComplexPair: the file's input is real, the parity check feeds the same pairs to
  eager (complex again inside the adapter) and to onnxruntime. Said in the report entry
  ("complex_inputs") and on the terminal.
* The check: the lowered run's outputs against the original's on the example inputs (rel err <=
  1e-5 in float32 / float64, 1e-2 in float16 / bfloat16). When a call has no real form, the lowered
  model does not run or the outputs differ, the model is returned unchanged and the report gets a
  note with the reason (which the export error repeats: `not_lowered`).
"""

from __future__ import annotations

import inspect
import math
import sys
import types
from collections import Counter
from typing import Any

import torch
from torch import nn

from .complex_calls import (_ACTIVE_COUNTS, PRODUCERS, ComplexNotLowered, ComplexPair, RealComplexMode, is_complex_value,
                            lift, map_nested, op_name, pack, unpack)
from .swap import REL_TOL, rel_err, structure_copy

# ---- the module side: tables, the lowered forward, the check -------------------------------------------
def _packed_leaf(v):
    return pack(v) if isinstance(v, torch.Tensor) and v.dtype.is_complex and type(v) is not ComplexPair else v


def _packed(v):
    """Complex tensors (nested in lists / tuples / dicts) as ComplexPairs."""
    return map_nested(_packed_leaf, v)


def _has_complex(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.dtype.is_complex
    if isinstance(v, (list, tuple)):
        return any(_has_complex(x) for x in v)
    if isinstance(v, dict):
        return any(_has_complex(x) for x in v.values())
    return False


def complex_tables(module: nn.Module) -> dict[str, dict[str, Any]]:
    """{module name: {attribute: value}} of the complex tensors stored on each submodule (buffers,
    parameters, plain attributes, lists / tuples / dicts of them)."""
    found: dict[str, dict[str, Any]] = {}
    for name, m in module.named_modules():
        attrs = {k: v for k, v in list(m._buffers.items()) + list(m._parameters.items())
                 if v is not None and v.dtype.is_complex}
        attrs.update({k: v for k, v in vars(m).items() if not k.startswith("_") and _has_complex(v)})
        if attrs:
            found[name] = attrs
    return found


_COMPLEX_NAMES = {"polar", "view_as_complex", "complex64", "complex128", "cfloat", "cdouble", "complex32", "chalf",
                  "complex"}


def _code_names(obj, seen: set) -> set:
    """co_names of a function / class (its methods) and of the code nested in them."""
    out: set = set()
    if id(obj) in seen:
        return out
    seen.add(id(obj))
    if isinstance(obj, type):
        for v in vars(obj).values():
            out |= _code_names(v, seen)
        return out
    if isinstance(obj, (staticmethod, classmethod)):
        return _code_names(obj.__func__, seen)
    if isinstance(obj, property):
        return set().union(*(_code_names(f, seen) for f in (obj.fget, obj.fset) if f is not None))
    fn = getattr(obj, "__wrapped__", obj)
    code = getattr(fn, "__code__", None)
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        out |= set(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return out


def _python_modules(module: nn.Module) -> list[str]:
    """Python modules of the model's classes (modules and their bases, and the plain objects they
    hold, e.g. attention processors)."""
    names: dict[str, None] = {}
    for m in module.modules():
        for cls in type(m).__mro__:
            names.setdefault(cls.__module__)
        for v in vars(m).values():
            if not isinstance(v, (nn.Module, torch.Tensor, int, float, str, bool, list, tuple, dict, type(None))):
                names.setdefault(type(v).__module__)
    return [n for n in names if n and not n.startswith(("torch", "builtins", "normexport"))]


def complex_inputs(module: nn.Module) -> dict[str, tuple]:
    """{input name: (complex dtype, complex shape)} of the inputs the call of `module` (a CallAdapter,
    or a wrapper around one: `.inner` chain) takes as real pairs."""
    m, seen = module, set()
    while isinstance(m, nn.Module) and id(m) not in seen:
        seen.add(id(m))
        found = getattr(m, "complex_inputs", None)
        if isinstance(found, dict) and found:
            return found
        m = getattr(m, "inner", None)
    return {}


def _input_text(name: str, dtype: torch.dtype, shape: tuple) -> str:
    real = {torch.complex32: "float16", torch.complex64: "float32", torch.complex128: "float64"}.get(dtype, "?")
    dims = "x".join(map(str, shape)) or "scalar"
    return f"{name} ({str(dtype).replace('torch.', '')} {dims} -> {real} {dims + 'x' if shape else ''}2)"


def may_use_complex(module: nn.Module) -> bool:
    """Complex inputs, complex tensors stored on the model, complex values in a traced graph, or code
    of its classes' Python modules that names torch.polar / view_as_complex / a complex dtype."""
    if complex_inputs(module) or complex_tables(module):
        return True
    for m in module.modules():
        if isinstance(m, torch.fx.GraphModule):
            for node in m.graph.nodes:
                val = node.meta.get("val")
                vals = val if isinstance(val, (list, tuple)) else [val]
                if any(isinstance(v, torch.Tensor) and v.dtype.is_complex for v in vals):
                    return True
                if node.op == "call_function" and op_name(node.target) in PRODUCERS:
                    return True
    seen: set = set()
    for modname in _python_modules(module):
        pm = sys.modules.get(modname)
        for v in list(vars(pm).values()) if pm else []:
            home = getattr(v, "__module__", None) or ""
            # the module's own classes and functions, and the functions it imports (diffusers'
            # get_1d_rotary_pos_embed(use_real=False), apply_rotary_emb), torch's excepted
            if home == modname or (isinstance(v, types.FunctionType) and not home.startswith("torch")):
                if (isinstance(v, type) or callable(v)) and _code_names(v, seen) & _COMPLEX_NAMES:
                    return True
    return False


class ProgramCall(nn.Module):
    """A `.pt2`'s GraphModule called through a module around it: torch.export traces a GraphModule by
    its class's forward, so the lowered forward is this module's (with the program's signature)."""

    def __init__(self, program: nn.Module):
        super().__init__()
        self.inner = program

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def _lower_forward(module: nn.Module) -> None:
    """module.forward (its class's or its own, e.g. a bound method set in __init__) run under
    RealComplexMode: an instance attribute, so only this module (and its deep copies, which rebind
    it) is affected, and inspect.signature still sees the original parameters."""
    own = module.__dict__.get("forward")
    func = getattr(own, "__func__", None) if own is not None else type(module).forward
    if own is not None and (func is None or getattr(own, "__self__", None) is not module):
        raise ComplexNotLowered("the model's forward is not a method of the model")

    def forward(self, *args, **kwargs):
        with RealComplexMode():
            out = func(self, *args, **kwargs)
        if _has_pair(out):
            raise ComplexNotLowered("the model returns complex tensors (ONNX has no complex type)")
        return out

    forward.__wrapped__ = func  # inspect.signature: the original parameters
    if isinstance(module, ProgramCall):  # the program's parameters (torch.export binds dynamic shapes by them)
        params = list(inspect.signature(module.inner.forward).parameters.values())
        forward.__signature__ = inspect.Signature(
            [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + params)
    forward.__name__, forward.__qualname__, forward.__doc__ = "forward", getattr(func, "__qualname__", "forward"), func.__doc__
    forward._normexport_complex_lowered = True
    module.forward = types.MethodType(forward, module)


def _has_pair(v) -> bool:
    if isinstance(v, torch.Tensor):
        return type(v) is ComplexPair or v.dtype.is_complex
    if isinstance(v, (list, tuple)):
        return any(_has_pair(x) for x in v)
    if isinstance(v, dict):
        return any(_has_pair(x) for x in v.values())
    if hasattr(v, "to_tuple"):
        return _has_pair(v.to_tuple())
    return False


def _flat(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat(o)]
    return []


def _compare(new, old) -> float:
    new, old = _flat(new), _flat(old)
    if len(new) != len(old) or any(a.shape != b.shape for a, b in zip(new, old)):
        return math.inf
    return rel_err(new, old)


def _tol(module: nn.Module) -> float:
    dts = {p.dtype for p in module.parameters() if p.is_floating_point()}
    return REL_TOL if dts <= {torch.float32, torch.float64} else 1e-2


def _call(module, args):
    if isinstance(args, tuple) and len(args) == 2 and isinstance(args[1], dict) and isinstance(args[0], tuple):
        return module(*args[0], **args[1])
    return module(*args) if isinstance(args, tuple) else module(args)


def _entry(kind, lowered: bool, reason, err) -> dict:
    """A prepare-report entry: "swapped" (op ComplexAsReal) when lowered, else a "note" (the terminal
    prints it; the export then fails on the complex values, and its error repeats the reason)."""
    return {"name": "", "kind": kind, "action": "swapped" if lowered else "note",
            "op": "ComplexAsReal" if lowered else None, "reason": reason, "max_rel_err": float(err),
            "lowering": "complex"}


def summary_lines(report: list) -> list[str]:
    """Terminal lines for the complex lowering entries of a prepare report."""
    lines = []
    for e in report or []:
        if e.get("lowering") != "complex":
            continue
        if e.get("complex_inputs"):
            lines.append("  complex inputs taken as real (re, im) pairs, a trailing axis of 2 (feed torch.view_as_real(x)): "
                         + ", ".join(e["complex_inputs"]))
        if e["action"] == "swapped":
            calls = e.get("calls") or ""
            lines.append(f"  complex values carried as real (re, im) pairs: {e['kind']}"
                         + (f" ({calls})" if calls else "")
                         + f"; outputs equal to the original's to {e['max_rel_err']:.2g} of max|output|")
        else:
            lines.append(f"  note: {e['reason']}")
    return lines


def not_lowered(report: list) -> list[str]:
    """The reasons complex arithmetic was left complex, from a prepare report."""
    return [e["reason"] for e in report or [] if e.get("lowering") == "complex" and e.get("action") != "swapped"]


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).replace('torch.', '')} {list(v.shape)}"
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__} of {len(v)}"
    return type(v).__name__


def lower_complex(module: nn.Module, args: tuple, report: list | None = None) -> nn.Module:
    """`module` with its complex arithmetic carried as real pairs (see the module docstring): a copy
    of its module tree (weights shared), verified on `args` (a tuple of positional inputs, or
    ((args), {kwargs})) against the original; `module` itself when it has no complex arithmetic or
    the lowering fails or does not match. `report` receives one entry ({"name", "kind", "action",
    "op": "ComplexAsReal" | None, "reason", "max_rel_err"}) when the model has complex arithmetic."""
    report = report if report is not None else []
    if not may_use_complex(module):
        return module
    inner = module
    while isinstance(getattr(inner, "inner", None), nn.Module):  # CallAdapter, CacheLM: the user's model
        inner = inner.inner
    kind = type(inner).__name__
    tables = complex_tables(module)
    given = [_input_text(n, *v) for n, v in complex_inputs(module).items()]

    def skip(reason, err=math.nan):
        report.append(_entry(kind, False, f"{kind}: complex arithmetic left complex ({reason}); ONNX has no complex "
                             "arithmetic and both torch.onnx exporters reject complex tensors", err))
        if given:
            report[-1]["complex_inputs"] = given
        return module

    new = structure_copy(module)
    named = dict(new.named_modules())
    for n, attrs in tables.items():
        m = named[n]
        for k, v in attrs.items():
            m._buffers.pop(k, None)
            m._parameters.pop(k, None)
            object.__setattr__(m, k, _packed(v))
    if isinstance(new, torch.fx.GraphModule):
        new = ProgramCall(new)
    try:
        _lower_forward(new)
    except ComplexNotLowered as e:
        return skip(str(e))
    mode_counts: Counter = Counter()
    try:  # the lowered run first: a model with no complex value at run time is left without another
        with torch.no_grad():
            _ACTIVE_COUNTS.append(mode_counts)
            try:
                out = _call(new, args)
            finally:
                _ACTIVE_COUNTS.remove(mode_counts)
    except ComplexNotLowered as e:
        return skip(str(e))
    except Exception as e:  # noqa: BLE001
        if not mode_counts and not tables:
            return module  # no complex value met before the failure: not the lowering's to report
        failed = f"{type(e).__name__}: {str(e)[:200]}"
        try:
            with torch.no_grad():
                _call(module, args)
        except Exception as e0:  # noqa: BLE001
            return skip(f"the model does not run on its example inputs ({type(e0).__name__}: {str(e0)[:200]})")
        return skip(f"the model with complex values as real pairs does not run ({failed})")
    if not mode_counts and not tables:
        return module  # no complex value at run time
    try:
        with torch.no_grad():
            ref = _call(module, args)
    except Exception as e:  # noqa: BLE001
        return skip(f"the model does not run on its example inputs ({type(e).__name__}: {str(e)[:200]})")
    err, tol = _compare(out, ref), _tol(module)
    if not err <= tol:
        return skip(f"the real form's outputs differ from the original's on the example inputs: rel err {err:.3g} > "
                    f"{tol:g}", err)
    ops = ", ".join(f"{n} x{c}" for n, c in sorted(mode_counts.items()))
    stored = "; ".join(f"{n + '.' if n else ''}{k}: {_describe(v)}" for n, attrs in tables.items() for k, v in attrs.items())
    report.append(_entry(kind, True,
                         "complex arithmetic carried as real (re, im) pairs"
                         + (f" (calls: {ops})" if ops else "")
                         + (f"; stored complex tables as real pairs: {stored}" if stored else "")
                         + (f"; complex inputs taken as real pairs [..., 2]: {', '.join(given)}" if given else "")
                         + "; the model's outputs vs the original's on the example inputs", err))
    n_tables = sum(len(a) for a in tables.values())
    report[-1]["calls"] = ", ".join(f"{n} x{c}" for n, c in mode_counts.most_common(4) if not n.startswith("_")) + (
        f"; {n_tables} stored complex table(s)" if n_tables else "")
    if given:
        report[-1]["complex_inputs"] = given
    return new


__all__ = ["lower_complex", "not_lowered", "summary_lines", "complex_tables", "complex_inputs", "may_use_complex", "ComplexPair", "RealComplexMode",
           "ComplexNotLowered", "is_complex_value", "lift", "pack", "unpack", "op_name"]
