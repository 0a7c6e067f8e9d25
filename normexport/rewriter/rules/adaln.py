"""LayerNormalization -> Mul(1 + scale) -> Add(shift)  ==>  normexport::AdaLNZero (target trt).

DiT's modulate(norm(x), shift, scale) = x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1), as the
torch dynamo exporter writes it, and hand-built variants:
    ln = LayerNormalization(x, w[, b]) over the last dim
    s  = Unsqueeze(scale, [1 .. r-2]) | scale (full shape of x, or [B, 1.., H])
    y  = Add(Mul(ln, Add(s, 1)), t)   with t = Unsqueeze(shift, ..) | shift; Mul / Add either order
The op contract: shift/scale both [B, H] or both the full shape of x; weight/bias both or neither
(an all-ones weight with no / all-zero bias is "neither"; a weight alone gets a zero bias).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from . import _common as c

TARGETS = frozenset({"trt"})


def required_opset(target: str) -> int:
    return 18


def _can_be(a, b) -> bool:
    """Whether dim `a` of shift/scale can be dim `b` of x: not when both are known and differ,
    and not a literal 1 against a dim that is not (a broadcast is not the op's [B, H] contract,
    which the plugin kernel reads row by row). Unknown / differently named symbolic dims pass:
    the numeric verification runs them."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return not (a == 1 or b == 1)


def _mod(op, var, name: str):
    """`var` as Unsqueeze(<name>_2d, <name>_axes) ([B, H] -> [B, 1.., H]), or any value."""
    return pattern.OrValue([op.Unsqueeze(pattern.Var(name + "_2d"), pattern.Var(name + "_axes")), var])


class AdaLNFusion(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, shift_left: bool):
        super().__init__(name)
        self._shift_left = shift_left

    def pattern(self, op, x, w, shift, scale):
        ln = op.LayerNormalization(x, w, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["ln"])
        one_plus = c.plus(op, _mod(op, scale, "scale"), 1.0)
        m = c.times(op, ln, one_plus)
        sh = _mod(op, shift, "shift")
        return op.Add(sh, m) if self._shift_left else op.Add(m, sh)

    def _mod_input(self, x: ir.Value, full, two_d, axes, what: str):
        """(value to feed, kind 'bh' | 'full' | 'squeeze', squeeze axes) or raise ValueError."""
        rank = c.rank_of(x)
        if rank is None or rank < 2:
            raise ValueError("rank of x unknown")
        mid = list(range(1, rank - 1))
        if two_d is not None:
            ax = c.const(axes)
            if ax is None:
                raise ValueError(f"{what}: Unsqueeze axes not constant")
            out_rank = c.rank_of(two_d)
            if out_rank != 2:
                raise ValueError(f"{what}: unsqueezed tensor is not [B, H]")
            if sorted(int(a) % rank for a in np.asarray(ax).reshape(-1)) != mid:
                raise ValueError(f"{what}: Unsqueeze axes {np.asarray(ax).tolist()} do not give [B, 1.., H]")
            bdims, xdims = list(two_d.shape), list(x.shape)
            if not (_can_be(bdims[0], xdims[0]) and _can_be(bdims[1], xdims[-1])):
                raise ValueError(f"{what}: shape {bdims} is not [B, H] = {[xdims[0], xdims[-1]]} of x")
            return two_d, "bh"
        if full.shape is None or x.shape is None or len(full.shape) != rank:
            raise ValueError(f"{what}: shape {full.shape} is neither [B, H] unsqueezed nor the shape of x")
        fdims, xdims = list(full.shape), list(x.shape)
        if all(_can_be(f, d) for f, d in zip(fdims, xdims)):
            return full, "full"
        if all(d == 1 for d in fdims[1:-1]) and _can_be(fdims[0], xdims[0]) and _can_be(fdims[-1], xdims[-1]):
            return full, "squeeze"
        raise ValueError(f"{what}: shape {fdims} does not fit x {xdims}")

    def _check_layer_norm(self, r, x: ir.Value, ln: ir.Value):
        """The LayerNormalization: over the last dim only of an x of rank >= 2, mean / inv_std_dev
        unused, float32 statistics (stash_type 1, as AdaLNZero keeps); its epsilon (self._eps).
        Returns `r` (a match) or its failure."""
        node = ln.producer()
        rank = c.rank_of(x)
        axis = c.norm_axis(node)
        if rank is None or rank < 2:
            return r.fail("rank of x unknown or < 2", x)
        if axis % rank != rank - 1:
            return r.fail(f"LayerNormalization axis {axis} does not normalize the last dim only", ln)
        if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
            return r.fail("LayerNormalization mean / inv_std_dev outputs are used", ln)
        stash = node.attributes.get("stash_type")
        if stash is not None and stash.as_int() != 1:
            return r.fail(f"LayerNormalization stash_type {stash.as_int()} (AdaLNZero keeps float32 statistics)", ln)
        eps = node.attributes.get("epsilon")
        self._eps = eps.as_float() if eps is not None else 1e-5
        return r

    def _check_affine(self, r, x: ir.Value, w: ir.Value, ln: ir.Value):
        """The LayerNorm's weight / bias as AdaLNZero's (both or neither): an all-ones weight with no
        or an all-zero bias is "neither" (self._affine False); a weight alone gets a zero bias of x's
        static hidden size (self._h). Returns `r` (a match) or its failure."""
        node = ln.producer()
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        wv, bv = c.const(w), c.const(bias) if bias is not None else None
        self._affine = not (wv is not None and np.all(wv == 1) and (bias is None or (bv is not None and np.all(bv == 0))))
        self._bias = bias
        self._h = c.trailing_dims(x, 1)
        if self._affine and bias is None and self._h is None:
            return r.fail("hidden size not static; cannot make a zero bias", x)
        return r

    def _affine_inputs(self, op, w: ir.Value, dtype: ir.DataType) -> list:
        """[weight, bias] of the AdaLNZero node in `dtype` (a zero bias made where there is none), or
        [] without affine."""
        if not self._affine:
            return []
        bias = self._bias
        if bias is None:
            # a name no initializer has: LayerNorms sharing one weight each get a zero bias here, and
            # onnxscript registers a second initializer of a taken name over the first (whose readers
            # are left reading a value nothing defines)
            name = base = f"{w.name}__zero_bias"
            taken = w.graph.initializers if w.graph is not None else {}
            k = 0
            while name in taken:
                k += 1
                name = f"{base}_{k}"
            bias = op.initializer(c.unit_tensor(name, self._h, dtype, 0.0), name)
        return [c.as_dtype(op, w, dtype), c.as_dtype(op, bias, dtype)]

    def check(self, context, x, w, ln, scale, shift, scale_2d=None, scale_axes=None, shift_2d=None,
              shift_axes=None, **_):
        r = pattern.MatchResult()
        if not self._check_layer_norm(r, x, ln):
            return r
        try:
            self._scale = self._mod_input(x, scale, scale_2d, scale_axes, "scale")
            self._shift = self._mod_input(x, shift, shift_2d, shift_axes, "shift")
        except ValueError as e:
            return r.fail(str(e), x)
        if x.dtype is not None and x.dtype not in c.CUSTOM_OP_TYPES:
            return r.fail(f"normexport::AdaLNZero takes float32/float16/bfloat16, not {x.dtype}", x)
        if (self._scale[1] == "full") != (self._shift[1] == "full"):
            return r.fail("shift and scale differ in form ([B, H] vs full shape)", x)
        for v in (self._scale[0], self._shift[0]):
            if v.dtype is not None and x.dtype is not None and v.dtype != x.dtype:
                return r.fail(f"{v.name!r} dtype differs from x", v)
        return self._check_affine(r, x, w, ln)

    def rewrite(self, op, x, w, **_):
        rank = len(x.shape)

        def feed(v, kind):
            return op.Squeeze(v, op.Constant(value_ints=list(range(1, rank - 1)))) if kind == "squeeze" else v

        ins = [x, feed(*self._shift), feed(*self._scale)] + self._affine_inputs(op, w, x.dtype or ir.DataType.FLOAT)
        return op.AdaLNZero(*ins, _domain="normexport", _version=1, epsilon=self._eps)


RULES = [AdaLNFusion.rule("adaln_zero", shift_left=False), AdaLNFusion.rule("adaln_zero_l", shift_left=True)]

__all__ = ["RULES", "TARGETS", "required_opset"]
