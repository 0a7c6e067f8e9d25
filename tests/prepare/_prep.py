"""Shared by tests/prepare/test_*.py (one per normexport.prepare.recognisers module): seeded
inputs, random weights, the report helpers, and float64 numpy references written from the
formulas (independent of normexport.ops' references)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from normexport.prepare.swap import REL_TOL, prepare, rel_err


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0, offset=0.3):
    return torch.randn(shape, generator=gen(seed)) * 2.0 + offset


def tiny_rows(x, scale=1e-3):
    """x with its first row (along the last dim) scaled down: there eps is not negligible."""
    x = x.clone()
    x.view(-1, x.shape[-1])[0] *= scale
    return x


def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Random weights, never all ones: 1-D weights ~ 1 + N(0, 0.3²), the rest N(0, 0.3²)."""
    g = gen(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = 1.0 if name.endswith("weight") and p.dim() == 1 else 0.0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))
    return module.eval()


def swapped(report, op=None):
    return [e for e in report if e["action"] == "swapped" and (op is None or e["op"] == op)]


def count_modules(module, cls):
    return sum(isinstance(m, cls) for m in module.modules())


def check_swap(module, *inputs, op="RMSNorm", n=1):
    """prepare(module): n swaps to `op`, each with a full report entry, outputs within REL_TOL."""
    report = []
    new = prepare(module, report)
    assert len(swapped(report, op)) == n, report
    for e in swapped(report):
        assert e["max_rel_err"] <= REL_TOL
        assert set(e) == {"name", "kind", "action", "op", "reason", "max_rel_err"}
    with torch.no_grad():
        assert rel_err(new(*inputs), module(*inputs)) <= REL_TOL
    return new, report


def f64(t):
    return t.detach().double().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, dtype=np.float64)


def rms_ref(x, w, eps, dims=1, gemma=False, bias=None):
    """y = x / sqrt(mean(x², last `dims` dims) + eps) * w (Gemma: * (1 + w)) (+ bias), float64."""
    x = f64(x)
    axes = tuple(range(-dims, 0))
    y = x / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps)
    w = f64(w)
    y = y * ((1.0 + w) if gemma else w)
    return y if bias is None else y + f64(bias)


def layer_norm_ref(x, eps, w=None, b=None):
    """(x - mean) / sqrt(var + eps) over the last dim (biased variance) [* w] [+ b], float64."""
    x = f64(x)
    mu = x.mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    if w is not None:
        y = y * f64(w)
    if b is not None:
        y = y + f64(b)
    return y


def adaln_ref(x, shift, scale, eps, w=None, b=None):
    """AdaLN-Zero: LayerNorm(x) * (1 + scale[:, None]) + shift[:, None], float64."""
    return layer_norm_ref(x, eps, w, b) * (1.0 + f64(scale)[:, None]) + f64(shift)[:, None]


def assert_close64(got, want, rtol=1e-5):
    """max|got - want| <= rtol * max|want| (+ a float32 floor)."""
    got, want = f64(got), np.asarray(want)
    err = np.abs(got - want).max()
    assert err <= rtol * np.abs(want).max() + 1e-6, (err, np.abs(want).max())
