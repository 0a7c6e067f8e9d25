"""normexport::AdaLNZero — Y = LayerNorm(X; weight, bias, epsilon) * (1 + scale) + shift.

X: [B, ..., H], last dim normalized (biased variance), statistics in float32.
shift, scale: [B, H] (broadcast over the middle dims) or the full shape of X; both the same shape.
weight, bias: optional [H] LayerNorm affine (both or neither).
modulation_axis (attribute, default 0): the dim of X that the rows of a [B, H] shift / scale
follow, broadcast over every other dim but the last: 0 for X [B, ..., H]; 1 for a sequence-first
X [S, B, H] (row r of the flattened [S * B, H] takes modulation row r % B); any a in
[0, rank(X) - 2] ([B, H] viewed as [1 (a times), B, 1.., H]). No effect on a full-shape or
[1, H] modulation. Left out of a node when 0 (its files are those of the op before it existed).
This file is the single source of the op's contract.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnxscript
import torch
from onnxscript import opset18 as op

from ._spec import DOMAIN, VERSION, Attr, Input, OpSpec

_OPSET = onnxscript.values.Opset(DOMAIN, VERSION)


def _mod_dims(b: int, h: int, ndim: int, axis: int) -> tuple[int, ...]:
    """The shape a [b, h] modulation takes against an X of rank `ndim` whose dim `axis` it follows:
    [1 (axis times), b, 1.., h]."""
    if not 0 <= axis <= ndim - 2:
        raise ValueError(f"modulation_axis {axis} is out of range for X of rank {ndim} (0..{ndim - 2})")
    return (1,) * axis + (b,) + (1,) * (ndim - 2 - axis) + (h,)


def _broadcastable(mod: np.ndarray, ndim: int, axis: int = 0) -> np.ndarray:
    """[B, H] -> [B, 1, ..., 1, H] (axis 0), [1, B, 1.., H] (axis 1), ...; a full-shape tensor is
    returned as is."""
    if mod.ndim == ndim:
        _mod_dims(1, 1, ndim, axis)  # (the axis must fit X all the same)
        return mod
    return mod.reshape(_mod_dims(mod.shape[0], mod.shape[-1], ndim, axis))


def reference(x, shift, scale, weight=None, bias=None, epsilon: float = 1e-6, modulation_axis: int = 0) -> np.ndarray:
    """float64 numpy reference, written from the formula."""
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + epsilon)
    if weight is not None:
        y = y * np.asarray(weight, dtype=np.float64)
    if bias is not None:
        y = y + np.asarray(bias, dtype=np.float64)
    shift = _broadcastable(np.asarray(shift, dtype=np.float64), x.ndim, modulation_axis)
    scale = _broadcastable(np.asarray(scale, dtype=np.float64), x.ndim, modulation_axis)
    return y * (1.0 + scale) + shift


# ---- torch custom op -------------------------------------------------------------------------
def _mod(t: torch.Tensor, ndim: int, axis: int = 0) -> torch.Tensor:
    if t.dim() == ndim:
        _mod_dims(1, 1, ndim, axis)
        return t.float()
    return t.float().reshape(_mod_dims(t.shape[0], t.shape[-1], ndim, axis))


def modulated_layer_norm(xf: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, weight: Optional[torch.Tensor],
                         bias: Optional[torch.Tensor], epsilon: float, modulation_axis: int = 0) -> torch.Tensor:
    """LayerNorm(xf; weight, bias, epsilon) * (1 + scale) + shift in float32, xf float32 (also
    GatedAdaLNZero's, on its sum)."""
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    y = torch.nn.functional.layer_norm(xf, xf.shape[-1:], w, b, epsilon)
    return y * (1.0 + _mod(scale, xf.dim(), modulation_axis)) + _mod(shift, xf.dim(), modulation_axis)


@torch.library.custom_op("normexport::adaln_zero", mutates_args=())
def adaln_zero(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    epsilon: float,
    modulation_axis: int = 0,
) -> torch.Tensor:
    return modulated_layer_norm(x.float(), shift, scale, weight, bias, epsilon, modulation_axis).to(x.dtype)


@adaln_zero.register_fake
def _(x, shift, scale, weight, bias, epsilon, modulation_axis=0):
    return torch.empty_like(x)


# ---- ONNX function bodies (standard ops only) ------------------------------------------------
@onnxscript.script(_OPSET, default_opset=op)
def AdaLNZero(X, shift, scale, weight, bias, epsilon: float = 1e-6):
    xf = op.Cast(X, to=1)
    normed = op.LayerNormalization(xf, op.Cast(weight, to=1), op.Cast(bias, to=1), axis=-1, epsilon=epsilon)
    # [B, H] -> [B, 1, ..., 1, H]; a full-shape shift/scale keeps its shape
    mshape = op.Shape(shift)
    missing = op.Reshape(op.Size(op.Shape(X)) - op.Size(mshape), op.Constant(value_ints=[1]))
    target = op.Concat(op.Shape(shift, end=1), op.Expand(op.Constant(value_ints=[1]), missing),
                       op.Shape(shift, start=1), axis=0)
    shift_b = op.Reshape(op.Cast(shift, to=1), target)
    scale_b = op.Reshape(op.Cast(scale, to=1), target)
    return op.CastLike(normed * (op.CastLike(op.Constant(value_float=1.0), normed) + scale_b) + shift_b, X)


# The body of nodes with a modulation_axis attribute (the one above, which does not declare it,
# serves every other model unchanged): [B, H] -> [1 (modulation_axis times), B, 1.., H], that is
# the number of 1s X's rank lacks split around B; for X [S, B, H] and axis 1, [1, B, H], which
# broadcasts over S. Full-shape shift / scale lack no dims and keep their shape.
@onnxscript.script(_OPSET, default_opset=op)
def AdaLNZeroModAxis(X, shift, scale, weight, bias, epsilon: float = 1e-6, modulation_axis: int = 0):
    xf = op.Cast(X, to=1)
    normed = op.LayerNormalization(xf, op.Cast(weight, to=1), op.Cast(bias, to=1), axis=-1, epsilon=epsilon)
    one = op.Constant(value_ints=[1])
    missing = op.Reshape(op.Size(op.Shape(X)) - op.Size(op.Shape(shift)), one)
    lead = op.Min(op.Reshape(op.Constant(value_int=modulation_axis), one), missing)
    target = op.Concat(op.Expand(one, lead), op.Shape(shift, end=1), op.Expand(one, missing - lead),
                       op.Shape(shift, start=1), axis=0)
    shift_b = op.Reshape(op.Cast(shift, to=1), target)
    scale_b = op.Reshape(op.Cast(scale, to=1), target)
    return op.CastLike(normed * (op.CastLike(op.Constant(value_float=1.0), normed) + scale_b) + shift_b, X)


def named(make, name: str):
    """`make` (a FunctionProto factory) with the function renamed `name` (the op type)."""
    def proto():
        fn = make()
        fn.name = name
        return fn
    return proto


def mod_axis_kwargs(modulation_axis: int) -> dict:
    """The node attribute for `modulation_axis`: none when 0, so that default nodes stay as they were."""
    return {"modulation_axis": int(modulation_axis)} if modulation_axis else {}


def translate(x, shift, scale, weight, bias, epsilon: float, modulation_axis: int = 0):
    """torch.onnx custom_translation_table entry: one normexport::AdaLNZero node."""
    kw = mod_axis_kwargs(modulation_axis)
    if weight is None:
        return _OPSET.AdaLNZero(x, shift, scale, epsilon=epsilon, **kw)
    return _OPSET.AdaLNZero(x, shift, scale, weight, bias, epsilon=epsilon, **kw)


#: the LayerNorm's optional affine inputs and its epsilon (also GatedAdaLNZero's)
LAYER_NORM_AFFINE = (Input("weight", "LayerNorm weight [H]", optional=True, fill=1.0),
                     Input("bias", "LayerNorm bias [H]", optional=True, fill=0.0))
LAYER_NORM_EPSILON = Attr("epsilon", 1e-6, "LayerNorm epsilon")
#: which dim of X a [B, H] modulation follows (also GatedAdaLNZero's, for gate, shift and scale)
MODULATION_AXIS = Attr("modulation_axis", 0,
                       "the dim of X the rows of a [B, H] modulation follow (0: X [B, ..., H]; 1: X [S, B, H]), "
                       "0..rank(X)-2; no effect on a full-shape or [1, H] modulation", body_when_set=True)

SPEC = OpSpec(
    name="AdaLNZero",
    torch_op="normexport::adaln_zero",
    doc="Y = LayerNorm(X; weight, bias, epsilon) * (1 + scale) + shift; statistics in float32.",
    inputs=(
        Input("X", "input [B, ..., H], last dim normalized"),
        Input("shift", "[B, H] (broadcast over the dims but modulation_axis and the last) or the shape of X"),
        Input("scale", "[B, H] (broadcast over the dims but modulation_axis and the last) or the shape of X"),
        *LAYER_NORM_AFFINE,
    ),
    attributes=(LAYER_NORM_EPSILON, MODULATION_AXIS),
    reference=reference,
    body=AdaLNZero.to_function_proto,
    full_body=named(AdaLNZeroModAxis.to_function_proto, "AdaLNZero"),
)
