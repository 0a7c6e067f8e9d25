"""normexport::GatedAdaLNZero — AdaLN-Zero fused with the gated residual before it (DiT).

    Sum = X + gate * update                      (float32, rounded once to X's dtype)
    Y   = LayerNorm(Sum; weight, bias, epsilon) * (1 + scale) + shift   (of Sum as stored)

Outputs (Y, Sum): Sum is the next residual (DiT: x = x + gate_msa * attn(...); then the
modulated LayerNorm before the MLP). X, update: [B, ..., H], last dim normalized (biased
variance). gate, shift, scale: all three [B, H] (broadcast over the middle dims) or all three the
full shape of X. weight, bias: optional [H] LayerNorm affine (both or neither). Statistics in
float32, so the op equals Add(X, Mul(gate, update)) + normexport::AdaLNZero of the same dtype.
modulation_axis (attribute, default 0, left out of a node when 0): the dim of X that the rows of a
[B, H] gate / shift / scale follow, as AdaLNZero's (1: sequence-first X [S, B, H]).
This file is the single source of the op's contract.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnxscript
import torch
from onnxscript import opset18 as op

from . import adaln_zero as _adaln
from ._spec import DOMAIN, VERSION, Input, OpSpec

_OPSET = onnxscript.values.Opset(DOMAIN, VERSION)


def reference(x, update, gate, shift, scale, weight=None, bias=None, epsilon: float = 1e-6,
              dtype=None, modulation_axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """float64 numpy reference, written from the formula: (Y, Sum). With `dtype`, Sum is rounded to
    it before the normalisation (as the op stores it)."""
    x = np.asarray(x, dtype=np.float64)
    g = _adaln._broadcastable(np.asarray(gate, dtype=np.float64), x.ndim, modulation_axis)
    s = x + g * np.asarray(update, dtype=np.float64)
    stored = s if dtype is None else s.astype(dtype).astype(np.float64)
    return _adaln.reference(stored, shift, scale, weight, bias, epsilon, modulation_axis), s


# ---- torch custom op -------------------------------------------------------------------------
@torch.library.custom_op("normexport::gated_adaln_zero", mutates_args=())
def gated_adaln_zero(
    x: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    epsilon: float,
    modulation_axis: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    total = (x.float() + _adaln._mod(gate, x.dim(), modulation_axis) * update.float()).to(x.dtype)
    y = _adaln.modulated_layer_norm(total.float(), shift, scale, weight, bias, epsilon, modulation_axis)
    return y.to(x.dtype), total


@gated_adaln_zero.register_fake
def _(x, update, gate, shift, scale, weight, bias, epsilon, modulation_axis=0):
    return torch.empty_like(x), torch.empty_like(x)


# ---- ONNX function bodies (standard ops only) ------------------------------------------------
@onnxscript.script(_OPSET, default_opset=op)
def GatedAdaLNZero(X, update, gate, shift, scale, weight, bias, epsilon: float = 1e-6):
    # [B, H] -> [B, 1, ..., 1, H]; full-shape gate/shift/scale keep their shape (as AdaLNZero)
    mshape = op.Shape(shift)
    missing = op.Reshape(op.Size(op.Shape(X)) - op.Size(mshape), op.Constant(value_ints=[1]))
    target = op.Concat(op.Shape(shift, end=1), op.Expand(op.Constant(value_ints=[1]), missing),
                       op.Shape(shift, start=1), axis=0)
    gate_b = op.Reshape(op.Cast(gate, to=1), target)
    total = op.CastLike(op.Cast(X, to=1) + gate_b * op.Cast(update, to=1), X)
    normed = op.LayerNormalization(op.Cast(total, to=1), op.Cast(weight, to=1), op.Cast(bias, to=1), axis=-1,
                                   epsilon=epsilon)
    shift_b = op.Reshape(op.Cast(shift, to=1), target)
    scale_b = op.Reshape(op.Cast(scale, to=1), target)
    Y = op.CastLike(normed * (op.CastLike(op.Constant(value_float=1.0), normed) + scale_b) + shift_b, X)
    Sum = op.Identity(total)
    return Y, Sum


# The body of nodes with a modulation_axis attribute (AdaLNZeroModAxis's layout of [B, H]).
@onnxscript.script(_OPSET, default_opset=op)
def GatedAdaLNZeroModAxis(X, update, gate, shift, scale, weight, bias, epsilon: float = 1e-6,
                          modulation_axis: int = 0):
    one = op.Constant(value_ints=[1])
    missing = op.Reshape(op.Size(op.Shape(X)) - op.Size(op.Shape(shift)), one)
    lead = op.Min(op.Reshape(op.Constant(value_int=modulation_axis), one), missing)
    target = op.Concat(op.Expand(one, lead), op.Shape(shift, end=1), op.Expand(one, missing - lead),
                       op.Shape(shift, start=1), axis=0)
    gate_b = op.Reshape(op.Cast(gate, to=1), target)
    total = op.CastLike(op.Cast(X, to=1) + gate_b * op.Cast(update, to=1), X)
    normed = op.LayerNormalization(op.Cast(total, to=1), op.Cast(weight, to=1), op.Cast(bias, to=1), axis=-1,
                                   epsilon=epsilon)
    shift_b = op.Reshape(op.Cast(shift, to=1), target)
    scale_b = op.Reshape(op.Cast(scale, to=1), target)
    Y = op.CastLike(normed * (op.CastLike(op.Constant(value_float=1.0), normed) + scale_b) + shift_b, X)
    Sum = op.Identity(total)
    return Y, Sum


def translate(x, update, gate, shift, scale, weight, bias, epsilon: float, modulation_axis: int = 0):
    """torch.onnx custom_translation_table entry: one normexport::GatedAdaLNZero node, two outputs."""
    kw = _adaln.mod_axis_kwargs(modulation_axis)
    if weight is None:
        return _OPSET.GatedAdaLNZero(x, update, gate, shift, scale, epsilon=epsilon, **kw)
    return _OPSET.GatedAdaLNZero(x, update, gate, shift, scale, weight, bias, epsilon=epsilon, **kw)


SPEC = OpSpec(
    name="GatedAdaLNZero",
    torch_op="normexport::gated_adaln_zero",
    doc="Sum = X + gate * update (rounded to X's dtype); Y = LayerNorm(Sum; weight, bias, epsilon) * (1 + scale) "
        "+ shift; statistics in float32.",
    inputs=(
        Input("X", "residual stream [B, ..., H], last dim normalized"),
        Input("update", "the branch output added to X, the shape of X"),
        Input("gate", "[B, H] (broadcast over the dims but modulation_axis and the last) or the shape of X"),
        Input("shift", "[B, H] (broadcast over middle dims) or the shape of X; the layout of gate"),
        Input("scale", "[B, H] (broadcast over middle dims) or the shape of X; the layout of gate"),
        *_adaln.LAYER_NORM_AFFINE,
    ),
    attributes=(_adaln.LAYER_NORM_EPSILON, _adaln.MODULATION_AXIS),
    reference=reference,
    body=GatedAdaLNZero.to_function_proto,
    full_body=_adaln.named(GatedAdaLNZeroModAxis.to_function_proto, "GatedAdaLNZero"),
    outputs=(("Y", "the modulated LayerNorm of Sum, the shape and type of X"),
             ("Sum", "X + gate * update, the next residual")),
)
