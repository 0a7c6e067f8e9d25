"""Small models for the CLI tests (importable as `_cli_models:...` with tests/ on sys.path)."""

import torch
from torch import nn


class RMSNormBlock(nn.Module):
    """Linear -> hand-written RMSNorm (HF style) -> Linear; two inputs."""

    def __init__(self, hidden: int = 24):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.fc = nn.Linear(hidden, hidden)
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(hidden, generator=g))
        self.out = nn.Linear(hidden, hidden)
        self.eps = 1e-6

    def forward(self, x, y):
        h = self.fc(x) + y
        hf = h.float()
        h = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        return self.out(h)


def rms_block():
    return RMSNormBlock().eval()


class Evil:
    """Unpickling this writes a marker file: proves whether a pickle was ever loaded."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


class ScalarExampleInputs(RMSNormBlock):
    """Declares example inputs that are not tensors."""

    def example_inputs(self):
        return [1, 2.0]


def scalar_example_inputs():
    return ScalarExampleInputs().eval()
