"""The norm-heavy graph used by the benchmarks: residual adds, two RMSNorms and a modulated
LayerNorm (LayerNorm without affine, then * (1 + scale) + shift from SiLU + Linear of the
condition). `tiny()` is S=64, H=256; `bench()` is the benchmark size S=4096, H=2048, fp32."""

from __future__ import annotations

import torch
from torch import nn

from ._common import randn, randomize_


class SimpleRMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class NormHeavy(nn.Module):
    input_names = ["x", "r", "c"]
    output_names = ["y"]
    dynamic_axes = {"x": [0], "r": [0]}
    #: True for the benchmark-size instance from bench()
    is_benchmark_size = False

    def __init__(self, seq: int = 64, hidden: int = 256, eps: float = 1e-6, seed: int = 0):
        super().__init__()
        self.seq, self.hidden, self.seed = seq, hidden, seed
        self.norm1 = SimpleRMSNorm(hidden, eps)
        self.norm2 = SimpleRMSNorm(hidden, eps)
        self.norm3 = nn.LayerNorm(hidden, elementwise_affine=False, eps=eps)
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x: torch.Tensor, r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h = x + r
        y1 = self.norm1(h)
        y2 = self.norm2(y1 + r)
        shift, scale = self.modulation(c).chunk(2, dim=-1)  # [1, H] each
        return self.norm3(y2 + h) * (1 + scale) + shift

    def example_inputs(self, batch: int = 2, seq: int | None = None) -> tuple[torch.Tensor, ...]:
        """`batch` is ignored (the graph has no batch dim); `seq` overrides S."""
        seq = self.seq if seq is None else seq
        dtype = next(self.parameters()).dtype
        return (randn((seq, self.hidden), self.seed + 501, dtype),
                randn((seq, self.hidden), self.seed + 502, dtype),
                randn((1, self.hidden), self.seed + 503, dtype))


def tiny(seed: int = 0, seq: int = 64, hidden: int = 256) -> NormHeavy:
    m = NormHeavy(seq, hidden, seed=seed)
    randomize_(m, seed)
    return m.eval()


def bench(seed: int = 0) -> NormHeavy:
    """Benchmark size: S=4096, H=2048, float32."""
    m = tiny(seed, seq=4096, hidden=2048)
    m.is_benchmark_size = True
    return m
