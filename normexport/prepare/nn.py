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

    shift/scale: [B, H] (broadcast over the dims of x but `modulation_axis` and the last: 0 for
    x [B, ..., H], 1 for a sequence-first x [S, B, H]) or the shape of x."""

    def __init__(self, hidden: int, eps: float = 1e-6, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, modulation_axis: int = 0):
        super().__init__()
        self.hidden = int(hidden)
        self.eps = float(eps)
        self.modulation_axis = int(modulation_axis)
        if weight is not None or bias is not None:  # the op takes both or neither
            w = weight.detach().clone() if weight is not None else torch.ones(hidden)
            b = bias.detach().clone() if bias is not None else torch.zeros(hidden, dtype=w.dtype)
            self.weight = nn.Parameter(w, requires_grad=False)
            self.bias = nn.Parameter(b, requires_grad=False)
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.modulation_axis:
            return torch.ops.normexport.adaln_zero(x, shift, scale, self.weight, self.bias, self.eps,
                                                   self.modulation_axis)
        return torch.ops.normexport.adaln_zero(x, shift, scale, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        axis = f", modulation_axis={self.modulation_axis}" if self.modulation_axis else ""
        return f"{self.hidden}, eps={self.eps}, affine={self.weight is not None}{axis}"


class GatedRMSNorm(nn.Module):
    """Gated RMSNorm with the RMSNorm part as the normexport op and the gate outside it.

    gate first (Mamba2's MambaRMSNormGated, Zamba2, Bamba, NemotronH):
        y = RMSNorm(x * silu(gate)) * weight
    norm first (`norm_before_gate`, Qwen3-Next, FalconH1's default):
        y = RMSNorm(x) * weight * silu(gate)
    gate None: y = RMSNorm(x) * weight. With `groups` > 1 the statistics are per group of
    H / groups channels of the last dim: the op runs with a unit scale over [..., groups, H / groups]
    and the weight multiplies after. Computed in float32 (as those modules do), cast back to x's dtype."""

    def __init__(self, weight: torch.Tensor, eps: float = 1e-6, groups: int = 1, norm_before_gate: bool = False):
        super().__init__()
        hidden = weight.shape[-1]
        if groups < 1 or hidden % groups:
            raise ValueError(f"{groups} groups do not divide the {hidden} channels")
        self.groups, self.eps, self.norm_before_gate = int(groups), float(eps), bool(norm_before_gate)
        if groups == 1:
            self.norm = RMSNorm(weight.float(), eps, axis=-1)
            self.weight = None
        else:  # unit scale in the op, the per-channel weight after it
            self.norm = RMSNorm(torch.ones(hidden // groups), eps, axis=-1)
            self.weight = nn.Parameter(weight.detach().float().clone(), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.float()
        g = None if gate is None else nn.functional.silu(gate.float())
        if g is not None and not self.norm_before_gate:
            x = x * g
        if self.groups == 1:
            y = self.norm(x)
        else:
            y = self.norm(x.unflatten(-1, (self.groups, -1))).flatten(-2) * self.weight
        if g is not None and self.norm_before_gate:
            y = y * g
        return y.to(dtype)

    def extra_repr(self) -> str:
        return f"groups={self.groups}, {'norm before gate' if self.norm_before_gate else 'gate before norm'}"
