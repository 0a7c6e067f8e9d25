"""Gated residual Add -> normexport::AdaLNZero  ==>  normexport::GatedAdaLNZero (target trt).

DiT's block, after the adaln rules: `x = x + gate_msa.unsqueeze(1) * attn_out`, then
`modulate(norm2(x), shift_mlp, scale_mlp)`:
    g = Unsqueeze(gate_2d, [1 .. r-2]) | gate (the full shape of x, or [B, 1.., H])
    s = Add(x, Mul(g, u))                   Add / Mul either operand order
    y = normexport::AdaLNZero(s, shift, scale[, weight, bias])
==> y, s' = normexport::GatedAdaLNZero(x, u, gate, shift, scale[, weight, bias], epsilon=eps)
where s' replaces s for its other consumers (the next residual add, rule gated_adaln_zero_residual).

The op contract (docs/design.md §2): x and u of the sum's full shape; gate in the layout of the AdaLNZero
node's shift / scale: [B, H] (an Unsqueeze of [B, H], or a [B, 1.., H] tensor, squeezed) when
they are [B, H], the full shape of x when they are; one dtype (float32 / float16 / bfloat16); the
sum not a graph output. An AdaLNZero whose [B, H] rows follow another dim of x (its
modulation_axis a, e.g. 1 for a sequence-first x [S, B, H], rule adaln_seq_first) needs the gate
laid out the same way: an Unsqueeze of [B, H] at every axis but a and the last, or a tensor that is
[1.., B, 1.., H] with B at dim a (numpy's left padding allowed down to a [B, H] gate when a = r - 2),
squeezed; the fused node gets the same modulation_axis.
Every applied fusion is verified locally (docs/design.md §8).
"""

from __future__ import annotations


import numpy as np
from onnxscript.rewriter import pattern

from . import _common as c
# the residual fusion rules' gate, as skip_rms_norm_trt's: target trt, opset 18; on by default,
# `--no-residual-fusion` turns them off (rewriter/switches.py)
from .skip_rms_norm_trt import TARGETS, required_opset


def _gate(op):
    return pattern.OrValue([op.Unsqueeze(pattern.Var("gate_2d"), pattern.Var("gate_axes")), pattern.Var("gate")])


class GatedAdaLNFusion(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, residual: bool, add_left: bool):
        super().__init__(name)
        self._residual = residual
        self._add_left = add_left

    def pattern(self, op, x, u, shift, scale):
        m = c.times(op, _gate(op), u)
        s = op.Add(m, x, _outputs=["sum"]) if self._add_left else op.Add(x, m, _outputs=["sum"])
        y = op.AdaLNZero(s, shift, scale, _domain="normexport", _allow_other_inputs=True,
                         _allow_other_attributes=True, _outputs=["norm"])
        return (y, s) if self._residual else y

    def check(self, context, x, u, shift, scale, sum, norm, gate=None, gate_2d=None, gate_axes=None,  # noqa: A002
              **_):
        r = pattern.MatchResult()
        if gate_2d is None and gate is not None and not c.same_shape(u.shape, sum.shape) and \
                c.same_shape(gate.shape, sum.shape):
            # Mul(update, Unsqueeze(gate)): the first Mul operand order bound them the other way round
            gate, u = u, gate
            p = gate.producer()
            if p is not None and p.op_type == "Unsqueeze" and p.domain in ("", "ai.onnx") and len(p.inputs) == 2:
                gate_2d, gate_axes, gate = p.inputs[0], p.inputs[1], None
        if sum.is_graph_output():
            return r.fail("the residual sum is a graph output (kept as the Add)", sum)
        rank = c.rank_of(sum)
        if rank is None or rank < 2:
            return r.fail("rank of the residual sum unknown or < 2", sum)
        if not (c.same_shape(x.shape, sum.shape) and c.same_shape(u.shape, sum.shape)):
            return r.fail("x or the update is not known to have the sum's shape (GatedAdaLNZero adds no broadcast)",
                          sum)
        dt = x.dtype
        if dt not in c.CUSTOM_OP_TYPES:
            return r.fail(f"normexport::GatedAdaLNZero takes float32/float16/bfloat16, not {dt}", x)
        g = gate_2d if gate_2d is not None else gate
        for v in (u, g, shift, scale):
            if v is None or v.dtype != dt:
                return r.fail(f"{getattr(v, 'name', None)!r} dtype differs from x's {dt}", x)
        mod_full = shift.shape is not None and len(shift.shape) == rank
        node = norm.producer()
        attr = node.attributes.get("modulation_axis")
        axis = attr.as_int() if attr is not None else 0  # the dim of x the [B, H] rows follow
        if not 0 <= axis <= rank - 2:
            return r.fail(f"AdaLNZero modulation_axis {axis} out of range for rank {rank}", sum)
        want = "[B, 1.., H]" if axis == 0 else f"[B, H] at dim {axis} of x"
        others = [i for i in range(rank - 1) if i != axis]  # the dims a [B, H] gate is broadcast over
        self._squeeze = None
        if gate_2d is not None:
            ax = c.const(gate_axes)
            if ax is None or sorted(int(a) % rank for a in np.asarray(ax).reshape(-1)) != others:
                return r.fail(f"gate Unsqueeze axes do not give {want}", sum)
            if mod_full or c.rank_of(gate_2d) != 2:
                return r.fail("gate is [B, H] but the AdaLNZero modulation is not (or not 2-D)", sum)
        elif mod_full:
            if not c.same_shape(gate.shape, sum.shape):
                return r.fail("gate is not known to have the shape of x (the modulation's full-shape layout)", sum)
        else:
            gdims = list(gate.shape) if gate.shape is not None else None
            pad = rank - len(gdims) if gdims is not None else 0  # numpy broadcasting pads on the left
            padded = [1] * pad + gdims if gdims is not None else None
            ok = padded is not None and 0 <= pad <= axis and all(padded[i] == 1 for i in others) and \
                shift.shape is not None and len(shift.shape) == 2 and c.same_dim(padded[axis], shift.shape[0]) and \
                c.same_dim(padded[-1], shift.shape[-1])
            if not ok:
                return r.fail(f"gate shape {gdims} is not {want} of the [B, H] modulation", sum)
            self._squeeze = [i - pad for i in others if i >= pad]  # the gate's own axes to drop
        self._gate, self._x, self._u = g, x, u
        self._axis = axis
        self._rest = list(node.inputs[3:])
        eps = node.attributes.get("epsilon")
        self._eps = eps.as_float() if eps is not None else 1e-6
        self._rank = rank
        return r

    def rewrite(self, op, shift, scale, **_):
        g, x, u = self._gate, self._x, self._u
        if self._squeeze:
            g = op.Squeeze(g, op.Constant(value_ints=self._squeeze))
        kw = {"modulation_axis": self._axis} if self._axis else {}
        y, s = op.GatedAdaLNZero(x, u, g, shift, scale, *self._rest, _domain="normexport", _version=1,
                                 epsilon=self._eps, _outputs=2, **kw)
        return (y, s) if self._residual else y


RULES = [GatedAdaLNFusion.rule(f"gated_adaln_zero{'_residual' if res else ''}{'_l' if left else ''}",
                               residual=res, add_left=left)
         for res in (False, True) for left in (False, True)]

__all__ = ["RULES", "TARGETS", "required_opset"]
