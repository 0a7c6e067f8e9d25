"""torch's own norms (LayerNorm, GroupNorm, LocalResponseNorm, BatchNorm / InstanceNorm) are not
swapped: they export as standard ONNX ops (a LayerNorm followed by * (1 + scale) + shift is fused
into AdaLNZero by the ONNX rewriter; BatchNorm is folded by fold_bn). torch.nn.RMSNorm is swapped
(torch_rms_norm)."""

from __future__ import annotations

from torch import nn

from ..fold_bn import BatchNormAffine, FoldedLinearBatchNorm1d

STANDARD_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)
#: what fold_bn leaves of a BatchNorm it could not fold into a neighbour
FOLDED = (BatchNormAffine, FoldedLinearBatchNorm1d)


def wrapped_reason(m: nn.Module) -> str | None:
    """For a module no recogniser took: the inner norm's skip_reason when `m` has no weights of its own
    around exactly one standard norm (PatchTST's PatchTSTBatchNorm transposes around a BatchNorm1d),
    else None. Asked only after the recognisers, so a weightless wrapper that modulates its LayerNorm
    is still theirs."""
    children = list(m.children())
    if len(children) != 1 or any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)):
        return None
    return skip_reason(children[0]) or wrapped_reason(children[0])


def skip_reason(m: nn.Module) -> str | None:
    """Why `m`, a standard torch norm (or what fold_bn left of a BatchNorm), is left alone (the
    report's reason), else None."""
    if isinstance(m, FOLDED):
        return "standard torch norm, not swapped: a BatchNorm that fold_bn turned into a per-channel affine"
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
