"""Decomposed LayerNorm -> LayerNormalization (opset >= 17; the driver upgrades the model).

Matched forms (an upcast Cast(x) in front is absorbed when nothing else reads it):
    m  = ReduceMean(x, axes, keepdims=1)          axes as attribute (< 18) or input
    d  = Sub(x, m)
    vr = ReduceMean(Pow(d, 2) | Mul(d, d), same axes)
    v  = Add(vr, eps) (either order), eps a constant scalar
    n  = d / sqrt(v): Div(d, Sqrt(v)) | Mul(d, Reciprocal(Sqrt(v))) | Mul(d, Div(1, Sqrt(v)))
         | Mul(d, Pow(v, -0.5))  (Mul operands in either order)
    y  = n | Cast(n) | Mul(Cast?(n), w) | Add(Mul(Cast?(n), w), b)  (Mul / Add in either order)
No affine: scale = ones. stash_type = float.
Axes: the trailing k dims -> LayerNormalization(axis=-k); other dims (axis 1 of [N, C, L], the
channels of [N, C, H, W]) -> Transpose moving them last, LayerNormalization, Transpose back, when
the decomposition writes more full-size tensors than those three nodes (_common.layer_norm).
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from . import _common as c

TARGETS = frozenset({"trt", "ort", "onnx"})


def required_opset(target: str) -> int:
    return 17


class LayerNormFusion(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, root: str, form: str | None = None, left: bool = False):
        super().__init__(name)
        self._root, self._form, self._left = root, form, left

    def pattern(self, op, x, eps, weight, bias):
        xc = x  # an upcast Cast(x) feeding this is absorbed in check when nothing else reads it
        mean = op.ReduceMean(xc, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["mean"])
        d = op.Sub(xc, mean)
        var = op.ReduceMean(c.square(op, d), _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["var"])
        v = c.plus(op, var, eps)
        if self._root == "bare":
            return c.inv_sqrt(op, d, v, self._form)
        if self._root == "cast":
            return op.Cast(c.inv_sqrt_any(op, d, v), to=pattern.AttrVar("out_dtype"))
        n = pattern.OrValue([op.Cast(c.inv_sqrt(op, d, v, f), to=pattern.AttrVar("out_dtype")) for f in c.INV_FORMS]
                            + [c.inv_sqrt(op, d, v, f) for f in c.INV_FORMS])
        if self._root == "weight":
            return op.Mul(weight, n) if self._left else op.Mul(n, weight)
        scaled = c.times(op, n, weight)
        return op.Add(bias, scaled) if self._left else op.Add(scaled, bias)

    def check(self, context, x, eps, mean, var, weight=None, bias=None, **_):
        r = pattern.MatchResult()
        self._out = context.output_values[0] if context.output_values else None
        self._src = c.absorb_cast(context, x)
        if x.dtype is not None and x.dtype not in c.FLOAT_TYPES:
            return r.fail(f"input dtype {x.dtype} is not a float type", x)
        self._eps = c.const_scalar(eps)
        if self._eps is None:
            return r.fail("epsilon is not a constant scalar", eps)
        axes, why = c.reduce_axes(mean.producer())
        if axes is None:
            return r.fail(why, mean)
        axes2, why = c.reduce_axes(var.producer())
        if axes2 is None:
            return r.fail(why, var)
        rank = c.rank_of(x)
        self._axes, why = c.norm_axes(axes, rank)
        if self._axes is None:
            return r.fail(f"mean over axes {axes}: {why}", mean)
        if c.norm_axes(axes2, rank)[0] != self._axes:
            return r.fail(f"mean axes {axes} and variance axes {axes2} differ", var)
        return c.finish_layer_norm_check(self, r, context, x, weight, bias, rank)

    def rewrite(self, op, x, weight=None, bias=None, **_):
        return c.rewrite_layer_norm(self, op, self._src, weight, bias, "ln")


RULES = [
    LayerNormFusion.rule("layer_norm_affine", root="affine"),
    LayerNormFusion.rule("layer_norm_affine_l", root="affine", left=True),
    LayerNormFusion.rule("layer_norm_weight", root="weight"),
    LayerNormFusion.rule("layer_norm_weight_l", root="weight", left=True),
    LayerNormFusion.rule("layer_norm_cast", root="cast"),
] + [LayerNormFusion.rule(f"layer_norm_{f}", root="bare", form=f) for f in c.INV_FORMS]

__all__ = ["RULES", "TARGETS", "required_opset"]
