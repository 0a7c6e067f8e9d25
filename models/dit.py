"""A DiT block with adaLN-Zero conditioning (Peebles & Xie, "Scalable Diffusion Models with
Transformers"), written like the reference implementation: the modulation linear is randomised
(not zero-initialised) so shift/scale/gate are non-trivial."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import randn, randomize_


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(x).reshape(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class Mlp(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DiTBlock(nn.Module):
    input_names = ["x", "c"]
    output_names = ["y"]
    dynamic_axes = {"x": [0, 1], "c": [0]}

    def __init__(self, hidden: int = 64, heads: int = 4, mlp_ratio: float = 4.0, seq: int = 8, seed: int = 0):
        super().__init__()
        self.hidden, self.seq, self.seed = hidden, seq, seed
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, heads)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden, int(hidden * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden, bias=True))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x

    def example_inputs(self, batch: int = 2, seq: int | None = None) -> tuple[torch.Tensor, ...]:
        seq = self.seq if seq is None else seq
        dtype = next(self.parameters()).dtype
        return (randn((batch, seq, self.hidden), self.seed + 101, dtype),
                randn((batch, self.hidden), self.seed + 102, dtype))


def tiny(hidden: int = 64, heads: int = 4, mlp_ratio: float = 4.0, seq: int = 8, seed: int = 0) -> DiTBlock:
    torch.manual_seed(seed)  # constructor init is overwritten below; keep it deterministic anyway
    m = DiTBlock(hidden, heads, mlp_ratio, seq, seed)
    randomize_(m, seed)
    return m.eval()
