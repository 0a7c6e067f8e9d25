"""One-pass-variance LayerNorm -> LayerNormalization (opset >= 17; the driver upgrades the model).

How tf2onnx writes Flax / Keras / JAX LayerNorms (var = E[x²] − E[x]², Flax's fast variance), in
the canonical forms the driver brings the graph to first (rewriter/canonical.py): ReduceSum · 1/n,
1/n · ReduceSum and ReduceSum / n are ReduceMean there (only where the factor is 1/n for the reduced
element count: 1/(n−1), an unbiased variance, is not a LayerNorm); keepdims=0 statistics broadcast
back by Reshape / Expand are keepdims=1; Div(1, Sqrt(v)) and Pow(v, -0.5) are Reciprocal(Sqrt(v)):
    mean = ReduceMean(x, axes)
    msq  = the same of x² (Mul(x, x) | Pow(x, 2)), over the same axes
    var  = msq − mean² (Mul(mean, mean) | Pow(mean, 2)), optionally Max(var, 0) (either order)
         | the mean of (x − mean)² (tf.nn.moments: Keras, Flax without fast variance)
    v    = var + eps (either order), eps a constant scalar
    r    = Reciprocal(Sqrt(v))                                        (Rsqrt as tf2onnx spells it)
    a    = r · scale (either order) | r                               (Flax: mul = rsqrt(v) * scale)
    y    = (x − mean) · a [+ bias]                                    (Flax)
         | x · a + (bias − mean · a)                                  (tf.nn.batch_normalization, Keras)
Axes: the trailing dims -> LayerNormalization(axis=-k); other dims (e.g. axis 1 of [N, C, L]) ->
Transpose, LayerNormalization over the moved dims, Transpose back, when the decomposition writes
more full-size tensors than those three nodes (it always has so far: 6 or more).
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from . import _common as c

TARGETS = frozenset({"trt", "ort", "onnx"})

def required_opset(target: str) -> int:
    return 17


def _mean(op, t, i: int):
    """ReduceMean of `t` over some axes (the canonical mean); binds red{i}."""
    return op.ReduceMean(t, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=[f"red{i}"])


class OnePassLayerNormFusion(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, scaled: bool, bias: bool, keras: bool = False, left: bool = False):
        super().__init__(name)
        self._scaled, self._bias, self._keras, self._left = scaled, bias, keras, left

    def _root(self, op_type, op, p, q):
        """The last node (a concrete node: onnxscript cannot start a match at a choice), its operands
        in the rule's order."""
        return getattr(op, op_type)(q, p) if self._left else getattr(op, op_type)(p, q)

    def pattern(self, op, x, eps, zero, weight, bias):
        mean = _mean(op, x, 1)
        msq = _mean(op, c.square(op, x), 2)
        var = op.Sub(msq, c.square(op, mean), _outputs=["var"])
        two_pass = _mean(op, c.square(op, op.Sub(x, mean)), 3)  # tf.nn.moments: mean of SquaredDifference(x, mean)
        var = pattern.OrValue([op.Max(var, zero), op.Max(zero, var), var, two_pass], tag_var="clamp",
                              tag_values=[True, True, False, False])
        v = c.plus(op, var, eps)
        r = op.Reciprocal(op.Sqrt(v))
        a = c.times(op, r, weight) if self._scaled else r
        if self._keras:
            return self._root("Add", op, c.times(op, x, a), op.Sub(bias, c.times(op, mean, a)))
        if self._bias:
            return self._root("Add", op, c.times(op, op.Sub(x, mean), a), bias)
        return self._root("Mul", op, op.Sub(x, mean), a)

    def check(self, context, x, eps, zero=None, weight=None, bias=None, **kw):
        r = pattern.MatchResult()
        self._out = context.output_values[0] if context.output_values else None
        if x.dtype is not None and x.dtype not in c.FLOAT_TYPES:
            return r.fail(f"input dtype {x.dtype} is not a float type", x)
        self._eps = c.const_scalar(eps)
        if self._eps is None or self._eps < 0:
            return r.fail("epsilon is not a constant scalar >= 0", eps)
        if kw.get("clamp") and c.const_scalar(zero) != 0.0:
            return r.fail("the variance is clamped with Max against something other than 0", zero)
        rank = c.rank_of(x)
        found = []
        for i in (1, 2 if kw.get("red2") is not None else 3):
            red = kw.get(f"red{i}")
            if red is None:
                return r.fail(f"mean {i} not bound", x)
            axes, why = c.reduce_axes(red.producer())
            if axes is None:
                return r.fail(why, red)
            axes, why = c.norm_axes(axes, rank)
            if axes is None:
                return r.fail(why, red)
            found.append(axes)
        if found[0] != found[1]:
            return r.fail(f"mean axes {found[0]} and mean-square axes {found[1]} differ", x)
        self._axes = found[0]
        return c.finish_layer_norm_check(self, r, context, x, weight, bias, rank)

    def rewrite(self, op, x, weight=None, bias=None, **_):
        return c.rewrite_layer_norm(self, op, x, weight, bias, "ln1p")


RULES = [
    OnePassLayerNormFusion.rule(
        f"layer_norm_one_pass{'_keras' if keras else ''}{'_scale' if scaled else ''}{'_bias' if bias else ''}"
        f"{'_l' if left else ''}", scaled=scaled, bias=bias, keras=keras, left=left)
    for keras, scaled, bias in ((False, True, True), (False, True, False), (False, False, True), (False, False, False),
                                (True, True, True), (True, False, True))
    for left in (False, True)
]

__all__ = ["RULES", "TARGETS", "required_opset"]
