"""DiT-style blocks: `modulate(normN(x), shift, scale)` fused into normexport AdaLNZero in place.

A block is a candidate when its forward calls a module-level function that behaves like
``modulate(x, shift, scale) = x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)`` and it owns
LayerNorms without affine used in that forward. Since `modulate` is a function and not a module
there is no module to swap, and fx tracing is fragile around attention and would turn the block
into a GraphModule (losing its class and attributes). Instead the block's class is swapped for a
same-named subclass whose forward is the original forward's code object run with a globals
mapping in which `modulate` is the fused op (`fused_class`; it pickles and deep-copies), and the
LayerNorms are replaced by `DeferredLayerNorm` (identity; the normalisation happens inside the
fused op): ``modulate(norm1(x), shift, scale)`` then computes ``AdaLNZero(x, shift, scale)``.
This is only right if every output of those LayerNorms feeds `modulate` and `modulate` is only
applied to their outputs; rather than trusting a static analysis, the whole block is run before
and after on random inputs and the rewrite is reverted unless it matches. (The ONNX rewriter also
fuses LayerNormalization -> Mul(1 + scale) -> Add(shift) after export, so blocks left alone here
are still covered there.)

A block recogniser: `recognise_block(block, name, report)` rewrites the block in place (or
reports why not) before the driver visits its children, and returns the children it handled."""

from __future__ import annotations

import inspect
import math
import types
from typing import Any

import torch
from torch import nn

from ..numeric import REL_TOL, compare, float32_copy, rand, rel_err
from ._common import entry


class DeferredLayerNorm(nn.Module):
    """Stands in for a LayerNorm (no affine) whose only consumer is a fused `modulate`: returns
    x unchanged; the normalisation runs inside normexport AdaLNZero, called by `modulate`."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.hidden, self.eps = int(hidden), float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, fused into modulate -> normexport AdaLNZero"


_FUSED_CLASSES: dict[tuple, type] = {}


def _fused_forward(fwd: types.FunctionType, names: tuple[str, ...], eps: float) -> types.FunctionType:
    """`fwd`'s code run with globals in which `names` are the fused normexport AdaLNZero op."""

    def fused(x, shift, scale):
        return torch.ops.normexport.adaln_zero(x, shift, scale, None, None, eps)

    glb = dict(fwd.__globals__)
    for g in names:
        glb[g] = fused
    fn = types.FunctionType(fwd.__code__, glb, fwd.__name__, fwd.__defaults__, fwd.__closure__)
    fn.__kwdefaults__ = fwd.__kwdefaults__
    fn.__qualname__ = fwd.__qualname__
    fn.__doc__ = fwd.__doc__
    return fn


def fused_class(base: type, names: tuple[str, ...], eps: float) -> type:
    """A subclass of `base` (same name) whose forward calls normexport AdaLNZero wherever
    `base.forward` calls one of the module-level functions `names`. Instances pickle and
    deep-copy as (base instance, names, eps) and get this class back when loaded."""
    key = (base, tuple(names), float(eps))
    if key not in _FUSED_CLASSES:
        def __reduce_ex__(self, protocol):
            plain = base.__new__(base)
            plain.__dict__ = self.__dict__  # pickled as a plain `base` instance
            return _restore_fused, (plain, tuple(names), float(eps))

        _FUSED_CLASSES[key] = type(base.__name__, (base,), {
            "forward": _fused_forward(base.forward, tuple(names), float(eps)),
            "__reduce_ex__": __reduce_ex__,
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "_normexport_fused": (tuple(names), float(eps)),
        })
    return _FUSED_CLASSES[key]


def _restore_fused(plain: nn.Module, names: tuple[str, ...], eps: float) -> nn.Module:
    plain.__class__ = fused_class(type(plain), names, eps)
    return plain


def is_modulate(fn: Any, hidden: int) -> bool:
    """Does `fn(x, shift, scale)` compute x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)?"""
    if not isinstance(fn, types.FunctionType):
        return False
    try:
        if len(inspect.signature(fn).parameters) != 3:
            return False
        x, shift, scale = rand((2, 3, hidden), 6), rand((2, hidden), 7), rand((2, hidden), 8)
        with torch.no_grad():
            got = fn(x, shift, scale)
        want = x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
        return rel_err(got, want) <= REL_TOL
    except Exception:
        return False


def _block_inputs(block: nn.Module, hidden: int) -> tuple | None:
    """float32 inputs for a DiT-style block: its own example_inputs, or (x [B,S,H], c [B,H])."""
    if hasattr(block, "example_inputs"):
        try:
            return tuple(t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                         for t in block.example_inputs())
        except Exception:
            pass
    params = [p for p in inspect.signature(block.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    if len(params) != 2:
        return None
    return (rand((2, 5, hidden), 9), rand((2, hidden), 10))


def recognise_block(block: nn.Module, name: str, report: list) -> set[str]:
    """Fuse modulate(normN(x), shift, scale) in a DiT-style block in place; returns the names of
    the children it handled (deferred, or reported as left alone; empty when not a candidate)."""
    fwd = getattr(type(block), "forward", None)
    if not isinstance(fwd, types.FunctionType) or hasattr(type(block), "_normexport_fused"):
        return set()
    code = fwd.__code__
    lns = {n: c for n, c in block.named_children()
           if isinstance(c, nn.LayerNorm) and n in code.co_names}
    if not lns:
        return set()
    plain = {n: c for n, c in lns.items()
             if c.weight is None and c.bias is None and len(c.normalized_shape) == 1}
    hidden = {c.normalized_shape[0] for c in plain.values()}
    mods = [g for g in code.co_names if len(hidden) == 1 and is_modulate(fwd.__globals__.get(g), next(iter(hidden)))]
    if not mods:
        return set()

    def skip(reason, err=math.nan):
        for n, c in lns.items():
            report.append(entry(f"{name}.{n}" if name else n, c, "skipped", None, reason, err))
        return set(lns)  # reported; the caller leaves these children alone

    if plain.keys() != lns.keys():
        return skip(f"DiT-style block {type(block).__name__}: its LayerNorms feeding "
                    f"{mods[0]}() must have no affine")
    epss = {c.eps for c in plain.values()}
    if len(epss) != 1:
        return skip(f"DiT-style block {type(block).__name__}: LayerNorms with different eps {sorted(epss)}")
    (hidden,), (eps,) = hidden, epss
    inputs = _block_inputs(block, hidden)
    if inputs is None:
        return skip(f"DiT-style block {type(block).__name__}: cannot make check inputs for its forward")

    ref_block = float32_copy(block)
    test_block = float32_copy(block)
    for n in lns:
        setattr(test_block, n, DeferredLayerNorm(hidden, eps))
    test_block.__class__ = fused_class(type(block), tuple(mods), eps)
    try:
        err = compare(test_block, ref_block, inputs)
    except Exception as e:  # noqa: BLE001
        return skip(f"DiT-style block {type(block).__name__}: fused forward failed: {type(e).__name__}: {e}")
    if not err <= REL_TOL:
        return skip(f"DiT-style block {type(block).__name__}: fusing {mods[0]}(norm(x), ...) changes the "
                    f"output (rel err {err:.3g}); a LayerNorm output is used elsewhere?", err)
    for n, c in lns.items():
        setattr(block, n, DeferredLayerNorm(hidden, eps))
        report.append(entry(f"{name}.{n}" if name else n, c, "swapped", "AdaLNZero",
                            f"DiT-style block {type(block).__name__}: {mods[0]}({n}(x), shift, scale) fused "
                            f"into normexport AdaLNZero (block class rebound)", err))
    block.__class__ = fused_class(type(block), tuple(mods), eps)
    return set(lns)
