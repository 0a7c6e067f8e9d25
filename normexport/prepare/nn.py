"""nn.Modules that call the normexport custom ops; `normexport.prepare` swaps them in."""

from __future__ import annotations

import torch
from torch import nn

from ..ops import adaln_zero as _adaln  # noqa: F401  (registers torch.ops.normexport.*)
from ..ops import rms_norm as _rms  # noqa: F401


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2 over dims axis..) + eps) * weight, statistics in float32.

    Gemma-style (1 + w) models pass the folded weight (1 + w)."""

    def __init__(self, weight: torch.Tensor, eps: float = 1e-6, axis: int = -1):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.eps = float(eps)
        self.axis = int(axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.normexport.rms_norm(x, self.weight, self.eps, self.axis)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, axis={self.axis}"


class AdaLNZero(nn.Module):
    """y = LayerNorm(x; weight, bias, eps) * (1 + scale) + shift, statistics in float32.

    shift/scale: [B, H] (broadcast over the middle dims) or the shape of x."""

    def __init__(self, hidden: int, eps: float = 1e-6, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.hidden = int(hidden)
        self.eps = float(eps)
        if weight is not None or bias is not None:  # the op takes both or neither
            w = weight.detach().clone() if weight is not None else torch.ones(hidden)
            b = bias.detach().clone() if bias is not None else torch.zeros(hidden, dtype=w.dtype)
            self.weight = nn.Parameter(w, requires_grad=False)
            self.bias = nn.Parameter(b, requires_grad=False)
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.ops.normexport.adaln_zero(x, shift, scale, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, affine={self.weight is not None}"
