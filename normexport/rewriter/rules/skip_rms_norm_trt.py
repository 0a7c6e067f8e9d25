"""Residual Add -> normexport::RMSNorm  ==>  normexport::SkipRMSNorm (target trt).

Matched (the rms_norm rule's output for target trt):
    s = Add(a, b)                          the residual sum (LLaMA: h = x + attn(x))
    y = normexport::RMSNorm(s, scale)      over the last dim only
==> y, s' = normexport::SkipRMSNorm(a, b, scale, epsilon=eps)
where s' replaces s for its other consumers (the residual stream, rule skip_rms_norm_trt_residual);
when nothing else reads s the fused node's Sum output is left unread (rule skip_rms_norm_trt).
One pass over the activations instead of two: the plugin reads a and b once and writes y and the
sum (4 tensor passes instead of 5, and one launch instead of two).

The op contract (docs/design.md §2): a and b of the sum's full shape (no broadcast operand), the same
float32 / float16 / bfloat16 dtype as scale; scale one value per element of the last dim
([H], or [1.., H], reshaped); the sum not a graph output (kept as the Add it is). Every applied
fusion is verified locally (docs/design.md §8) as every other.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from . import _common as c

TARGETS = frozenset({"trt"})
# on by default; `--no-residual-fusion` turns it off (rewriter/switches.py)


def required_opset(target: str) -> int:
    return 18


class SkipRMSNormTrtFusion(c.AddNormFusion):
    """residual=False: only the norm reads the sum; residual=True: other nodes read it too."""

    def norm(self, op, s, scale):
        return op.RMSNorm(s, scale, _domain="normexport", _allow_other_attributes=True, _outputs=["norm"])

    def check(self, context, a, b, scale, sum, norm, **_):  # noqa: A002 - the pattern's name
        r = pattern.MatchResult()
        node = norm.producer()
        if sum.is_graph_output():
            return r.fail("the residual sum is a graph output (kept as the Add)", sum)
        rank = c.rank_of(sum)
        if rank is None:
            return r.fail("rank of the residual sum unknown", sum)
        axis = c.norm_axis(node)
        if axis % rank != rank - 1:
            return r.fail(f"RMSNorm axis {axis} does not normalize the last dim only", norm)
        if not (c.same_shape(a.shape, sum.shape) and c.same_shape(b.shape, sum.shape)):
            return r.fail(f"an Add operand ({None if a.shape is None else list(a.shape)} / "
                          f"{None if b.shape is None else list(b.shape)}) is not known to have the sum's shape "
                          f"{list(sum.shape) if sum.shape is not None else None} (SkipRMSNorm adds no broadcast)", sum)
        dt = a.dtype
        if dt not in c.CUSTOM_OP_TYPES:
            return r.fail(f"normexport::SkipRMSNorm takes float32/float16/bfloat16, not {dt}", a)
        return c.check_residual_norm_tail(self, r, a, (b,), scale, node, 1e-6)

    def rewrite(self, op, a, b, scale, **_):
        y, s = op.SkipRMSNorm(a, b, c.as_hidden_vector(self, op, scale), _domain="normexport", _version=1, epsilon=self._eps, _outputs=2)
        return (y, s) if self._residual else y


# the one-output form first (a sum only the norm reads); where others read the sum too, that form
# cannot match (its Add would have outside uses) and the residual form takes it
RULES = [SkipRMSNormTrtFusion.rule("skip_rms_norm_trt", residual=False),
         SkipRMSNormTrtFusion.rule("skip_rms_norm_trt_residual", residual=True)]

__all__ = ["RULES", "TARGETS", "required_opset"]
