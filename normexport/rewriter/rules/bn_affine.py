"""A BatchNormalization left after bn_fold (inference form, constant parameters) -> Mul + Add.

    BN(x) = x * s + t,  s = scale / sqrt(var + eps),  t = B - mean * s,
    with s, t as constants of shape [C, 1, ..., 1] (rank(x) - 1 dims) broadcast on axis 1.

Which targets get it is measured, not assumed.  onnxruntime 1.31 CPU (CPUExecutionProvider, 2-core
machine, best of 7 x 20 runs, float32, one node vs Mul+Add with the same constants):

    [8, 64, 56, 56]    BN 0.24 ms   Mul+Add 0.76 ms (1 thread) / 1.14 ms (default threads)
    [1, 64, 56, 56]    BN 0.035 ms  Mul+Add 0.070 ms
    [32, 256, 14, 14]  BN 0.26 ms   Mul+Add 0.90 ms (1 thread) / 2.11 ms (default threads)

BatchNormalization is a single fused pass in onnxruntime; Mul+Add are two broadcast passes with an
intermediate tensor, 2-5x slower.  So "ort" keeps BN, and so does "onnx" (standard ops for any
runtime; BatchNormalization is standard, and onnxruntime is the runtime it is checked with).  For
"trt" the TensorRT ONNX parser imports BatchNormalization as the same per-channel scale/shift
(IScaleLayer) that Mul+Add with constants becomes after its pointwise fusion, so speed is equal, and
docs/design.md §3 asks for no BatchNormalization in trt graphs: trt gets Mul + Add.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter._basics import MatchResult
from onnxscript.rewriter._rewrite_rule import RewriteRuleClassBase

from normexport.dtypes import FLOAT_TYPES

from .bn_fold import bn_scale_shift, const_array, in_function, new_initializer

TARGETS = frozenset({"trt"})

# shape-preserving one-input ops the rank can be traced back through
_UNARY = frozenset({"Relu", "LeakyRelu", "Sigmoid", "Tanh", "Clip", "Identity", "HardSigmoid",
                    "HardSwish", "Elu", "Selu", "Gelu", "Softplus", "Abs", "Neg", "Dropout"})


def _input_rank(x: ir.Value, depth: int = 0) -> int | None:
    """rank of x: from its shape, else through unary ops from a Conv/ConvTranspose's weight rank."""
    if x.shape is not None:
        return x.shape.rank()
    node = x.producer()
    if node is not None and node.op_type in _UNARY and node.domain in ("", "ai.onnx") and depth < 8:
        return _input_rank(node.inputs[0], depth + 1)
    if node is not None and node.op_type in ("Conv", "ConvTranspose") and len(node.inputs) > 1:
        w = node.inputs[1]
        if w is not None and w.shape is not None:
            return w.shape.rank()
        a = const_array(w)
        if a is not None:
            return a.ndim
    return None


class BatchNormToMulAdd(RewriteRuleClassBase):
    """BatchNormalization(x, scale, B, mean, var) -> Add(Mul(x, s), t)."""

    def pattern(self, op, x):
        return op.BatchNormalization(x, _allow_other_inputs=True, _outputs=["bn_out"])

    def check(self, context, x, bn_out):
        result = MatchResult()
        if in_function(context):
            return result.fail("inside a function body (no initializers there)")
        st = bn_scale_shift(bn_out.producer(), result)
        if isinstance(st, MatchResult):
            return st
        rank = _input_rank(x)
        if rank is None:
            return result.fail("BN input rank unknown (run shape inference)")
        if rank < 2:
            return result.fail("BN input rank < 2")
        if x.dtype is not None and x.dtype not in FLOAT_TYPES:
            return result.fail("BN input is not floating point")
        return result

    def rewrite(self, op, x, bn_out):
        bn_node = bn_out.producer()
        s, t = bn_scale_shift(bn_node, MatchResult())
        rank = _input_rank(x)
        shape = (-1,) + (1,) * (rank - 2)
        if x.dtype is not None:
            dtype = x.dtype.numpy()
        else:
            dtype = const_array(bn_node.inputs[1]).dtype
        graph, tag = bn_node.graph, bn_node.name or bn_out.name or "bn"
        s_c = new_initializer(op, graph, s.reshape(shape).astype(dtype), f"{tag}_scale")
        t_c = new_initializer(op, graph, t.reshape(shape).astype(dtype), f"{tag}_shift")
        return op.Add(op.Mul(x, s_c), t_c)


RULES = [BatchNormToMulAdd.rule()]
