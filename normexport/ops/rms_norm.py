"""normexport::RMSNorm — Y = X / sqrt(mean(X^2 over dims axis..rank-1) + epsilon) * scale.

Statistics in float32 whatever the input dtype. Gemma-style (1 + w) weights are folded into
`scale` before export. This file is the single source of the op's contract.
"""

from __future__ import annotations

import numpy as np
import onnxscript
import torch
from onnxscript import opset18 as op

from ._spec import DOMAIN, VERSION, Attr, Input, OpSpec

_OPSET = onnxscript.values.Opset(DOMAIN, VERSION)


def reference(x, scale, epsilon: float = 1e-6, axis: int = -1) -> np.ndarray:
    """float64 numpy reference, written from the formula."""
    x = np.asarray(x, dtype=np.float64)
    axis = axis % x.ndim
    axes = tuple(range(axis, x.ndim))
    ms = np.mean(x * x, axis=axes, keepdims=True)
    return x / np.sqrt(ms + epsilon) * np.asarray(scale, dtype=np.float64)


# ---- torch custom op -------------------------------------------------------------------------
def rms_normalize(xf: torch.Tensor, scale: torch.Tensor, epsilon: float, axis: int) -> torch.Tensor:
    """xf / sqrt(mean(xf^2 over dims axis..rank-1) + epsilon) * scale in float32, xf float32 (also
    SkipRMSNorm's, on its sum)."""
    dims = tuple(range(axis % xf.dim(), xf.dim()))
    return xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon) * scale.float()


@torch.library.custom_op("normexport::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, scale: torch.Tensor, epsilon: float, axis: int) -> torch.Tensor:
    return rms_normalize(x.float(), scale, epsilon, axis).to(x.dtype)


@rms_norm.register_fake
def _(x, scale, epsilon, axis):
    return torch.empty_like(x)


# ---- ONNX function body (standard ops only) --------------------------------------------------
@onnxscript.script(_OPSET, default_opset=op)
def RMSNorm(X, scale, epsilon: float = 1e-6, axis: int = -1):
    # TensorRT's parser needs reduction axes that are constants at build time: reshape X to
    # [dims before `axis`..., normalized elements], reduce over the constant last axis, and give
    # the result X's shape back. (Not Flatten(axis=axis): onnx's reference evaluator, the
    # rewriter's float64 reference, cannot run a unary op whose attribute refers to the
    # function's, and the local verification of fusions around an RMSNorm node needs it.)
    xf = op.Cast(X, to=1)
    # (the normalized element count as ReduceProd of the trailing dims, not -1: a -1 cannot be
    # resolved for an empty X, which onnxruntime then refuses)
    n = op.ReduceProd(op.Shape(X, start=axis), keepdims=1)
    flat = op.Reshape(xf, op.Concat(op.Shape(X, end=axis), n, axis=0))
    mean_sq = op.ReduceMean(flat * flat, op.Constant(value_ints=[-1]), keepdims=1)
    inv_rms = op.Reciprocal(op.Sqrt(mean_sq + op.CastLike(op.Constant(value_float=epsilon), mean_sq)))
    y = op.Reshape(flat * inv_rms, op.Shape(X))
    return op.CastLike(y * op.Cast(scale, to=1), X)


def translate(x, scale, epsilon: float, axis: int):
    """torch.onnx custom_translation_table entry: one normexport::RMSNorm node."""
    return _OPSET.RMSNorm(x, scale, epsilon=epsilon, axis=axis)


SPEC = OpSpec(
    name="RMSNorm",
    torch_op="normexport::rms_norm",
    doc="Y = X / sqrt(mean(X^2 over dims axis..rank-1) + epsilon) * scale; statistics in float32.",
    inputs=(
        Input("X", "input, any rank >= 1"),
        Input("scale", "weight, shape X.shape[axis:] (usually [H])"),
    ),
    attributes=(
        Attr("epsilon", 1e-6, "added to the mean of squares"),
        Attr("axis", -1, "first normalized dim; dims axis..rank-1 are normalized"),
    ),
    reference=reference,
    body=RMSNorm.to_function_proto,
)
