"""Sequence-first AdaLN: LayerNormalization -> Mul(1 + scale) -> Add(shift) with x [S, B, H] and the
modulation broadcast over S  ==>  normexport::AdaLNZero with modulation_axis = rank(x) - 2 (target trt).

A sequence-first model modulates as `norm(x) * (1 + scale) + shift` with scale / shift [B, H],
[1, B, H] or `.unsqueeze(0)` of [B, H], broadcast over S (diffusers 0.42's
ErnieImageAdaLNContinuous, the final_norm of ErnieImageTransformer2DModel:
`x * (1 + scale.unsqueeze(0)) + shift.unsqueeze(0)`). The pattern is adaln_continuous's (every
spelling of the unsqueeze / reshape, the `+ 1` before or after it, Casts around the LayerNorm);
this rule takes the sites rules adaln / adaln_continuous left because the modulation, padded on the
left to x's rank r >= 3, is [1.., M, H] (1 on every dim before x's dim -2):

- M = B, x's dim -2 (any batch; B, M symbolic or unknown taken as equal, as the graph's own
  broadcast needs them to be): one normexport::AdaLNZero on x itself, shift / scale fed as [B, H]
  (a [1.., B, H] tensor reshaped, no data moved) and modulation_axis = r - 2, the dim of x their
  rows follow (the kernel's modulation row is row % B for x [S, B, H]). B = 1 is the same node
  ([1, H]).
- M = 1 with x's dim -2 not 1 (one row for every row of a batch > 1): not the op's [B, H] either
  (rules/adaln.py refuses a [1, H] broadcast over the batch too); left, with the reason.

Every applied fusion is verified locally (docs/design.md §8) by the driver like every other rule's.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from . import _common as c
from .adaln_continuous import AdaLNContinuousFusion, laid_out_leading

TARGETS = frozenset({"trt"})


def required_opset(target: str) -> int:
    return 18


def _dim(d) -> str:
    return str(d) if isinstance(d, int) else str(getattr(d, "value", None) or "?")


def _dims(dims) -> str:
    return "[" + ", ".join(_dim(d) for d in dims) + "]"


def _same(a, b) -> bool:
    return a is not None and b is not None and c.same_dim(a, b)


def _unsqueezed(two_d: ir.Value, axes: ir.Value, what: str) -> list:
    """The dims of Unsqueeze(two_d, axes)."""
    ax = c.const(axes)
    if ax is None:
        raise ValueError(f"{what}: Unsqueeze axes not constant")
    if two_d.shape is None:
        raise ValueError(f"{what}: shape of {two_d.name!r} unknown")
    src = list(two_d.shape)
    out_rank = len(src) + np.asarray(ax).size
    picked = sorted({int(a) % out_rank for a in np.asarray(ax).reshape(-1)})
    it = iter(src)
    return [1 if i in picked else next(it) for i in range(out_rank)]


def _reshaped(two_d: ir.Value, target: ir.Value, what: str) -> list:
    """The dims of Reshape(two_d, target) for a constant target (a 0 or -1 entry: unknown unless
    two_d's dims are static)."""
    t = c.const(target)
    if t is None:
        raise ValueError(f"{what}: Reshape target is not a constant")
    t = [int(d) for d in np.asarray(t).reshape(-1)]
    dims: list = [d if d > 0 else None for d in t]
    src = list(two_d.shape) if two_d.shape is not None else None
    if t.count(-1) == 1 and 0 not in t and src is not None and all(isinstance(d, int) for d in src):
        known = int(np.prod([d for d in t if d > 0], dtype=np.int64))
        total = int(np.prod(src, dtype=np.int64))
        if known > 0 and total % known == 0:
            dims[t.index(-1)] = total // known
    return dims


def layout(dims: list, x: ir.Value, what: str) -> str:
    """The layout of a modulation of shape `dims` as it meets x of rank >= 3 (a rank below x's
    padded on the left): "batch1" (x [S.., 1, H], the modulation [1.., 1, H]) or "seq_first"
    ([1.., B, H], B being x's dim -2 and not 1, or either unknown). ValueError with the reason
    when it is neither."""
    xd = list(x.shape)
    r = len(xd)
    if r < 3:
        raise ValueError(f"x {_dims(xd)} of rank {r}: no leading dims to broadcast over (rule adaln's layouts)")
    if len(dims) > r:
        raise ValueError(f"{what}: shape {_dims(dims)} has more dims than x {_dims(xd)}")
    dims = [1] * (r - len(dims)) + list(dims)
    if not _same(dims[-1], xd[-1]):
        raise ValueError(f"{what}: shape {_dims(dims)} does not end in x's hidden size ({_dims(xd)})")
    if any(d != 1 for d in dims[:-2]):
        raise ValueError(f"{what}: shape {_dims(dims)} varies along a leading dim of x {_dims(xd)}, "
                         "not the sequence-first [1.., B, H]")
    m, b = dims[-2], xd[-2]
    if m == 1:
        if b == 1:
            return "batch1"
        raise ValueError(f"{what}: {_dims(dims)} is one row for every row of x {_dims(xd)} (its dim {r - 2} is "
                         f"{_dim(b)}, not 1): not AdaLNZero's [B, H]")
    if _same(m, b) or not isinstance(m, int) or not isinstance(b, int):
        return "seq_first"
    raise ValueError(f"{what}: shape {_dims(dims)} is not [1.., B, H] of x {_dims(xd)}")


class AdaLNSeqFirstFusion(AdaLNContinuousFusion):
    """adaln_continuous's pattern and checks; only the modulation layout (`_input`) and the
    inputs the fused node gets (`rewrite`) differ."""

    def _input(self, x, full, two_d, axes, shape, what):
        if two_d is not None:
            dims = _unsqueezed(two_d, axes, what) if axes is not None else _reshaped(two_d, shape, what)
            src = two_d
        else:
            if full is None or full.shape is None:
                raise ValueError(f"{what}: shape unknown")
            dims, src = list(full.shape), full
        if x.shape is None:
            raise ValueError("shape of x unknown")
        return src, layout(dims, x, what)

    def check(self, context, x, w, ln, **kw):
        r = super().check(context, x, w, ln, **kw)
        if not r:
            return r
        kinds = (self._shift[1], self._scale[1])
        if len(set(kinds)) != 1:
            return r.fail(f"shift is laid out {kinds[0]}, scale {kinds[1]}: not one layout", x)
        return r

    def rewrite(self, op, x, w, **_):
        dt, rank = self._dtype, len(x.shape)

        def rows(v):
            """`v` ([1.., M, H], or [H]: one row) as [M, H]."""
            if v.shape is None or len(v.shape) != 2:
                hidden = op.Shape(v, start=-1)
                v = op.Reshape(v, op.Concat(op.Constant(value_ints=[-1]), hidden, axis=0))
            return c.as_dtype(op, v, dt)

        ins = [c.as_dtype(op, self._src, dt), rows(self._shift[0]), rows(self._scale[0])]
        ins += self._affine_inputs(op, w, dt)
        y = op.AdaLNZero(*ins, _domain="normexport", _version=1, epsilon=self._eps, modulation_axis=rank - 2)
        return op.Cast(y, to=self._out_dtype.value) if self._out_dtype != dt else y


RULES = [AdaLNSeqFirstFusion.rule("adaln_seq_first", shift_left=False),
         AdaLNSeqFirstFusion.rule("adaln_seq_first_l", shift_left=True)]

__all__ = ["RULES", "TARGETS", "required_opset", "laid_out_leading"]
