"""torch's own norms (LayerNorm, GroupNorm, LocalResponseNorm, BatchNorm / InstanceNorm) are not
swapped: they export as standard ONNX ops (a LayerNorm followed by * (1 + scale) + shift is fused
into AdaLNZero by the ONNX rewriter; BatchNorm is folded by fold_bn). torch.nn.RMSNorm is swapped
(torch_rms_norm)."""

from __future__ import annotations

from torch import nn

STANDARD_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)


def skip_reason(m: nn.Module) -> str | None:
    """Why `m`, a standard torch norm, is left alone (the report's reason), else None."""
    if not isinstance(m, STANDARD_NORMS) or isinstance(m, nn.RMSNorm):
        return None
    if isinstance(m, nn.LayerNorm):
        why = ("nn.LayerNorm is exported as ONNX LayerNormalization (a following "
               "* (1 + scale) + shift is fused into AdaLNZero by the ONNX rewriter)")
    elif isinstance(m, nn.modules.batchnorm._NormBase):
        why = f"{type(m).__name__} is folded into the preceding conv/linear (fold_bn) or exported as a standard op"
    else:
        why = f"{type(m).__name__} is exported as a standard ONNX op"
    return "standard torch norm, not swapped: " + why
