"""normexport::SkipRMSNorm — RMSNorm fused with the residual add before it.

    Sum = X + skip [+ bias]                      (float32, rounded once to X's dtype)
    Y   = Sum / sqrt(mean(Sum^2 over the last dim) + epsilon) * scale   (of Sum as stored)

Outputs (Y, Sum): Sum is the next residual (LLaMA: h = x + attn(x); y = rmsnorm(h); ...; h + mlp(y)).
X, skip: the same shape [..., H]; scale, bias: [H]. Statistics in float32 whatever the input
dtype, so the op equals Add + normexport::RMSNorm(axis=-1) of the same dtype. This file is the
single source of the op's contract.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnxscript
import torch
from onnxscript import opset18 as op

from . import rms_norm as _rms
from ._spec import DOMAIN, VERSION, Attr, Input, OpSpec

_OPSET = onnxscript.values.Opset(DOMAIN, VERSION)


def reference(x, skip, scale, bias=None, epsilon: float = 1e-6, dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """float64 numpy reference, written from the formula: (Y, Sum). With `dtype`, Sum is rounded to
    it before the normalisation (as the op stores it)."""
    s = np.asarray(x, dtype=np.float64) + np.asarray(skip, dtype=np.float64)
    if bias is not None:
        s = s + np.asarray(bias, dtype=np.float64)
    stored = s if dtype is None else s.astype(dtype).astype(np.float64)
    return _rms.reference(stored, scale, epsilon, -1), s


# ---- torch custom op -------------------------------------------------------------------------
@torch.library.custom_op("normexport::skip_rms_norm", mutates_args=())
def skip_rms_norm(x: torch.Tensor, skip: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                  epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.float() + skip.float()
    if bias is not None:
        s = s + bias.float()
    total = s.to(x.dtype)
    return _rms.rms_normalize(total.float(), scale, epsilon, -1).to(x.dtype), total


@skip_rms_norm.register_fake
def _(x, skip, scale, bias, epsilon):
    return torch.empty_like(x), torch.empty_like(x)


# ---- ONNX function body (standard ops only) ------------------------------------------------
# The reduction axis is a Constant ([-1]): TensorRT's parser needs it at build time (docs/design.md §2).
@onnxscript.script(_OPSET, default_opset=op)
def SkipRMSNorm(X, skip, scale, bias, epsilon: float = 1e-6):
    total = op.CastLike(op.Cast(X, to=1) + op.Cast(skip, to=1) + op.Cast(bias, to=1), X)
    sf = op.Cast(total, to=1)
    mean_sq = op.ReduceMean(sf * sf, op.Constant(value_ints=[-1]), keepdims=1)
    inv_rms = op.Reciprocal(op.Sqrt(mean_sq + op.CastLike(op.Constant(value_float=epsilon), mean_sq)))
    Y = op.CastLike(sf * inv_rms * op.Cast(scale, to=1), X)
    Sum = op.Identity(total)
    return Y, Sum


def translate(x, skip, scale, bias, epsilon: float):
    """torch.onnx custom_translation_table entry: one normexport::SkipRMSNorm node, two outputs."""
    if bias is None:
        return _OPSET.SkipRMSNorm(x, skip, scale, epsilon=epsilon)
    return _OPSET.SkipRMSNorm(x, skip, scale, bias, epsilon=epsilon)


SPEC = OpSpec(
    name="SkipRMSNorm",
    torch_op="normexport::skip_rms_norm",
    doc="Sum = X + skip [+ bias] (rounded to X's dtype); Y = Sum / sqrt(mean(Sum^2, last dim) + epsilon) * scale; "
        "statistics in float32.",
    inputs=(
        Input("X", "input [..., H]"),
        Input("skip", "residual, the shape of X"),
        Input("scale", "RMSNorm weight [H]"),
        Input("bias", "added to the sum [H]", optional=True, fill=0.0),
    ),
    attributes=(Attr("epsilon", 1e-6, "added to the mean of squares"),),
    reference=reference,
    body=SkipRMSNorm.to_function_proto,
    outputs=(("Y", "RMSNorm of Sum, the shape and type of X"), ("Sum", "X + skip [+ bias], the next residual")),
)
