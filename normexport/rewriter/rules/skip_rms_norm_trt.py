"""Residual Add -> normexport::RMSNorm  ==>  normexport::SkipRMSNorm (target trt).

Matched (the rms_norm rule's output for target trt):
    s = Add(a, b)                          the residual sum (LLaMA: h = x + attn(x))
    y = normexport::RMSNorm(s, scale)      over the last dim only
==> y, s' = normexport::SkipRMSNorm(a, b, scale, epsilon=eps)
where s' replaces s for its other consumers (the residual stream, rule skip_rms_norm_trt_residual);
when nothing else reads s the fused node's Sum output is left unread (rule skip_rms_norm_trt).
One pass over the activations instead of two: the plugin reads a and b once and writes y and the
sum (4 tensor passes instead of 5, and one launch instead of two).

The op contract (DESIGN §2): a and b of the sum's full shape (no broadcast operand), the same
float32 / float16 / bfloat16 dtype as scale; scale one value per element of the last dim
([H], or [1.., H], reshaped); the sum not a graph output (kept as the Add it is). Every applied
fusion is verified locally (DESIGN §8) as every other.
"""

from __future__ import annotations


import onnx_ir as ir
from onnxscript.rewriter import pattern

from . import _common as c

TARGETS = frozenset({"trt"})
#: Opt-in for now: with NORMEXPORT_RESIDUAL_FUSION=1 in the environment (_common.residual_fusion_enabled).
ENV_FLAG = c.RESIDUAL_FUSION_ENV


def rules_for(target: str) -> list:
    return RULES if target in TARGETS and c.residual_fusion_enabled() else []


def required_opset(target: str) -> int:
    return 18


def same_dim(d1, d2) -> bool:
    """Whether two dims are known to be equal (ints, or symbolic dims of the same name)."""
    if isinstance(d1, int) and isinstance(d2, int):
        return d1 == d2
    if isinstance(d1, ir.SymbolicDim) and isinstance(d2, ir.SymbolicDim):
        return d1.value is not None and d1.value == d2.value
    return False


def same_shape(v1: ir.Value, v2: ir.Value) -> bool:
    """Whether two values are known to have the same shape (ints, or equally named symbols)."""
    if v1.shape is None or v2.shape is None or len(v1.shape) != len(v2.shape):
        return False
    return all(same_dim(a, b) for a, b in zip(v1.shape, v2.shape))


class SkipRMSNormTrtFusion(pattern.RewriteRuleClassBase):
    """residual=False: only the norm reads the sum; residual=True: other nodes read it too."""

    def __init__(self, name: str, residual: bool):
        super().__init__(name)
        self._residual = residual

    def pattern(self, op, a, b, scale):
        s = op.Add(a, b, _outputs=["sum"])
        y = op.RMSNorm(s, scale, _domain="normexport", _allow_other_attributes=True, _outputs=["norm"])
        return (y, s) if self._residual else y

    def check(self, context, a, b, scale, sum, norm, **_):  # noqa: A002 - the pattern's name
        r = pattern.MatchResult()
        node = norm.producer()
        if sum.is_graph_output():
            return r.fail("the residual sum is a graph output (kept as the Add)", sum)
        rank = c.rank_of(sum)
        if rank is None:
            return r.fail("rank of the residual sum unknown", sum)
        axis = node.attributes.get("axis")
        axis = axis.as_int() if axis is not None else -1
        if axis % rank != rank - 1:
            return r.fail(f"RMSNorm axis {axis} does not normalize the last dim only", norm)
        if not (same_shape(a, sum) and same_shape(b, sum)):
            return r.fail(f"an Add operand ({None if a.shape is None else list(a.shape)} / "
                          f"{None if b.shape is None else list(b.shape)}) is not known to have the sum's shape "
                          f"{list(sum.shape) if sum.shape is not None else None} (SkipRMSNorm adds no broadcast)", sum)
        dt = a.dtype
        if dt not in c.CUSTOM_OP_TYPES:
            return r.fail(f"normexport::SkipRMSNorm takes float32/float16/bfloat16, not {dt}", a)
        for v in (b, scale):
            if v.dtype != dt:
                return r.fail(f"{v.name!r} dtype {v.dtype} differs from {a.name!r}'s {dt}", v)
        ok, why, self._reshape = c.param_fits(scale, a, 1)
        if not ok:
            return r.fail(why, scale)
        self._hidden = c.trailing_dims(a, 1)
        if self._reshape and self._hidden is None:
            return r.fail("hidden size not static; cannot reshape scale to [H]", scale)
        eps = node.attributes.get("epsilon")
        self._eps = eps.as_float() if eps is not None else 1e-6
        return r

    def rewrite(self, op, a, b, scale, **_):
        if self._reshape:
            scale = op.Reshape(scale, op.Constant(value_ints=self._hidden))
        y, s = op.SkipRMSNorm(a, b, scale, _domain="normexport", _version=1, epsilon=self._eps, _outputs=2)
        return (y, s) if self._residual else y


# the one-output form first (a sum only the norm reads); where others read the sum too, that form
# cannot match (its Add would have outside uses) and the residual form takes it
RULES = [SkipRMSNormTrtFusion.rule("skip_rms_norm_trt", residual=False),
         SkipRMSNormTrtFusion.rule("skip_rms_norm_trt_residual", residual=True)]

__all__ = ["ENV_FLAG", "RULES", "TARGETS", "required_opset", "rules_for", "same_dim", "same_shape"]
