"""Complex rotary embeddings as real arithmetic, before export (issue 19).

Neither torch.onnx exporter takes complex tensors ("ScalarType ComplexDouble"): ONNX has no complex
arithmetic. Rotary embeddings written with them (freqs_cis = torch.polar(1, angles), then
view_as_real(view_as_complex(x pairs) * freqs_cis)) are the same rotation on real pairs:
(a + ib)(c + is) = (ac - bs) + i(as + bc). `real_rope(module, args, report)` swaps them, the way
`swap.prepare` swaps norms: find, replace, verify numerically, else leave alone with a reason.

The representation: a complex tensor [..., n] becomes the real tensor [..., 2n] holding (cos, sin)
interleaved, i.e. view_as_real(z).flatten(-2). Indexing and slicing on leading axes, gather /
repeat / cat along any axis (cat along the last one included: it concatenates whole pairs), `.to`,
and `torch.zeros(..., dtype=t.dtype)` keep that layout, so the code that moves the tables around
(position ids, per-sample gathers, caption / image splits) runs unchanged on it.

What this covers (and only this; the whole-model check below refuses anything else):

* producers: complex tensors *stored on modules* (the rotary tables of Lumina2 / Lumina-Next
  `freqs_cis`, Qwen-Image's `pos_freqs`: buffers, plain attributes, lists / tuples / dicts of
  them) become the interleaved real tensors above, in float32 (complex128 tables too: TensorRT has
  no float64 arithmetic; the rounding is < 1e-7 relative, within the check below);
* consumers: the library functions that apply complex freqs, replaced by real equivalents that take
  the interleaved form (and call the original for complex freqs, so the replacement is safe for any
  other caller in the process): diffusers `models.embeddings.apply_rotary_emb(use_real=False)`
  (Lumina, Lumina2, Bria, ...), diffusers `apply_rotary_emb_qwen(use_real=False)` (Qwen-Image),
  transformers `apply_rotary_emb(xq, xk, freqs_cis)` of Llama4 / DeepSeek-V2. They are replaced by
  name in the globals of the python modules of the model's own classes (modules, attention
  processors) where the name is bound to that very function.

Not covered (reported as skipped, the export then fails as before): freqs computed with torch.polar
inside a forward (transformers Llama4 / DeepSeek-V2 rotary modules), complex arithmetic in
functions defined inside a method (diffusers Z-Image's processor).

Verification: each table-holding module is run on the inputs it got in a run of the whole model on
the example inputs, before and after (its complex outputs compared with the interleaved ones), and
the whole model before and after (rel err <= 1e-5 in float32, 1e-2 in float16 / bfloat16). On any
failure nothing is swapped (the module is returned as it came) and the report says why.
"""

from __future__ import annotations

import copy
import math
import sys
from typing import Any, Callable

import torch
from torch import nn

from .swap import REL_TOL, rel_err, structure_copy


# ---- the interleaved real form -------------------------------------------------------------------
def pack(z: torch.Tensor) -> torch.Tensor:
    """complex [..., n] -> real [..., 2n]: (re, im) interleaved, float32 (float64 tables rounded)."""
    return torch.view_as_real(z).flatten(-2).to(torch.float32)


def unpack(t: torch.Tensor) -> torch.Tensor:
    """real [..., 2n] interleaved -> complex [..., n] (for the checks)."""
    return torch.view_as_complex(t.double().unflatten(-1, (-1, 2)).contiguous())


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """view_as_real(view_as_complex(x.float() pairs) * freqs).flatten(-2), freqs interleaved real
    broadcastable to x's pairs: [..., D] with D = x's last dim."""
    xr, xi = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = freqs[..., 0::2], freqs[..., 1::2]
    return torch.stack([xr * c - xi * s, xr * s + xi * c], dim=-1).flatten(-2)


# ---- consumers: real equivalents of the library functions -----------------------------------------
def _diffusers_apply_rotary_emb(orig):
    def apply_rotary_emb(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
        if use_real or not isinstance(freqs_cis, torch.Tensor) or freqs_cis.is_complex():
            return orig(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)
        return _rotate(x, freqs_cis.unsqueeze(2)).type_as(x)  # = original's freqs_cis.unsqueeze(2)
    return apply_rotary_emb


def _qwen_apply_rotary_emb(orig):
    def apply_rotary_emb_qwen(x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
        if use_real or not isinstance(freqs_cis, torch.Tensor) or freqs_cis.is_complex():
            return orig(x, freqs_cis, use_real, use_real_unbind_dim)
        return _rotate(x, freqs_cis.unsqueeze(1)).type_as(x)
    return apply_rotary_emb_qwen


def _llama4_apply_rotary_emb(orig):
    def apply_rotary_emb(xq, xk, freqs_cis):
        if freqs_cis.is_complex():
            return orig(xq, xk, freqs_cis)
        f = freqs_cis[:, :, None, :]
        return _rotate(xq, f).type_as(xq), _rotate(xk, f).type_as(xk)
    return apply_rotary_emb


def _deepseek_apply_rotary_emb(orig):
    def apply_rotary_emb(xq, xk, freqs_cis):
        if freqs_cis.is_complex():
            return orig(xq, xk, freqs_cis)
        f = freqs_cis.unsqueeze(1).to(xq.device)
        return _rotate(xq, f).type_as(xq), _rotate(xk, f).type_as(xk)
    return apply_rotary_emb


#: (python module, function name) -> (factory of the real replacement, what the report says)
CONSUMERS: dict[tuple[str, str], tuple[Callable, str]] = {
    ("diffusers.models.embeddings", "apply_rotary_emb"):
        (_diffusers_apply_rotary_emb, "diffusers apply_rotary_emb(use_real=False)"),
    ("diffusers.models.transformers.transformer_qwenimage", "apply_rotary_emb_qwen"):
        (_qwen_apply_rotary_emb, "diffusers apply_rotary_emb_qwen(use_real=False)"),
    ("transformers.models.llama4.modeling_llama4", "apply_rotary_emb"):
        (_llama4_apply_rotary_emb, "transformers Llama4 apply_rotary_emb"),
    ("transformers.models.deepseek_v2.modeling_deepseek_v2", "apply_rotary_emb"):
        (_deepseek_apply_rotary_emb, "transformers DeepSeek-V2 apply_rotary_emb"),
}

_REPLACED: dict[int, Callable] = {}  # id(original function) -> its replacement (made once)


def _original(fn):
    """The library's function (a replacement made by an earlier call remembers it)."""
    return getattr(fn, "_normexport_real_rope", None) or fn


def _consumer_of(fn) -> tuple[Callable, str] | None:
    fn = _original(fn)
    return CONSUMERS.get((getattr(fn, "__module__", None), getattr(fn, "__name__", None)))


def _replacement(fn) -> Callable:
    if id(fn) not in _REPLACED:
        factory, _ = CONSUMERS[(fn.__module__, fn.__name__)]
        new = factory(fn)
        new.__module__, new.__qualname__, new.__doc__ = fn.__module__, fn.__qualname__, fn.__doc__
        new._normexport_real_rope = fn
        _REPLACED[id(fn)] = new
    return _REPLACED[id(fn)]


def _model_python_modules(module: nn.Module) -> list[str]:
    """Python modules of the model's classes: its nn.Modules (and their bases) and the plain
    objects they hold (attention processors)."""
    names: dict[str, None] = {}
    for m in module.modules():
        for cls in type(m).__mro__:
            names.setdefault(cls.__module__)
        for v in vars(m).values():
            if not isinstance(v, (nn.Module, torch.Tensor, int, float, str, bool, list, tuple, dict, type(None))):
                names.setdefault(type(v).__module__)
    return [n for n in names if n and not n.startswith(("torch", "builtins", "normexport"))]


def _consumer_sites(module: nn.Module) -> list[tuple[dict, str, Callable]]:
    """(globals, name, original function) for every registered consumer the model's code can call."""
    sites = []
    for modname in _model_python_modules(module):
        glb = getattr(sys.modules.get(modname), "__dict__", None)
        if not glb:
            continue
        for name, fn in list(glb.items()):
            if callable(fn) and _consumer_of(fn) is not None:
                sites.append((glb, name, _original(fn)))
    return sites


# ---- producers: complex tables on modules ---------------------------------------------------------
def _is_complex(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.is_complex()
    if isinstance(v, (list, tuple)):
        return any(_is_complex(x) for x in v)
    if isinstance(v, dict):
        return any(_is_complex(x) for x in v.values())
    return False


def _packed(v):
    if isinstance(v, torch.Tensor):
        return pack(v) if v.is_complex() else v
    if isinstance(v, (list, tuple)):
        return type(v)(_packed(x) for x in v)
    if isinstance(v, dict):
        return {k: _packed(x) for k, x in v.items()}
    return v


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).replace('torch.', '')} {list(v.shape)}"
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__} of {len(v)} ({', '.join(_describe(x) for x in v if _is_complex(x))})"
    return type(v).__name__


def complex_tables(module: nn.Module) -> dict[str, dict[str, Any]]:
    """{module name: {attribute: value}} of the complex tensors stored on each submodule."""
    found: dict[str, dict[str, Any]] = {}
    for name, m in module.named_modules():
        attrs = {k: v for k, v in m._buffers.items() if v is not None and v.is_complex()}
        attrs.update({k: v for k, v in vars(m).items() if not k.startswith("_") and _is_complex(v)})
        if attrs:
            found[name] = attrs
    return found


def _complex_in_forward(module: nn.Module) -> list[str]:
    """Module classes whose forward code itself calls torch.polar / view_as_complex (not covered)."""
    out = []
    for name, m in module.named_modules():
        code = getattr(getattr(type(m).forward, "__wrapped__", type(m).forward), "__code__", None)
        if code is not None and {"polar", "view_as_complex"} & set(code.co_names):
            out.append(name or type(m).__name__)
    return out


# ---- checks ----------------------------------------------------------------------------------------
def _as_real(out):
    """Outputs with complex tensors as their interleaved real form (to compare old with new)."""
    if isinstance(out, torch.Tensor):
        return torch.view_as_real(out).flatten(-2).double() if out.is_complex() else out
    if isinstance(out, (list, tuple)):
        return type(out)(_as_real(o) for o in out) if not hasattr(out, "_fields") else [_as_real(o) for o in out]
    if isinstance(out, dict):
        return {k: _as_real(v) for k, v in out.items()}
    if hasattr(out, "to_tuple"):  # ModelOutput
        return _as_real(out.to_tuple())
    return out


def _non_tensors(out) -> list:
    if isinstance(out, torch.Tensor):
        return []
    if isinstance(out, (list, tuple)):
        return [x for o in out for x in ([o] if not isinstance(o, (torch.Tensor, list, tuple, dict)) else _non_tensors(o))]
    if isinstance(out, dict):
        return _non_tensors(list(out.values()))
    return [out]


def _compare(new_out, old_out) -> float:
    old, new = _as_real(old_out), _as_real(new_out)
    if _non_tensors(old) != _non_tensors(new):
        return math.inf
    return rel_err(new, old)


def _tol(module: nn.Module) -> float:
    dts = {p.dtype for p in module.parameters() if p.is_floating_point()}
    return REL_TOL if dts <= {torch.float32, torch.float64} else 1e-2


def _call(module, args):
    return module(*args) if isinstance(args, tuple) else module(args)


# ---- driver ----------------------------------------------------------------------------------------
def _entry(name, kind, action, reason, err) -> dict:
    return {"name": name, "kind": kind, "action": action, "op": "RealRoPE" if action == "swapped" else None,
            "reason": reason, "max_rel_err": float(err)}


def real_rope(module: nn.Module, args: tuple, report: list | None = None) -> nn.Module:
    """`module` with complex rotary arithmetic made real (see the module docstring), or `module`
    itself when it has none or the swap does not verify. `args`: example inputs (the model is run
    on them, before and after). `report` receives one entry per table-holding module and one per
    replaced function ({"name", "kind", "action", "op": "RealRoPE", "reason", "max_rel_err"})."""
    report = report if report is not None else []
    tables = complex_tables(module)
    if not tables:
        for name in _complex_in_forward(module):
            report.append(_entry(name, type(module.get_submodule(name) if name in dict(module.named_modules())
                                            else module).__name__, "skipped",
                                 "complex rotary arithmetic computed in its forward (torch.polar / view_as_complex): "
                                 "not covered by normexport's real-RoPE swap; both exporters reject complex tensors",
                                 math.nan))
        return module
    sites = _consumer_sites(module)
    named = dict(module.named_modules())

    def skip(reason, err=math.nan):
        for name in tables:
            report.append(_entry(name, type(named[name]).__name__, "skipped", reason, err))
        return module

    if not sites:
        return skip("complex rotary tables, but none of the functions applying them is one normexport has a real "
                    f"form for ({', '.join(d for _, d in CONSUMERS.values())})")
    # the tables' modules' inputs and outputs in a run of the whole model
    seen: dict[str, tuple] = {}
    def keep(n):
        def hook(m, a, k, out):
            seen.setdefault(n, (a, k, out))  # returns None: the output is left alone
        return hook

    hooks = [named[n].register_forward_hook(keep(n), with_kwargs=True) for n in tables]
    try:
        with torch.no_grad():
            ref = _call(module, args)
    except Exception as e:  # noqa: BLE001
        return skip(f"the model does not run on its example inputs ({type(e).__name__}: {str(e)[:120]})")
    finally:
        for h in hooks:
            h.remove()
    new = structure_copy(module)
    new_named = dict(new.named_modules())
    for n, attrs in tables.items():
        for k, v in attrs.items():
            m = new_named[n]
            if k in m._buffers:
                m._buffers[k] = pack(v)
            else:
                object.__setattr__(m, k, _packed(copy.copy(v)))
    saved = [(glb, name, glb[name]) for glb, name, _ in sites]
    for glb, name, fn in sites:
        glb[name] = _replacement(fn)
    tol = _tol(module)
    errs: dict[str, float] = {}
    try:
        with torch.no_grad():
            for n in tables:
                if n in seen:
                    a, k, out = seen[n]
                    errs[n] = _compare(new_named[n](*a, **k), out)
            whole = _compare(_call(new, args), ref)
    except Exception as e:  # noqa: BLE001
        for glb, name, fn in saved:
            glb[name] = fn
        return skip(f"the real form does not run ({type(e).__name__}: {str(e)[:160]}): a consumer of the tables "
                    "normexport does not know?")
    bad = {n: e for n, e in errs.items() if not e <= tol}
    if bad or not whole <= tol:
        for glb, name, fn in saved:
            glb[name] = fn
        what = (f"module {next(iter(bad))} outputs differ (rel err {bad[next(iter(bad))]:.3g})" if bad
                else f"the model's outputs differ (rel err {whole:.3g})")
        return skip(f"real form of the complex rotary embedding rejected: {what} > {tol:g}", max(bad.values(), default=whole))
    uses = ", ".join(sorted({CONSUMERS[(fn.__module__, fn.__name__)][1] for _, _, fn in sites}))
    for n, attrs in tables.items():
        desc = "; ".join(f"{k}: {_describe(v)}" for k, v in attrs.items())
        report.append(_entry(n, type(named[n]).__name__, "swapped",
                             f"complex rotary tables ({desc}) stored as interleaved real (cos, sin) float32; "
                             f"module outputs vs the original's on the inputs of a model run"
                             + ("" if n in errs else " (not called in that run)"), errs.get(n, whole)))
    for glb, name, fn in sites:
        report.append(_entry(f"{glb.get('__name__')}.{name}", "function", "swapped",
                             f"{CONSUMERS[(fn.__module__, fn.__name__)][1]}: complex product replaced by its real "
                             f"form (xr*c - xi*s, xr*s + xi*c); whole model vs the original on the example inputs",
                             whole))
    return new


__all__ = ["real_rope", "complex_tables", "pack", "unpack", "CONSUMERS"]
