"""normexport::AdaLNZero — Y = LayerNorm(X; weight, bias, epsilon) * (1 + scale) + shift.

X: [B, ..., H], last dim normalized (biased variance), statistics in float32.
shift, scale: [B, H] (broadcast over the middle dims) or the full shape of X; both the same shape.
weight, bias: optional [H] LayerNorm affine (both or neither).
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


def _broadcastable(mod: np.ndarray, ndim: int) -> np.ndarray:
    """[B, H] -> [B, 1, ..., 1, H]; a full-shape tensor is returned as is."""
    if mod.ndim == ndim:
        return mod
    return mod.reshape(mod.shape[:1] + (1,) * (ndim - 2) + mod.shape[-1:])


def reference(x, shift, scale, weight=None, bias=None, epsilon: float = 1e-6) -> np.ndarray:
    """float64 numpy reference, written from the formula."""
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + epsilon)
    if weight is not None:
        y = y * np.asarray(weight, dtype=np.float64)
    if bias is not None:
        y = y + np.asarray(bias, dtype=np.float64)
    shift = _broadcastable(np.asarray(shift, dtype=np.float64), x.ndim)
    scale = _broadcastable(np.asarray(scale, dtype=np.float64), x.ndim)
    return y * (1.0 + scale) + shift


# ---- torch custom op -------------------------------------------------------------------------
def _mod(t: torch.Tensor, ndim: int) -> torch.Tensor:
    if t.dim() == ndim:
        return t.float()
    return t.float().reshape(t.shape[:1] + (1,) * (ndim - 2) + t.shape[-1:])


def modulated_layer_norm(xf: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, weight: Optional[torch.Tensor],
                         bias: Optional[torch.Tensor], epsilon: float) -> torch.Tensor:
    """LayerNorm(xf; weight, bias, epsilon) * (1 + scale) + shift in float32, xf float32 (also
    GatedAdaLNZero's, on its sum)."""
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    y = torch.nn.functional.layer_norm(xf, xf.shape[-1:], w, b, epsilon)
    return y * (1.0 + _mod(scale, xf.dim())) + _mod(shift, xf.dim())


@torch.library.custom_op("normexport::adaln_zero", mutates_args=())
def adaln_zero(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    epsilon: float,
) -> torch.Tensor:
    return modulated_layer_norm(x.float(), shift, scale, weight, bias, epsilon).to(x.dtype)


@adaln_zero.register_fake
def _(x, shift, scale, weight, bias, epsilon):
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


def translate(x, shift, scale, weight, bias, epsilon: float):
    """torch.onnx custom_translation_table entry: one normexport::AdaLNZero node."""
    if weight is None:
        return _OPSET.AdaLNZero(x, shift, scale, epsilon=epsilon)
    return _OPSET.AdaLNZero(x, shift, scale, weight, bias, epsilon=epsilon)


#: the LayerNorm's optional affine inputs and its epsilon (also GatedAdaLNZero's)
LAYER_NORM_AFFINE = (Input("weight", "LayerNorm weight [H]", optional=True, fill=1.0),
                     Input("bias", "LayerNorm bias [H]", optional=True, fill=0.0))
LAYER_NORM_EPSILON = Attr("epsilon", 1e-6, "LayerNorm epsilon")

SPEC = OpSpec(
    name="AdaLNZero",
    torch_op="normexport::adaln_zero",
    doc="Y = LayerNorm(X; weight, bias, epsilon) * (1 + scale) + shift; statistics in float32.",
    inputs=(
        Input("X", "input [B, ..., H], last dim normalized"),
        Input("shift", "[B, H] (broadcast over middle dims) or the shape of X"),
        Input("scale", "[B, H] (broadcast over middle dims) or the shape of X"),
        *LAYER_NORM_AFFINE,
    ),
    attributes=(LAYER_NORM_EPSILON,),
    reference=reference,
    body=AdaLNZero.to_function_proto,
)
