"""A LLaMA decoder block: RMSNorm written like Hugging Face's LlamaRMSNorm, RoPE computed from
positions inside forward, grouped-query causal attention, SwiGLU MLP. No final norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import randn, randomize_


class LlamaStyleRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, rope_theta: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rope_theta = rope_theta
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        pos = torch.arange(s, device=x.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    input_names = ["x"]
    output_names = ["y"]
    dynamic_axes = {"x": [0, 1]}

    def __init__(self, hidden: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                 intermediate: int = 172, eps: float = 1e-6, rope_theta: float = 10000.0,
                 seq: int = 8, seed: int = 0):
        super().__init__()
        self.hidden, self.seq, self.seed = hidden, seq, seed
        self.input_layernorm = LlamaStyleRMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(hidden, heads, kv_heads, head_dim, rope_theta)
        self.post_attention_layernorm = LlamaStyleRMSNorm(hidden, eps)
        self.mlp = LlamaMLP(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x

    def example_inputs(self, batch: int = 2, seq: int | None = None) -> tuple[torch.Tensor, ...]:
        seq = self.seq if seq is None else seq
        dtype = next(self.parameters()).dtype
        return (randn((batch, seq, self.hidden), self.seed + 201, dtype),)


def tiny(seed: int = 0, **kwargs) -> LlamaBlock:
    m = LlamaBlock(seed=seed, **kwargs)
    randomize_(m, seed)
    return m.eval()
