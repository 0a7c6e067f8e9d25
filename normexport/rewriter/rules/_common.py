"""Pattern pieces and checks shared by the normalisation rules (not a rule module)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})
#: the types the normexport custom ops accept (their schema: DESIGN §2); no float64
CUSTOM_OP_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})

#: how `num / sqrt(v)` is spelled: Div by Sqrt, Mul by Reciprocal(Sqrt), Mul by Div(1, Sqrt),
#: Mul by Pow(v, -0.5) (rsqrt-style); the Mul forms in both operand orders
INV_FORMS = ("div", "recip", "recip_l", "div1", "div1_l", "pow", "pow_l")


def inv_sqrt(op, num, v, form: str):
    """The pattern value of `num / sqrt(v)` in one spelling."""
    if form == "div":
        return op.Div(num, op.Sqrt(v))
    if form in ("recip", "recip_l"):
        r = op.Reciprocal(op.Sqrt(v))
    elif form in ("div1", "div1_l"):
        r = op.Div(1.0, op.Sqrt(v))
    elif form in ("pow", "pow_l"):
        r = op.Pow(v, -0.5)
    else:
        raise ValueError(form)
    return op.Mul(r, num) if form.endswith("_l") else op.Mul(num, r)


def inv_sqrt_any(op, num, v):
    return pattern.OrValue([inv_sqrt(op, num, v, f) for f in INV_FORMS])


def plus(op, a, b):
    return pattern.OrValue([op.Add(a, b), op.Add(b, a)])


def times(op, a, b):
    return pattern.OrValue([op.Mul(a, b), op.Mul(b, a)])


def square(op, v):
    return pattern.OrValue([op.Pow(v, 2.0), op.Mul(v, v)])


def const(val: ir.Value | None) -> np.ndarray | None:
    """The numpy value of a true constant (initializer that is not a graph input, or Constant)."""
    if val is None or val.is_graph_input():
        return None
    c = val.const_value
    if c is None:
        producer = val.producer()
        if producer is not None and producer.op_type == "Constant" and producer.domain in ("", "ai.onnx"):
            attr = producer.attributes.get("value")
            if attr is not None and attr.type == ir.AttributeType.TENSOR:
                c = attr.value
    if c is None:
        return None
    try:
        return c.numpy()
    except Exception:  # noqa: BLE001 - external data not loaded
        return None


def const_scalar(val: ir.Value | None) -> float | None:
    arr = const(val)
    if arr is None or arr.size != 1 or not (arr.dtype.kind == "f" or arr.dtype.name == "bfloat16"):
        return None
    return float(arr.reshape(()))


def reduce_axes(node: ir.Node) -> tuple[list[int] | None, str]:
    """Axes of a ReduceMean (attribute before opset 18, input from 18), or None with a reason."""
    keep = node.attributes.get("keepdims")
    if keep is not None and keep.as_int() != 1:
        return None, "ReduceMean keepdims=0"
    axes_attr = node.attributes.get("axes")
    if axes_attr is not None:
        return list(axes_attr.as_ints()), ""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        arr = const(node.inputs[1])
        if arr is None:
            return None, "ReduceMean axes are not a constant"
        return [int(a) for a in np.asarray(arr).reshape(-1)], ""
    return None, "ReduceMean over all axes"


def trailing_count(axes: Sequence[int], rank: int | None) -> int | None:
    """k when `axes` are exactly the last k dims of a rank-`rank` tensor, else None."""
    if not axes:
        return None
    if rank is None:
        if any(a >= 0 for a in axes):
            return None
        norm = sorted(axes)
        k = len(norm)
        return k if norm == list(range(-k, 0)) and len(set(axes)) == k else None
    norm = sorted(a % rank if -rank <= a < rank else 10**9 for a in axes)
    k = len(norm)
    return k if norm == list(range(rank - k, rank)) else None


def rank_of(v: ir.Value | None) -> int | None:
    if v is None or v.shape is None:
        return None
    return len(v.shape)


def trailing_dims(v: ir.Value, k: int) -> list[int] | None:
    """The last k dims of `v` as ints, or None when unknown / symbolic."""
    if v.shape is None or len(v.shape) < k:
        return None
    dims = list(v.shape)[len(v.shape) - k:]
    return [int(d) for d in dims] if all(isinstance(d, int) for d in dims) else None


def param_fits(p: ir.Value, x: ir.Value, k: int) -> tuple[bool, str, bool]:
    """Whether an affine parameter `p` (broadcast against x) is one value per normalized
    element: shape [1, ..., 1, *x.shape[-k:]]. Returns (ok, why-not, needs_reshape)."""
    if p.shape is None:
        return False, f"shape of {p.name!r} unknown", False
    pdims = list(p.shape)
    while len(pdims) > k and pdims[0] == 1:
        pdims = pdims[1:]
    if len(pdims) != k:
        return False, f"{p.name!r} of shape {list(p.shape)} does not cover exactly the normalized dims", False
    tdims = trailing_dims(x, k)
    if tdims is None:
        if not all(isinstance(d, int) for d in pdims):
            return False, "normalized dims not static", False
    elif pdims != tdims:
        return False, f"{p.name!r} of shape {list(p.shape)} does not broadcast to normalized dims {tdims}", False
    return True, "", len(p.shape) != k


def opset(context) -> int:
    imports = context.model.opset_imports
    return imports.get("", imports.get("ai.onnx", 0))


def attr_int(v) -> int | None:
    if v is None:
        return None
    if isinstance(v, ir.Attr):
        return v.as_int()
    return int(v)


_PRECISION = {ir.DataType.DOUBLE: 3, ir.DataType.FLOAT: 2, ir.DataType.FLOAT16: 1, ir.DataType.BFLOAT16: 1}


def fused_io(op, x: ir.Value, out: ir.Value):
    """(input to feed the fused op, its dtype, dtype to Cast the result to or None) so that the fused op
    returns the dtype the matched subgraph returned, computing in the higher precision."""
    if x.dtype is None or out.dtype is None or x.dtype == out.dtype:
        return x, x.dtype, None
    if _PRECISION.get(out.dtype, 0) >= _PRECISION.get(x.dtype, 0):
        return op.Cast(x, to=out.dtype.value), out.dtype, None
    return x, x.dtype, out.dtype


def as_dtype(op, v, dtype):
    """`v` cast to `dtype` when its dtype is known and different."""
    if v is None or dtype is None or v.dtype is None or v.dtype == dtype:
        return v
    return op.Cast(v, to=dtype.value)


def unit_tensor(name: str, dims: list[int], dtype: ir.DataType, value: float) -> ir.Tensor:
    return ir.tensor(np.full(dims, value, dtype=dtype.numpy()), name=name)


def absorb_cast(context, x: ir.Value) -> ir.Value:
    """The value to feed a fused op in place of `x`: when `x` = Cast(src) to an equal or higher
    precision (the HF upcast) and only the matched nodes use `x`, `src` (the Cast then dies);
    otherwise `x` itself (the Cast stays, e.g. when a residual also reads it)."""
    node = x.producer()
    if node is None or node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or x.is_graph_output():
        return x
    src = node.inputs[0]
    if src is None or src.dtype is None or x.dtype is None:
        return x
    if _PRECISION.get(x.dtype, 0) < _PRECISION.get(src.dtype, 0):
        return x
    matched = set(context.nodes)
    if all(user in matched for user, _ in x.uses()):
        return src
    return x
