"""recognisers/diffusers_adaln.py: diffusers AdaLayerNormZero / AdaLayerNormZeroSingle /
AdaLayerNormContinuous (LayerNorm) / SD35AdaLayerNormZeroX -> normexport AdaLNZero; the modulated
outputs against the float64 formula y = LayerNorm(x) * (1 + scale) + shift (the LayerNorm without
affine, or with the module's own), the other outputs unchanged."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from torch import nn

from normexport.prepare import nn as nenn
from normexport.prepare.recognisers import diffusers_adaln
from normexport.prepare.swap import REL_TOL, prepare, rel_err

sys.path.insert(0, os.path.dirname(__file__))
from _prep import (adaln_ref, assert_close64, check_swap, count_modules, f64, randn, randomize,  # noqa: E402
                   swapped, tiny_rows)

torch.set_grad_enabled(False)


@pytest.mark.parametrize("num_embeddings", [None, 10])
def test_diffusers_adaln_zero(num_embeddings):
    from diffusers.models.normalization import AdaLayerNormZero

    torch.manual_seed(0)
    m = randomize(AdaLayerNormZero(32, num_embeddings=num_embeddings), seed=9)
    x = tiny_rows(randn(2, 6, 32, seed=10))
    if num_embeddings is None:
        args = (x, None, None, None, randn(2, 32, seed=11))
    else:
        args = (x, torch.tensor([10.0, 700.0]), torch.tensor([1, 7]), torch.float32, None)
    report = []
    new = prepare(m, report)
    assert len(swapped(report, "AdaLNZero")) == 1, report
    assert isinstance(new, diffusers_adaln.AdaLayerNormZeroNE) and count_modules(new, nenn.AdaLNZero) == 1
    want, got = m(*args), new(*args)
    assert len(got) == len(want) == 5
    for g_, w_ in zip(got[1:], want[1:]):  # gate_msa, shift_mlp, scale_mlp, gate_mlp unchanged
        torch.testing.assert_close(g_, w_, rtol=0, atol=0)
    assert rel_err(got[0], want[0]) <= REL_TOL
    # against the float64 formula, from the module's own modulation
    emb = m.linear(m.silu(args[4] if num_embeddings is None else m.emb(args[1], args[2], hidden_dtype=torch.float32)))
    shift, scale = emb.chunk(6, dim=1)[:2]
    assert_close64(got[0], adaln_ref(x, shift, scale, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_diffusers_adaln_zero_half_precision_no_worse_than_eager(dtype):
    """fp16 / bf16 AdaLayerNormZero: the swapped op (fp32 statistics) is no further from the
    float64 formula than diffusers' own module in the same dtype."""
    from diffusers.models.normalization import AdaLayerNormZero

    torch.manual_seed(0)
    m = randomize(AdaLayerNormZero(48), seed=21).to(dtype)
    new = prepare(m)
    assert count_modules(new, nenn.AdaLNZero) == 1
    x, emb = randn(4, 33, 48, seed=22).to(dtype), randn(4, 48, seed=23).to(dtype)
    y_new, y_eager = new(x, emb=emb)[0], m(x, emb=emb)[0]
    assert y_new.dtype == y_eager.dtype == dtype
    shift, scale = m.linear(m.silu(emb)).chunk(6, dim=1)[:2]  # the module's own modulation, in dtype
    ref = adaln_ref(x, shift, scale, 1e-6)
    err_new = np.abs(f64(y_new) - ref).max()
    err_eager = np.abs(f64(y_eager) - ref).max()
    assert err_new <= err_eager * (1 + 1e-6), (err_new, err_eager)
    assert err_new <= {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype] * np.abs(ref).max()


def test_diffusers_adaln_zero_inside_model():
    from diffusers.models.normalization import AdaLayerNormZero

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = AdaLayerNormZero(32)
            self.proj = nn.Linear(32, 32)

        def forward(self, x, emb):
            h, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, emb=emb)
            return x + gate[:, None] * self.proj(h) * (1 + scale_mlp[:, None]) + shift_mlp[:, None] + gate_mlp[:, None]

    m = randomize(Block(), seed=12)
    check_swap(m, randn(2, 5, 32, seed=13), randn(2, 32, seed=14), op="AdaLNZero")


def _diffusers_adaln_module(kind):
    """(module, args, the formula's (shift, scale, weight, bias, eps) per modulated output)"""
    from diffusers.models import normalization as dn

    torch.manual_seed(0)
    x, c = tiny_rows(randn(2, 6, 32, seed=31)), randn(2, 24, seed=32)
    if kind == "single":
        m = randomize(dn.AdaLayerNormZeroSingle(32), seed=33)
        m.linear = randomize(nn.Linear(24, 96), seed=34)
        parts = m.linear(m.silu(c)).chunk(3, dim=1)
        return m, (x, c), {0: (parts[0], parts[1], None, None, 1e-6)}
    if kind in ("continuous", "continuous_plain", "continuous_nobias"):
        affine, bias = kind != "continuous_plain", kind != "continuous_nobias"
        m = randomize(dn.AdaLayerNormContinuous(32, 24, elementwise_affine=affine, eps=1e-6 if affine else 3e-5,
                                                bias=bias), seed=35)
        scale, shift = m.linear(m.silu(c)).chunk(2, dim=1)
        w = m.norm.weight if affine else None
        b = m.norm.bias if affine and bias else None
        return m, (x, c), {None: (shift, scale, w, b, m.norm.eps)}
    assert kind == "sd35x"
    m = randomize(dn.SD35AdaLayerNormZeroX(32), seed=36)
    m.linear = randomize(nn.Linear(24, 9 * 32), seed=37)
    parts = m.linear(m.silu(c)).chunk(9, dim=1)
    return m, (x, c), {0: (parts[0], parts[1], None, None, 1e-6), 5: (parts[6], parts[7], None, None, 1e-6)}


@pytest.mark.parametrize("kind", ["single", "continuous", "continuous_plain", "continuous_nobias", "sd35x"])
def test_diffusers_adaln_family(kind):
    """AdaLayerNormZeroSingle, AdaLayerNormContinuous (LayerNorm with / without affine / bias, its
    own eps) and SD35AdaLayerNormZeroX become normexport AdaLNZero; the modulated outputs match
    the float64 formula from the module's own shift / scale, the other outputs are unchanged."""
    m, args, mods = _diffusers_adaln_module(kind)
    report = []
    new = prepare(m, report)
    assert len(swapped(report, "AdaLNZero")) == 1, report
    assert count_modules(new, nenn.AdaLNZero) == 1 and count_modules(new, nn.LayerNorm) == 0
    assert type(new) is diffusers_adaln.DIFFUSERS_ADALN[type(m).__name__][0]
    want, got = m(*args), new(*args)
    want_t = list(want) if isinstance(want, tuple) else [want]
    got_t = list(got) if isinstance(got, tuple) else [got]
    assert len(got_t) == len(want_t)
    for i, (g_, w_) in enumerate(zip(got_t, want_t)):
        key = i if i in mods else (None if None in mods and i == 0 else -1)
        if key == -1:
            torch.testing.assert_close(g_, w_, rtol=0, atol=0)  # gates etc. unchanged
            continue
        shift, scale, w, b, eps = mods[key]
        assert_close64(g_, adaln_ref(args[0], shift, scale, eps, w, b))
        assert rel_err(g_, w_) <= REL_TOL


def test_diffusers_adaln_continuous_rms_norm_is_not_adaln():
    """AdaLayerNormContinuous(norm_type="rms_norm") is no LayerNorm: not AdaLNZero; its RMSNorm is swapped."""
    from diffusers.models.normalization import AdaLayerNormContinuous

    m = randomize(AdaLayerNormContinuous(32, 24, eps=1e-6, norm_type="rms_norm"), seed=38)
    assert diffusers_adaln.recognise(m) == []
    report = []
    new = prepare(m, report)
    assert swapped(report, "AdaLNZero") == [] and [e["name"] for e in swapped(report, "RMSNorm")] == ["norm"]
    args = (randn(2, 6, 32, seed=39), randn(2, 24, seed=40))
    assert rel_err(new(*args), m(*args)) <= REL_TOL


def test_diffusers_adaln_continuous_half_precision_no_worse_than_eager():
    from diffusers.models.normalization import AdaLayerNormContinuous

    m = randomize(AdaLayerNormContinuous(48, 24, elementwise_affine=False, eps=1e-6), seed=41).half()
    new = prepare(m)
    assert count_modules(new, nenn.AdaLNZero) == 1
    x, c = randn(3, 17, 48, seed=42).half(), randn(3, 24, seed=43).half()
    scale, shift = m.linear(m.silu(c)).chunk(2, dim=1)
    ref = adaln_ref(x, shift, scale, 1e-6)
    err_new = np.abs(f64(new(x, c)) - ref).max()
    err_eager = np.abs(f64(m(x, c)) - ref).max()
    assert err_new <= err_eager * (1 + 1e-6) and err_new <= 2e-3 * np.abs(ref).max(), (err_new, err_eager)


def test_other_classes_are_not_candidates():
    """By class name and attributes only: a LayerNorm, or a look-alike without linear / silu / norm."""
    class AdaLayerNormZero(nn.Module):  # the name alone is not enough
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 24)

    assert diffusers_adaln.recognise(nn.LayerNorm(8)) == [] and diffusers_adaln.recognise(AdaLayerNormZero()) == []
