"""Pattern pieces and checks shared by the normalisation rules (not a rule module)."""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from normexport.dtypes import FLOAT_TYPES  # noqa: F401 - the rules read c.FLOAT_TYPES
from normexport.ir_utils import constant_array, rank_of, same_dim, same_shape  # noqa: F401 - the rules read c.same_shape

#: the rules' constant behind a value (normexport.ir_utils.constant_array): an initializer that is not a
#: graph input, or a Constant node read through its `value` tensor only
const = functools.partial(constant_array, tensor_only=True)

#: the types the normexport custom ops accept (their schema: docs/design.md §2); no float64
CUSTOM_OP_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})

#: how `num / sqrt(v)` is spelled once the graph is in canonical forms (rewriter/canonical.py turns
#: Pow(v, -0.5) and Div(1, Sqrt(v)) into Reciprocal(Sqrt(v))): Div by Sqrt, Mul by Reciprocal(Sqrt),
#: the Mul in both operand orders
INV_FORMS = ("div", "recip", "recip_l")
#: every spelling files write (the tests feed them all through the driver)
INV_SPELLINGS = INV_FORMS + ("div1", "div1_l", "pow", "pow_l")


def inv_sqrt(op, num, v, form: str):
    """The pattern value of `num / sqrt(v)` in one canonical spelling (INV_FORMS)."""
    if form == "div":
        return op.Div(num, op.Sqrt(v))
    if form not in ("recip", "recip_l"):
        raise ValueError(form)
    r = op.Reciprocal(op.Sqrt(v))
    return op.Mul(r, num) if form.endswith("_l") else op.Mul(num, r)


def inv_sqrt_any(op, num, v):
    return pattern.OrValue([inv_sqrt(op, num, v, f) for f in INV_FORMS])


def plus(op, a, b):
    return pattern.OrValue([op.Add(a, b), op.Add(b, a)])


def times(op, a, b):
    return pattern.OrValue([op.Mul(a, b), op.Mul(b, a)])


def square(op, v):
    return pattern.OrValue([op.Pow(v, 2.0), op.Mul(v, v)])


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


def norm_axis(node: ir.Node) -> int:
    """The `axis` attribute of a norm node (-1 when absent: the last dim)."""
    axis = node.attributes.get("axis")
    return axis.as_int() if axis is not None else -1


def check_residual_norm_tail(rule, r, x: ir.Value, others, scale: ir.Value, node: ir.Node, default_eps: float):
    """The checks the residual Add + RMSNorm rules (skip_rms_norm for ort, skip_rms_norm_trt) share
    once the norm's input `x` is known: `others` and `scale` have x's dtype; `scale` holds one value
    per element of x's last dim ([H], or [1.., H], then reshaped to rule._hidden = [H]:
    rule._reshape); the norm's epsilon (rule._eps). Returns `r` (a match) or its failure."""
    dt = x.dtype
    for v in (*others, scale):
        if v.dtype != dt:
            return r.fail(f"{v.name!r} dtype {v.dtype} differs from {x.name!r}'s {dt}", v)
    ok, why, rule._reshape = param_fits(scale, x, 1)
    if not ok:
        return r.fail(why, scale)
    rule._hidden = trailing_dims(x, 1)
    if rule._reshape and rule._hidden is None:
        return r.fail(f"hidden size not static; cannot reshape {scale.name!r} to [H]", scale)
    eps = node.attributes.get("epsilon")
    rule._eps = eps.as_float() if eps is not None else default_eps
    return r


def as_hidden_vector(rule, op, scale):
    """`scale` reshaped to [H] when residual_norm_tail said so (rule._reshape)."""
    return op.Reshape(scale, op.Constant(value_ints=rule._hidden)) if rule._reshape else scale


class AddNormFusion(pattern.RewriteRuleClassBase):
    """Base of the residual rules: s = Add(a, b), then a norm of s (the subclass's `norm`, one
    output named "norm"), fused into one op that also writes s. residual=False: only the norm reads
    s; residual=True: other nodes read s too, and then read the fused op's sum output instead."""

    def __init__(self, name: str, residual: bool):
        super().__init__(name)
        self._residual = residual

    def norm(self, op, s, scale):
        raise NotImplementedError

    def pattern(self, op, a, b, scale):
        s = op.Add(a, b, _outputs=["sum"])
        y = self.norm(op, s, scale)
        return (y, s) if self._residual else y


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


# ---- LayerNorm over any axes: LayerNormalization, with Transposes when the axes are not trailing --
#: Transpose + LayerNormalization + Transpose: the full-size passes a non-trailing fusion costs
TRANSPOSED_LN_PASSES = 3


def norm_axes(axes: Sequence[int], rank: int | None) -> tuple[list[int] | None, str]:
    """`axes` as sorted non-negative dims of a rank-`rank` tensor (negative ones need no rank
    when they are the trailing ones), or None with the reason."""
    if not axes:
        return None, "no axes"
    if rank is None:
        k = trailing_count(axes, None)
        if k is None:
            return None, f"axes {list(axes)} of a tensor of unknown rank"
        return list(range(-k, 0)), ""
    if any(not -rank <= a < rank for a in axes):
        return None, f"axes {list(axes)} out of range for rank {rank}"
    norm = sorted({a % rank for a in axes})
    if len(norm) != len(axes):
        return None, f"repeated axes {list(axes)}"
    return norm, ""


def is_trailing(axes: list[int], rank: int | None) -> bool:
    if axes and axes[0] < 0:
        return True
    return rank is not None and axes == list(range(rank - len(axes), rank))


def axes_dims(x: ir.Value, axes: list[int]) -> list[int] | None:
    """The static sizes of `x` along `axes`, or None when one is unknown or symbolic."""
    if x.shape is None:
        return None
    dims = list(x.shape)
    try:
        picked = [dims[a] for a in axes]
    except IndexError:
        return None
    return [int(d) for d in picked] if all(isinstance(d, int) for d in picked) else None


def param_fits_axes(p: ir.Value, x: ir.Value, axes: list[int]) -> tuple[bool, str, list[int] | None]:
    """Whether an affine parameter `p` (broadcast against x) holds one value per element of the
    normalized `axes` and is constant along the others: its shape, padded on the left with 1s
    to x's rank, is x's size on `axes` and 1 elsewhere. Returns (ok, why-not, the [sizes on axes]
    to reshape it to, or None when it already has that shape)."""
    if p.shape is None:
        return False, f"shape of {p.name!r} unknown", None
    if axes[0] < 0:  # trailing axes of an x of unknown rank: the trailing-dims rule
        ok, why, reshape = param_fits(p, x, len(axes))
        want = [int(d) for d in list(p.shape)[len(p.shape) - len(axes):]] if ok and reshape else None
        return ok, why, want
    rank = rank_of(x)
    pdims = list(p.shape)
    if rank is None or len(pdims) > rank:
        return False, f"{p.name!r} of shape {pdims} has more dims than the input", None
    pdims = [1] * (rank - len(pdims)) + pdims
    want = axes_dims(x, axes)
    if want is None:
        if not all(isinstance(pdims[a], int) for a in axes):
            return False, "normalized dims not static", None
        want = [int(pdims[a]) for a in axes]
    for i, d in enumerate(pdims):
        if i in axes:
            if d != want[axes.index(i)]:
                return False, f"{p.name!r} of shape {list(p.shape)} does not cover the normalized dims {want}", None
        elif d != 1:
            return False, f"{p.name!r} of shape {list(p.shape)} varies along a dim that is not normalized", None
    return True, "", (None if list(p.shape) == want else want)


def full_size_nodes(context, x: ir.Value) -> int:
    """How many matched nodes write a tensor as large as `x` (what a decomposition costs in passes
    over memory, reductions counted as one read each)."""
    rank = rank_of(x)
    n = 0
    for node in context.nodes:
        if node.op_type.startswith("Reduce"):
            n += 1
            continue
        for o in node.outputs:
            if o.shape is not None and rank is not None and len(o.shape) == rank and list(o.shape) == list(x.shape):
                n += 1
                break
    return n


def layer_norm(op, x, weight, bias, eps: float, axes: list[int], rank: int | None, dtype: ir.DataType,
               unit_dims: list[int] | None, reshape: dict[str, list[int] | None], name: str):
    """LayerNormalization of `x` over `axes` (stash_type float): with axis=-k when the axes are the
    trailing k dims, else between two Transposes that move them to the end (in their order) and back.
    `weight` None: a unit scale of `unit_dims`; `reshape[...]`: the [sizes on axes] a parameter is
    reshaped to (None: as it is)."""
    k = len(axes)
    if weight is None:
        weight = op.initializer(unit_tensor(f"{name}__unit_scale", unit_dims, dtype, 1.0), f"{name}__unit_scale")
    params = []
    for key, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if reshape.get(key):
            arr = const(p)
            if arr is not None:  # a constant parameter: its reshaped copy (small: one value per normalized element)
                pname = f"{name}__{key}"
                p = op.initializer(ir.tensor(np.ascontiguousarray(arr).reshape(reshape[key]), name=pname), pname)
            else:
                p = op.Reshape(p, op.Constant(value_ints=list(reshape[key])))
        params.append(as_dtype(op, p, dtype))
    if is_trailing(axes, rank):
        return op.LayerNormalization(x, *params, axis=-k, epsilon=eps, stash_type=1)
    perm = [i for i in range(rank) if i not in axes] + list(axes)
    back = [perm.index(i) for i in range(rank)]
    y = op.LayerNormalization(op.Transpose(x, perm=perm), *params, axis=-k, epsilon=eps, stash_type=1)
    return op.Transpose(y, perm=back)


def rewrite_layer_norm(rule, op, x, weight, bias, name: str):
    """The rewrite the LayerNorm rules (layer_norm, layer_norm_one_pass) share: LayerNormalization of `x`
    (layer_norm) from what their check kept on the rule (_out, _eps, _axes, _rank, _unit, _reshape), in the
    output's float type through fused_io; `name`: the node's name where the output has none."""
    out = rule._out
    xin, dt, cast_out = fused_io(op, x, out) if out is not None else (x, x.dtype, None)
    dt = dt or ir.DataType.FLOAT
    y = layer_norm(op, xin, weight, bias, rule._eps, rule._axes, rule._rank, dt, rule._unit, rule._reshape,
                   out.name if out is not None and out.name else name)
    return op.Cast(y, to=cast_out.value) if cast_out is not None else y


def finish_layer_norm_check(rule, r, context, x: ir.Value, weight, bias, rank: int | None):
    """The tail every LayerNorm rule's check shares, once the normalized axes (`rule._axes`) are
    known: the affine parameters fit those axes (reshapes kept in `rule._reshape`), a unit scale
    can be made when there is no weight (`rule._unit`), and a non-trailing LayerNorm is fused only
    where Transposes around LayerNormalization write fewer full-size tensors than the
    decomposition. Returns `r` (a match) or its failure."""
    rule._rank = rank
    rule._reshape = {}
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        ok, why, rule._reshape[name] = param_fits_axes(p, x, rule._axes)
        if not ok:
            return r.fail(why, p)
    rule._unit = None
    if weight is None:
        rule._unit = axes_dims(x, rule._axes) if rule._axes[0] >= 0 else trailing_dims(x, len(rule._axes))
        if rule._unit is None:
            return r.fail("normalized dims not static; cannot make a unit scale", x)
    if not is_trailing(rule._axes, rank):
        passes = full_size_nodes(context, x)
        if passes <= TRANSPOSED_LN_PASSES:
            return r.fail(f"over axes {rule._axes}: Transposes around LayerNormalization "
                          f"({TRANSPOSED_LN_PASSES} passes) are not cheaper than the {passes} of the decomposition", x)
    return r
