"""Fold an inference BatchNormalization into the Conv / ConvTranspose / Gemm / MatMul(+Add) before it.

    BN(y) = (y - mean) / sqrt(var + eps) * scale + B = y * s + t,
    s = scale / sqrt(var + eps),  t = B - mean * s          (per channel, axis 1 of y)

- Conv          W [Cout, Cin/g, k..]          W' = W * s[:, None..],            b' = b * s + t
- ConvTranspose W [Cin, Cout/g, k..]          W' = W * s (grouped: per output channel of each group)
- Gemm          Y = alpha * A' B' + beta * C  B' columns * s (axis 0 of B if transB else axis 1),
                                              C' = beta * C * s + t, beta := 1
- MatMul(+Add)  2-D output only (BN's channel axis 1 must be the MatMul's last axis)
                                              W' = W * s[None, :],             b' = b * s + t

Only the inference form of BN folds (one output, training_mode 0), only when its parameters and
the producer's weight/bias are constants (initializers / Constant, looked through Identity and
Transpose) and nothing but the BN reads the producer's output.  The folded weight and bias are NEW
initializers computed in float64 and cast to the weight dtype; the original initializers are never
modified (another node may share them; an unused one is dropped by the unused-node pass).
"""

from __future__ import annotations

import functools
from typing import ClassVar

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter._basics import MatchResult
from onnxscript.rewriter._rewrite_rule import RewriteRuleClassBase

from normexport.dtypes import FLOAT_TYPES
from normexport.ir_utils import ONNX_DOMAINS as _ONNX, constant_array

TARGETS = frozenset({"trt", "ort", "onnx"})



# ---------------------------------------------------------------------------------------------
# helpers (also used by bn_affine)


#: the constant behind ``value`` (normexport.ir_utils.constant_array: initializer or Constant, through
#: Identity / Transpose), or None.  Graph inputs (overridable initializers) are not constants.  The legacy
#: exporter deduplicates equal initializers and reads the copies through Identity, and exports a Linear on
#: 3-D input as MatMul(x, Transpose(weight)) when constant folding is off: both are looked through.
const_array = functools.partial(constant_array, through=("Identity", "Transpose"), raise_unreadable=True)


def bn_scale_shift(bn_node: ir.Node, result: MatchResult):
    """Inference-form BN with constant parameters -> (s, t) float64 with BN(y) = y * s + t,
    or the failed ``result``."""
    attr = bn_node.attributes.get("training_mode")
    if len(bn_node.outputs) != 1 or (attr is not None and attr.as_int() != 0):
        return result.fail("training-mode BN (batch statistics)")
    if len(bn_node.inputs) != 5:
        return result.fail("BN does not have 5 inputs")
    scale, bias, mean, var = (const_array(v) for v in bn_node.inputs[1:5])
    if scale is None or bias is None:
        return result.fail("non-constant BN scale/bias")
    if mean is None or var is None:
        return result.fail("non-constant running stats")
    arrays = (scale, bias, mean, var)
    if any(a.ndim != 1 for a in arrays) or len({a.shape for a in arrays}) != 1:
        return result.fail("BN parameters are not 1-D vectors of one length")
    if any(not np.issubdtype(a.dtype, np.floating) for a in arrays):
        return result.fail("BN parameters are not floating point")
    eps_attr = bn_node.attributes.get("epsilon")
    eps = eps_attr.as_float() if eps_attr is not None else 1e-5
    var64 = var.astype(np.float64) + eps
    if np.any(var64 <= 0):
        return result.fail("running_var + epsilon is not positive")
    s = scale.astype(np.float64) / np.sqrt(var64)
    t = bias.astype(np.float64) - mean.astype(np.float64) * s
    return s, t


def is_float(value: ir.Value) -> bool:
    return value.dtype is None or value.dtype in FLOAT_TYPES


def in_function(context) -> bool:
    return isinstance(getattr(context, "graph_or_function", None), ir.Function)


def unique_name(graph: ir.Graph, base: str) -> str:
    taken = set(graph.initializers)
    taken.update(v.name for v in graph.inputs)
    for node in graph:
        taken.update(o.name for o in node.outputs if o.name)
    name, i = base, 1
    while name in taken:
        name = f"{base}_{i}"
        i += 1
    return name


def new_initializer(op, graph: ir.Graph, array: np.ndarray, base: str) -> ir.Value:
    name = unique_name(graph, base)
    return op.initializer(ir.tensor(np.ascontiguousarray(array), name=name), name=name)


def _tag(bn_node: ir.Node) -> str:
    return bn_node.name or bn_node.outputs[0].name or "bn"


def _cast(a: np.ndarray, like: np.ndarray) -> np.ndarray:
    return a.astype(like.dtype)


def _check_bias(result: MatchResult, b: np.ndarray | None, n: int, what: str) -> MatchResult:
    """A bias added to an [M, N] product must broadcast to N features with rank <= 2."""
    if b is not None:
        try:
            shape = np.broadcast_shapes(b.shape, (n,))
        except ValueError:
            return result.fail(f"{what} shape {b.shape} does not broadcast to N={n}")
        if len(shape) > 2:
            return result.fail(f"{what} has rank > 2")
    return result


# ---------------------------------------------------------------------------------------------
# rules


class _FoldBase(RewriteRuleClassBase):
    """Common check: BN form/params, producer weight (and bias) constant, producer output read by the
    BN only.  Rules whose pattern binds the producer output as ``prod_out`` (weight at input 1, bias
    at input 2) implement only ``_check_producer``; the MatMul rules override ``check``."""

    def check(self, context, prod_out: ir.Value, bn_out: ir.Value, **_):
        st = self._check_common(context, prod_out, bn_out)
        if isinstance(st, MatchResult):
            return st
        result = MatchResult()
        node = prod_out.producer()
        wb = self._resolve(node, result)
        if isinstance(wb, MatchResult):
            return wb
        w, b = wb
        return self._check_producer(node, w, b, st[0].shape[0], result)

    def _check_producer(self, node: ir.Node, w: np.ndarray, b: np.ndarray | None, channels: int,
                        result: MatchResult) -> MatchResult:
        """The rule's own checks of the producer ``node`` with constant weight ``w`` and bias ``b``
        (None when absent) against the BN's ``channels``; ``result``, failed or not."""
        raise NotImplementedError

    def _check_common(self, context, producer_out: ir.Value, bn_out: ir.Value):
        result = MatchResult()
        if in_function(context):
            return result.fail("inside a function body (no initializers there)")
        bn_node = bn_out.producer()
        st = bn_scale_shift(bn_node, result)
        if isinstance(st, MatchResult):
            return st
        if len(producer_out.uses()) != 1 or producer_out.is_graph_output():
            return result.fail("BN input has other consumers")
        return st

    def _resolve(self, node: ir.Node, result: MatchResult, w_idx: int = 1, b_idx: int | None = 2):
        w = const_array(node.inputs[w_idx]) if len(node.inputs) > w_idx else None
        if w is None:
            return result.fail(f"non-constant {node.op_type} weight")
        if not np.issubdtype(w.dtype, np.floating):
            return result.fail(f"{node.op_type} weight is not floating point")
        b = None
        if b_idx is not None and len(node.inputs) > b_idx and node.inputs[b_idx] is not None:
            b = const_array(node.inputs[b_idx])
            if b is None:
                return result.fail(f"non-constant {node.op_type} bias")
        return w, b


class FoldConvBN(_FoldBase):
    """BatchNormalization(Conv(x, W[, b])) -> Conv(x, W', b')."""

    op_type: ClassVar[str] = "Conv"

    def pattern(self, op, x):
        y = op.Conv(x, _allow_other_inputs=True, _outputs=["prod_out"])
        return op.BatchNormalization(y, _allow_other_inputs=True, _outputs=["bn_out"])

    def _check_producer(self, node, w, b, channels, result):
        c_out = self._out_channels(node, w)
        if c_out is None:
            return result.fail(f"{self.op_type} weight shape / group inconsistent")
        if c_out != channels:
            return result.fail(f"{self.op_type} output channels {c_out} != BN channels {channels}")
        if b is not None and b.shape != (c_out,):
            return result.fail(f"{self.op_type} bias shape {b.shape} != ({c_out},)")
        return result

    def _out_channels(self, node, w):
        return w.shape[0] if w.ndim >= 3 else None

    def _scale(self, node, w, s):
        return w.astype(np.float64) * s.reshape((-1,) + (1,) * (w.ndim - 1))

    def rewrite(self, op, x, prod_out, bn_out):
        bn_node, node = bn_out.producer(), prod_out.producer()
        s, t = bn_scale_shift(bn_node, MatchResult())
        w, b = self._resolve(node, MatchResult())
        graph = bn_node.graph
        new_w = _cast(self._scale(node, w, s), w)
        b64 = b.astype(np.float64) if b is not None else 0.0
        new_b = (b64 * s + t).astype(b.dtype if b is not None else w.dtype)
        tag = _tag(bn_node)
        return op.op(
            self.op_type,
            x,
            new_initializer(op, graph, new_w, f"{tag}_folded_weight"),
            new_initializer(op, graph, new_b, f"{tag}_folded_bias"),
            **dict(node.attributes),
        )


class FoldConvTransposeBN(FoldConvBN):
    """BatchNormalization(ConvTranspose(x, W[, b])) -> ConvTranspose(x, W', b'); W is
    [C_in, C_out/group, k..], so with groups the output channel of W[i, j] is
    (i // (C_in/group)) * (C_out/group) + j."""

    op_type: ClassVar[str] = "ConvTranspose"

    def pattern(self, op, x):
        y = op.ConvTranspose(x, _allow_other_inputs=True, _outputs=["prod_out"])
        return op.BatchNormalization(y, _allow_other_inputs=True, _outputs=["bn_out"])

    @staticmethod
    def _group(node) -> int:
        g = node.attributes.get("group")
        return g.as_int() if g is not None else 1

    def _out_channels(self, node, w):
        g = self._group(node)
        if w.ndim < 3 or g < 1 or w.shape[0] % g:
            return None
        return w.shape[1] * g

    def _scale(self, node, w, s):
        g = self._group(node)
        c_in, c_per_g, k = w.shape[0], w.shape[1], w.shape[2:]
        w64 = w.astype(np.float64).reshape((g, c_in // g, c_per_g) + k)
        sv = s.reshape((g, 1, c_per_g) + (1,) * len(k))
        return (w64 * sv).reshape(w.shape)


class FoldGemmBN(_FoldBase):
    """BatchNormalization(Gemm(A, B[, C])) -> Gemm(A, B', C') with beta folded into C'."""

    def pattern(self, op, a):
        y = op.Gemm(a, _allow_other_inputs=True, _outputs=["prod_out"])
        return op.BatchNormalization(y, _allow_other_inputs=True, _outputs=["bn_out"])

    @staticmethod
    def _trans_b(node) -> bool:
        tb = node.attributes.get("transB")
        return bool(tb.as_int()) if tb is not None else False

    def _check_producer(self, node, w, c, channels, result):
        if w.ndim != 2:
            return result.fail("Gemm B is not 2-D")
        n = w.shape[0] if self._trans_b(node) else w.shape[1]
        if n != channels:
            return result.fail(f"Gemm output features {n} != BN channels {channels}")
        return _check_bias(result, c, n, "Gemm C")

    def rewrite(self, op, a, prod_out, bn_out):
        bn_node, node = bn_out.producer(), prod_out.producer()
        s, t = bn_scale_shift(bn_node, MatchResult())
        w, c = self._resolve(node, MatchResult())
        attrs = dict(node.attributes)
        beta_attr = attrs.pop("beta", None)
        beta = beta_attr.as_float() if beta_attr is not None else 1.0
        axis = 0 if self._trans_b(node) else 1
        new_w = _cast(w.astype(np.float64) * (s[:, None] if axis == 0 else s[None, :]), w)
        c64 = beta * c.astype(np.float64) if c is not None else 0.0
        new_c = (c64 * s + t).astype(c.dtype if c is not None else w.dtype)
        graph, tag = bn_node.graph, _tag(bn_node)
        return op.op(
            "Gemm",
            a,
            new_initializer(op, graph, new_w, f"{tag}_folded_weight"),
            new_initializer(op, graph, new_c, f"{tag}_folded_bias"),
            **attrs,
        )


def _matmul_check(context, rule, x, w_val, b_val, prod_out, bn_out):
    st = rule._check_common(context, prod_out, bn_out)
    if isinstance(st, MatchResult):
        return st
    result = MatchResult()
    w = const_array(w_val)
    if w is None:
        return result.fail("non-constant MatMul weight")
    if w.ndim != 2 or not np.issubdtype(w.dtype, np.floating):
        return result.fail("MatMul weight is not a 2-D float matrix")
    rank = x.shape.rank() if x.shape is not None else None
    if rank is None:
        return result.fail("MatMul input rank unknown (run shape inference)")
    if rank != 2:
        return result.fail(
            f"MatMul output is {rank}-D: BN normalizes axis 1, not the MatMul's last axis")
    n = w.shape[1]
    if n != st[0].shape[0]:
        return result.fail(f"MatMul output features {n} != BN channels {st[0].shape[0]}")
    if b_val is not None:
        b = const_array(b_val)
        if b is None:
            return result.fail("non-constant bias of MatMul+Add")
        return _check_bias(result, b, n, "bias")
    return result


def _matmul_rewrite(op, x, w_val, b_val, bn_out):
    bn_node = bn_out.producer()
    s, t = bn_scale_shift(bn_node, MatchResult())
    w = const_array(w_val)
    new_w = _cast(w.astype(np.float64) * s[None, :], w)
    b = const_array(b_val) if b_val is not None else None
    b64 = b.astype(np.float64) if b is not None else 0.0
    new_b = (b64 * s + t).astype(b.dtype if b is not None else w.dtype)
    graph, tag = bn_node.graph, _tag(bn_node)
    y = op.MatMul(x, new_initializer(op, graph, new_w, f"{tag}_folded_weight"))
    return op.Add(y, new_initializer(op, graph, new_b, f"{tag}_folded_bias"))


class FoldMatMulAddBN(_FoldBase):
    """BatchNormalization(Add(MatMul(x, W), b)) -> Add(MatMul(x, W'), b') (2-D only)."""

    def __init__(self, bias_first: bool):
        self.bias_first = bias_first
        super().__init__(name=f"FoldMatMulAddBN{'_bias_first' if bias_first else ''}")

    def pattern(self, op, x, w, b):
        mm = op.MatMul(x, w)
        y = op.Add(b, mm, _outputs=["prod_out"]) if self.bias_first else op.Add(
            mm, b, _outputs=["prod_out"])
        return op.BatchNormalization(y, _allow_other_inputs=True, _outputs=["bn_out"])

    def check(self, context, x, w, b, prod_out, bn_out):
        return _matmul_check(context, self, x, w, b, prod_out, bn_out)

    def rewrite(self, op, x, w, b, prod_out, bn_out):
        return _matmul_rewrite(op, x, w, b, bn_out)


class FoldMatMulBN(_FoldBase):
    """BatchNormalization(MatMul(x, W)) -> Add(MatMul(x, W'), b') (2-D only)."""

    def pattern(self, op, x, w):
        y = op.MatMul(x, w, _outputs=["prod_out"])
        return op.BatchNormalization(y, _allow_other_inputs=True, _outputs=["bn_out"])

    def check(self, context, x, w, prod_out, bn_out):
        return _matmul_check(context, self, x, w, None, prod_out, bn_out)

    def rewrite(self, op, x, w, prod_out, bn_out):
        return _matmul_rewrite(op, x, w, None, bn_out)


_PRODUCERS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


def explain_unapplied(proto) -> list[tuple[ir.Node, str]]:
    """Why each BatchNormalization still in the graph (an onnx_ir model, or a ModelProto) was not folded (the
    driver's report hook): every BN is reported folded or skipped with a reason, including those no
    rule got near."""
    out = []
    model = proto if isinstance(proto, ir.Model) else ir.serde.deserialize_model(proto)
    if not any(n.op_type == "BatchNormalization" for n in model.graph):
        return out
    for node in model.graph:
        if node.op_type != "BatchNormalization" or node.domain not in _ONNX:
            continue
        attr = node.attributes.get("training_mode")
        x = node.inputs[0]
        producer = x.producer() if x is not None else None
        shared = x is not None and (len(x.uses()) > 1 or x.is_graph_output())
        if (attr is not None and attr.as_int() != 0) or len(node.outputs) != 1:
            why = "training-mode BN computes batch statistics: not an affine map, left as is"
        elif any(const_array(v) is None for v in node.inputs[1:5]):
            why = "BN scale / bias / running stats are not constants"
        elif producer is None:
            why = "BN input is a graph input: no producer to fold into"
        elif producer.op_type == "Add" and any(
                v is not None and v.producer() is not None and v.producer().op_type == "MatMul" for v in producer.inputs):
            why = ("MatMul+Add output feeds other nodes too" if shared
                   else "MatMul+Add not foldable (see the bn_fold rule rejections)")
        elif producer.op_type not in _PRODUCERS:
            why = f"producer {producer.op_type} is not Conv / ConvTranspose / Gemm / MatMul(+Add)"
        elif shared:
            why = f"{producer.op_type} output also feeds other nodes (or is a graph output): folding would change them"
        else:
            why = f"{producer.op_type} not foldable (see the bn_fold rule rejections)"
        out.append((node, why))
    return out


RULES = [
    FoldConvBN.rule(),
    FoldConvTransposeBN.rule(),
    FoldGemmBN.rule(),
    FoldMatMulAddBN.rule(bias_first=False),
    FoldMatMulAddBN.rule(bias_first=True),
    FoldMatMulBN.rule(),
]
