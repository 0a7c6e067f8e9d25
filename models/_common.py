"""Shared helpers of the reference models (seeded randomisation)."""

from __future__ import annotations

import torch
from torch import nn

def randomize_(module: nn.Module, seed: int, std: float = 0.2) -> nn.Module:
    """Seeded in-place randomisation of every parameter and buffer of float dtype.

    Weights of norms get 1 + N(0, std) (never all ones); biases N(0, std); BN running_var is
    uniform(0.5, 2.0); everything else N(0, std / sqrt(fan_in))-ish so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mname, m in module.named_modules():
            is_norm = "norm" in type(m).__name__.lower() or isinstance(m, nn.modules.batchnorm._BatchNorm)
            for pname, p in m.named_parameters(recurse=False):
                if is_norm and pname == "weight":
                    p.copy_(1.0 + std * torch.randn(p.shape, generator=g))
                elif pname == "bias" or p.dim() < 2:
                    p.copy_(std * torch.randn(p.shape, generator=g))
                else:
                    fan_in = p[0].numel()
                    p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
            for bname, b in m.named_buffers(recurse=False):
                if not b.is_floating_point():
                    continue
                if bname == "running_mean":
                    b.copy_(0.5 * torch.randn(b.shape, generator=g))
                elif bname == "running_var":
                    b.copy_(torch.empty(b.shape).uniform_(0.5, 2.0, generator=g))
    return module


def randn(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)
