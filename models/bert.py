"""A BERT post-LN encoder block: attention -> residual -> LayerNorm -> GELU FFN -> residual ->
LayerNorm (eps 1e-12, random affine)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import randn, randomize_


class BertSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads

        def split(t):
            return t.view(b, s, self.heads, d).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)), split(self.value(x)),
                                           dropout_p=0.0)
        return self.dense(y.transpose(1, 2).reshape(b, s, h))


class BertBlock(nn.Module):
    input_names = ["x"]
    output_names = ["y"]
    dynamic_axes = {"x": [0, 1]}

    def __init__(self, hidden: int = 64, heads: int = 4, intermediate: int = 256, eps: float = 1e-12,
                 seq: int = 8, seed: int = 0):
        super().__init__()
        self.hidden, self.seq, self.seed = hidden, seq, seed
        self.attention = BertSelfAttention(hidden, heads)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.output = nn.Linear(intermediate, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x))
        x = self.output_norm(x + self.output(F.gelu(self.intermediate(x))))
        return x

    def example_inputs(self, batch: int = 2, seq: int | None = None) -> tuple[torch.Tensor, ...]:
        seq = self.seq if seq is None else seq
        dtype = next(self.parameters()).dtype
        return (randn((batch, seq, self.hidden), self.seed + 301, dtype),)


def tiny(seed: int = 0, **kwargs) -> BertBlock:
    m = BertBlock(seed=seed, **kwargs)
    randomize_(m, seed)
    return m.eval()
