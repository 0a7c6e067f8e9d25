"""Sequence-first AdaLN: LayerNormalization -> Mul(1 + scale) -> Add(shift) with x [S, B, H] and the
modulation broadcast over S  ==>  normexport::AdaLNZero where the op's contract takes it (B = 1),
else left with the reason (target trt).

A sequence-first model modulates as `norm(x) * (1 + scale) + shift` with scale / shift [B, H],
[1, B, H] or `.unsqueeze(0)` of [B, H], broadcast over S (diffusers 0.42's
ErnieImageAdaLNContinuous, the final_norm of ErnieImageTransformer2DModel:
`x * (1 + scale.unsqueeze(0)) + shift.unsqueeze(0)`). The pattern is adaln_continuous's (every
spelling of the unsqueeze / reshape, the `+ 1` before or after it, Casts around the LayerNorm);
this rule takes the sites rules adaln / adaln_continuous left because the modulation, padded on the
left to x's rank r >= 3, is [1.., M, H] (1 on every dim before x's dim -2):

- x [S.., 1, H] (B = 1, static) and M = 1: x is viewed as [1, S.., H] (a Reshape: the same bytes
  in the same order, no data moved), normexport::AdaLNZero gets shift / scale as [1, H] -- its
  [B, H] contract exactly -- and its output is viewed back as x's shape.
- M = B > 1 (or B, M unknown / symbolic): not fused, and the report says why. The op's [B, H]
  layout indexes x's *first* dim (the kernel's modulation row is row / seq); this one needs
  row % B, i.e. a modulation-axis attribute in the op spec (normexport/ops/adaln_zero.py) and its
  kernels. Transposes of x to [B, S, H] and back around the op would write three full-size
  tensors, as many as the LayerNorm + Mul + Add they replace (the project's rule for transposed
  LayerNorms, rules/_common.py TRANSPOSED_LN_PASSES, fuses only when that is fewer).
- M = 1 with x's dim -2 not 1 (one row for every row of a batch > 1): not the op's [B, H] either
  (rules/adaln.py refuses a [1, H] broadcast over the batch too); left, with the reason.

Every applied fusion is verified locally (DESIGN §8) by the driver like every other rule's.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from . import _common as c
from .adaln_continuous import AdaLNContinuousFusion

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


def seq_first_why(x: ir.Value) -> str:
    xd = list(x.shape)
    r = len(xd)
    return (f"shift / scale [1.., B, H] over x {_dims(xd)} are sequence-first (broadcast over the leading "
            f"dim{'s' if r > 3 else ''}, one row per entry of dim {r - 2}, B = {_dim(xd[-2])}): "
            "normexport::AdaLNZero's [B, H] modulation indexes x's first dim; this layout needs a "
            "modulation-axis attribute in the op and its kernel, and Transposes around the op would write "
            "3 full-size tensors, no fewer than LayerNorm + Mul + Add")


def laid_out_leading(v: ir.Value | None, x: ir.Value) -> bool:
    """Whether `v` (a modulation as it meets x, x of rank >= 3) is constant along x's leading
    dims, [1.., M, H]: this module's layouts (its rule fuses them or says why not)."""
    if v is None or v.shape is None or x.shape is None or len(x.shape) < 3 or len(v.shape) > len(x.shape):
        return False
    dims = [1] * (len(x.shape) - len(v.shape)) + list(v.shape)
    return all(d == 1 for d in dims[:-2])


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
        if kinds == ("seq_first", "seq_first"):
            return r.fail(seq_first_why(x), x)
        if kinds != ("batch1", "batch1"):
            return r.fail(f"shift is laid out {kinds[0]}, scale {kinds[1]}: not one layout", x)
        self._h = c.trailing_dims(x, 1)
        if self._h is None:
            return r.fail("hidden size not static; cannot view x as [1, S, H]", x)
        return r

    def rewrite(self, op, x, w, **_):
        dt, h, xd = self._dtype, self._h[0], list(x.shape)

        def row(v):
            """`v` (H elements) as [1, H]."""
            if not (v.shape is not None and list(v.shape) == [1, h]):
                v = op.Reshape(v, op.Constant(value_ints=[1, h]))
            return c.as_dtype(op, v, dt)

        # x [S.., 1, H] viewed as [1, S.., H] (same bytes, same order), and the result viewed back:
        # a constant shape where x has at most one leading dim not known, else x's own shape
        xv = op.Reshape(c.as_dtype(op, self._src, dt), op.Constant(value_ints=[1, -1, h]))
        ins = [xv, row(self._shift[0]), row(self._scale[0])] + self._affine_inputs(op, w, dt)
        y = op.AdaLNZero(*ins, _domain="normexport", _version=1, epsilon=self._eps)
        lead = [d if isinstance(d, int) else -1 for d in xd[:-2]]
        back = op.Constant(value_ints=lead + [1, h]) if lead.count(-1) <= 1 else op.Shape(self._src)
        y = op.Reshape(y, back)
        return op.Cast(y, to=self._out_dtype.value) if self._out_dtype != dt else y


RULES = [AdaLNSeqFirstFusion.rule("adaln_seq_first", shift_left=False),
         AdaLNSeqFirstFusion.rule("adaln_seq_first_l", shift_left=True)]

__all__ = ["RULES", "TARGETS", "required_opset", "laid_out_leading"]
