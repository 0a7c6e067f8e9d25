"""Modulated LayerNorm in the forms rules/adaln.py leaves  ==>  normexport::AdaLNZero (target trt).

diffusers' AdaLayerNormContinuous (SD3's context stream, the norm_out of SD3 and Flux) writes
    self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]
so the `+ 1` comes before the unsqueeze; fp32 LayerNorms (`F.layer_norm(x.float(), ..).to(dtype)`)
put a Cast between the LayerNorm and the modulation. Matched here (after rules/adaln.py took its
forms), as the dynamo and the TorchScript exporters write them:
    ln = LayerNormalization(x | Cast(x), w[, b]) over the last dim; l = ln | Cast(ln)
    s  = Unsqueeze(1 + scale) | Reshape(1 + scale) | 1 + Unsqueeze(scale) | 1 + Reshape(scale)
         | 1 + scale  (scale [B, H] before the Unsqueeze / Reshape, else full shape or [B, 1.., H])
    t  = Unsqueeze(shift) | Reshape(shift) | shift (same shapes)
    y  = Add(Mul(l, s), t)   Mul / Add / the `+ 1` in either order
A Reshape counts as the unsqueeze only when its target is constant and makes [B, H] into
[B, 1.., H]. The fused node computes in the wider of the LayerNorm's input dtype and the
modulation's dtype and is cast to the latter when they differ.

explain_unapplied reports every LayerNormalization still followed by a runtime Mul (a modulation
that stayed unfused: output read elsewhere, a factor that is not (1 + scale), no shift).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from normexport.ir_utils import ONNX_DOMAINS as _ONNX

from . import _common as c
from .adaln import AdaLNFusion, _can_be

TARGETS = frozenset({"trt"})


def required_opset(target: str) -> int:
    return 18


def _shaped(op, v, name: str):
    """`v` unsqueezed or reshaped ([B, H] -> [B, 1.., H]), binding <name>_axes / <name>_shape."""
    return [op.Unsqueeze(v, pattern.Var(name + "_axes")), op.Reshape(v, pattern.Var(name + "_shape"))]


def _one_plus(op, v):
    return c.plus(op, v, 1.0)


class AdaLNContinuousFusion(AdaLNFusion):
    """remove_nodes=False: the modulation's own nodes (1 + scale, the unsqueezes) may be shared by
    several sites (one shift / scale modulating two LayerNorms, or an exporter's CSE); they stay
    while something reads them. The LayerNorm -> (Cast) -> Mul chain must be read by this site
    alone (check), else the LayerNorm would run twice."""

    def __init__(self, name: str, shift_left: bool):
        pattern.RewriteRuleClassBase.__init__(self, name, remove_nodes=False)
        self._shift_left = shift_left

    def pattern(self, op, x, w, shift, scale):
        ln = op.LayerNormalization(x, w, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["ln"])
        lnv = pattern.OrValue([op.Cast(ln), ln])
        s2d = pattern.Var("scale_2d")
        s = pattern.OrValue(_shaped(op, _one_plus(op, s2d), "scale")
                            + [_one_plus(op, v) for v in _shaped(op, pattern.Var("scale_2d"), "scale")]
                            + [_one_plus(op, scale)])
        m = c.times(op, lnv, s)
        t = pattern.OrValue(_shaped(op, pattern.Var("shift_2d"), "shift") + [shift])
        return op.Add(t, m) if self._shift_left else op.Add(m, t)

    def _reshaped(self, x: ir.Value, two_d: ir.Value, target: ir.Value, what: str):
        """Reshape(two_d, target) must make [B, H] into [B, 1.., H]."""
        t = c.const(target)
        rank = c.rank_of(x)
        if t is None:
            raise ValueError(f"{what}: Reshape target is not a constant")
        t = [int(d) for d in np.asarray(t).reshape(-1)]
        if c.rank_of(two_d) != 2 or len(t) != rank or any(d != 1 for d in t[1:-1]):
            raise ValueError(f"{what}: Reshape to {t} does not make [B, H] into [B, 1.., H]")
        reshape = target.uses()[0][0] if target.uses() else None
        allowzero = reshape.attributes.get("allowzero") if reshape is not None else None
        bdims, xdims = list(two_d.shape), list(x.shape)
        # a literal batch / hidden size must be that of x (and of [B, H] where known); unknown dims
        # of [B, H] pass: the numeric verification runs them
        first_ok = (t[0] == 0 and (allowzero is None or allowzero.as_int() == 0)) or (t[0] == -1 and t[-1] != -1) \
            or (t[0] > 0 and _can_be(t[0], xdims[0]) and _can_be(bdims[0], t[0]))
        last_ok = (t[-1] == -1 and t[0] != -1) or (t[-1] > 0 and _can_be(t[-1], xdims[-1]) and _can_be(bdims[1], t[-1]))
        if not (first_ok and last_ok):
            raise ValueError(f"{what}: Reshape to {t} does not keep [B, H] as [B, 1.., H]")
        if not (_can_be(bdims[0], xdims[0]) and _can_be(bdims[1], xdims[-1])):
            raise ValueError(f"{what}: shape {bdims} is not [B, H] = {[xdims[0], xdims[-1]]} of x")
        return two_d, "bh"

    @staticmethod
    def _chain_alone(context, ln: ir.Value) -> str:
        """Why LayerNormalization -> (Cast) -> Mul is read outside this match ("" when it is not)."""

        def alone(v: ir.Value, what: str) -> str:
            n = len(v.uses())
            if n == 1 and not v.is_graph_output():
                return ""
            out = " and is a graph output" if v.is_graph_output() else ""
            return f"{what} is read by {n} nodes{out}: fusing would compute it twice"

        why = alone(ln, "LayerNormalization output")
        user = ln.uses()[0][0] if not why else None
        if user is not None and user.op_type == "Cast":
            why = alone(user.outputs[0], "Cast of the LayerNormalization output")
            user = user.outputs[0].uses()[0][0] if not why else None
        if user is not None:  # the Mul
            why = alone(user.outputs[0], "modulated LayerNorm (before the shift)")
        return why

    def _input(self, x, full, two_d, axes, shape, what):
        if two_d is not None and shape is not None:
            return self._reshaped(x, two_d, shape, what)
        return self._mod_input(x, full, two_d, axes, what)

    def check(self, context, x, w, ln, scale=None, shift=None, scale_2d=None, scale_axes=None, scale_shape=None,
              shift_2d=None, shift_axes=None, shift_shape=None, **_):
        r = pattern.MatchResult()
        if not self._check_layer_norm(r, x, ln):
            return r
        why = self._chain_alone(context, ln)
        if why:
            return r.fail(why, ln)
        try:
            self._scale = self._input(x, scale, scale_2d, scale_axes, scale_shape, "scale")
            self._shift = self._input(x, shift, shift_2d, shift_axes, shift_shape, "shift")
        except ValueError as e:
            return r.fail(str(e), x)
        if (self._scale[1] == "full") != (self._shift[1] == "full"):
            return r.fail("shift and scale differ in form ([B, H] vs full shape)", x)
        out = context.output_values[0]
        self._src = c.absorb_cast(context, x)
        self._out_dtype = out.dtype
        src_dt = self._src.dtype
        if src_dt is None or out.dtype is None:
            return r.fail("dtype of x or of the modulated output unknown", x)
        wider = c._PRECISION.get(src_dt, 0) >= c._PRECISION.get(out.dtype, 0)
        self._dtype = src_dt if wider else out.dtype
        if self._dtype not in c.CUSTOM_OP_TYPES:
            return r.fail(f"normexport::AdaLNZero takes float32/float16/bfloat16, not {self._dtype}", x)
        for v in (self._scale[0], self._shift[0]):
            if v.dtype is not None and v.dtype != out.dtype:
                return r.fail(f"{v.name!r} dtype differs from the modulated output", v)
        return self._check_affine(r, x, w, ln)

    def rewrite(self, op, x, w, **_):
        rank, dt = len(x.shape), self._dtype

        def feed(v, kind):
            if kind == "squeeze":
                v = op.Squeeze(v, op.Constant(value_ints=list(range(1, rank - 1))))
            return c.as_dtype(op, v, dt)

        ins = [c.as_dtype(op, self._src, dt), feed(*self._shift), feed(*self._scale)] + self._affine_inputs(op, w, dt)
        y = op.AdaLNZero(*ins, _domain="normexport", _version=1, epsilon=self._eps)
        return op.Cast(y, to=self._out_dtype.value) if self._out_dtype != dt else y


RULES = [AdaLNContinuousFusion.rule("adaln_continuous", shift_left=False),
         AdaLNContinuousFusion.rule("adaln_continuous_l", shift_left=True)]


# ---- why a modulated LayerNorm stayed ---------------------------------------------------------


def _through(v: ir.Value, ops: tuple[str, ...]) -> ir.Value:
    """`v` followed through single-use nodes of the given types (Cast, Unsqueeze, Reshape)."""
    while v is not None:
        p = v.producer()
        if p is None or p.op_type not in ops or p.domain not in _ONNX:
            return v
        v = p.inputs[0]
    return v


def _factor_why(f: ir.Value) -> str | None:
    """Why the Mul factor `f` is not (1 + scale) (None when it is)."""
    g = _through(f, ("Unsqueeze", "Reshape", "Cast"))
    p = g.producer() if g is not None else None
    if p is not None and p.op_type == "Add" and p.domain in _ONNX:
        for a, b in (p.inputs, reversed(p.inputs)):
            k = c.const(a)
            if k is not None and c.const(b) is None:
                vals = np.unique(np.asarray(k, np.float64))
                if vals.size == 1 and vals[0] == 1.0:
                    return None
                return (f"modulation factor is ({vals.tolist()[0] if vals.size == 1 else 'c'} + scale), "
                        "not (1 + scale)")
    if p is not None and p.op_type == "Sub" and p.domain in _ONNX:
        return "modulation factor is a Sub, not (1 + scale)"
    return "modulation factor is not (1 + scale) (no `1 +` before the Mul)"


def laid_out_leading(v: ir.Value | None, x: ir.Value) -> bool:
    """Whether `v` (a modulation as it meets x, x of rank >= 3) is constant along x's leading
    dims, [1.., M, H]: rule adaln_seq_first's layouts (it fuses them or says why not)."""
    if v is None or v.shape is None or x.shape is None or len(x.shape) < 3 or len(v.shape) > len(x.shape):
        return False
    dims = [1] * (len(x.shape) - len(v.shape)) + list(v.shape)
    return all(d == 1 for d in dims[:-2])


def _left_to_seq_first(ln: ir.Node, mul: ir.Node, factor: ir.Value) -> bool:
    """Whether the modulation (factor and the shift added after `mul`) is broadcast over x's
    leading dims: rule adaln_seq_first's layouts, which it reports itself."""
    x = ln.inputs[0]
    adds = [u for u, _ in mul.outputs[0].uses() if u.op_type == "Add" and u.domain in _ONNX]
    if x is None or len(adds) != 1:
        return False
    shift = next((v for v in adds[0].inputs if v is not mul.outputs[0]), None)
    return laid_out_leading(factor, x) and laid_out_leading(shift, x)


def explain_unapplied(proto) -> list[tuple[ir.Node, str]]:
    """Each LayerNormalization left whose output is multiplied by a runtime value (a modulation
    that was not fused) with the reason."""
    out = []
    model = proto if isinstance(proto, ir.Model) else ir.serde.deserialize_model(proto)
    if not any(n.op_type == "LayerNormalization" for n in model.graph):
        return out
    for node in model.graph:
        if node.op_type != "LayerNormalization" or node.domain not in _ONNX:
            continue
        y = node.outputs[0]
        users = [u for u, _ in y.uses()]
        if len(users) == 1 and users[0].op_type == "Cast" and not y.is_graph_output():
            y = users[0].outputs[0]
            users = [u for u, _ in y.uses()]
        muls = [u for u in users if u.op_type == "Mul" and u.domain in _ONNX]
        runtime = [(m, next((v for v in m.inputs if v is not y), None)) for m in muls]
        runtime = [(m, f) for m, f in runtime if f is not None and c.const(f) is None]
        if not runtime:
            continue  # a plain LayerNorm (maybe with a constant affine): nothing to fuse
        mul, factor = runtime[0]
        if len(users) > 1 or y.is_graph_output():
            why = (f"LayerNormalization output is read by {len(users)} nodes"
                   f"{' and is a graph output' if y.is_graph_output() else ''}: fusing would compute it twice")
        elif (fw := _factor_why(factor)) is not None:
            why = fw
        elif not any(u.op_type == "Add" and u.domain in _ONNX for u, _ in mul.outputs[0].uses()):
            why = "no shift is added after the modulation (AdaLNZero is LayerNorm * (1 + scale) + shift)"
        elif _left_to_seq_first(node, mul, factor):
            continue  # rule adaln_seq_first (the next module) fuses it or says why not
        else:
            why = "modulated LayerNorm not fused (see the adaln rule rejections)"
        out.append((node, why))
    return out


__all__ = ["RULES", "TARGETS", "required_opset", "explain_unapplied"]
