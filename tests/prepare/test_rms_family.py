"""recognisers/rms_family.py: modules with a 1-D weight (or none) + eps tried as y = x / rms(x) * w
and Gemma's y = x / rms(x) * (1 + w) (HF LlamaRMSNorm, Qwen2, Mistral, T5LayerNorm, GemmaRMSNorm,
diffusers RMSNorm with / without affine / bias); outputs against the float64 formulas."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from torch import nn

from normexport.prepare import nn as nenn
from normexport.prepare.recognisers import rms_family
from normexport.prepare.swap import REL_TOL, prepare

sys.path.insert(0, os.path.dirname(__file__))
from _prep import assert_close64, check_swap, f64, randn, randomize, rms_ref, swapped, tiny_rows  # noqa: E402

torch.set_grad_enabled(False)


def _hf_norms():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    return {"llama": LlamaRMSNorm, "qwen2": Qwen2RMSNorm, "mistral": MistralRMSNorm, "t5": T5LayerNorm,
            "gemma": GemmaRMSNorm}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "t5", "gemma"])
@pytest.mark.parametrize("hidden", [64, 37])
def test_hf_rmsnorm(kind, hidden):
    m = randomize(_hf_norms()[kind](hidden, eps=1e-5), seed=hidden)
    x = tiny_rows(randn(2, 7, hidden, seed=1))
    new, report = check_swap(m, x)
    assert_close64(new(x), rms_ref(x, m.weight, 1e-5, gemma=kind == "gemma"))
    assert ("Gemma" in report[0]["reason"]) == (kind == "gemma")
    assert report[0]["kind"] == type(m).__name__


def test_hypotheses_against_the_formulas():
    """The two builders of a weight + eps module: plain w and Gemma's (1 + w), each equal to its
    float64 formula (eps 1e-2 and a tiny row, so a wrong eps shows)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    m = randomize(LlamaRMSNorm(24, eps=1e-2), seed=4)
    cands = rms_family.recognise(m)
    assert [c[0] for c in cands] == ["RMSNorm", "RMSNorm"] and "Gemma" in cands[1][3]
    x = tiny_rows(randn(3, 5, 24, seed=5), 1e-2)
    for (_, build, inputs, _), gemma in zip(cands, (False, True)):
        assert_close64(build(torch.float32)(x), rms_ref(x, m.weight, 1e-2, gemma=gemma))
        assert inputs()[0].shape[-1] == 24


def test_not_candidates():
    class NoEps(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))

    class Matrix(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(8, 8)), 1e-6

    assert rms_family.recognise(NoEps()) == [] and rms_family.recognise(Matrix()) == []


def _rms_module(kind, hidden):
    if kind == "torch":
        return nn.RMSNorm(hidden, eps=1e-6)
    if kind == "diffusers":
        from diffusers.models.normalization import RMSNorm

        return RMSNorm(hidden, eps=1e-6)
    return _hf_norms()[kind](hidden, eps=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "t5", "gemma", "torch", "diffusers"])
def test_half_precision_no_worse_than_eager(kind, dtype):
    hidden = 37
    m = _rms_module(kind, hidden)
    m = randomize(m, seed=3).to(dtype)
    new = prepare(m)
    assert all(p.dtype == dtype for p in new.parameters()) or kind == "gemma"  # Gemma keeps 1 + w in fp32
    if kind == "gemma":
        assert isinstance(new, rms_family.UpcastRMSNorm)
    x = randn(256, hidden, seed=4).to(dtype)
    ref = rms_ref(x, m.weight, 1e-6, gemma=kind == "gemma")
    y_new, y_eager = new(x), m(x)
    assert y_new.dtype == y_eager.dtype == dtype
    err_new = np.abs(f64(y_new) - ref).max()
    err_eager = np.abs(f64(y_eager) - ref).max()
    assert err_new <= err_eager * (1 + 1e-6), (err_new, err_eager)
    assert err_new <= {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype] * np.abs(ref).max()


@pytest.mark.parametrize("affine,bias", [(True, False), (False, False), (True, True)])
def test_diffusers_rmsnorm(affine, bias):
    from diffusers.models.normalization import RMSNorm

    m = randomize(RMSNorm(48, eps=1e-6, elementwise_affine=affine, bias=bias), seed=7)
    x = tiny_rows(randn(2, 5, 48, seed=8))
    new, _ = check_swap(m, x)
    assert isinstance(new, rms_family.RMSNormWithBias if bias else nenn.RMSNorm)
    w = m.weight if affine else torch.ones(48)
    assert_close64(new(x), rms_ref(x, w, 1e-6, bias=m.bias if bias else None))


def test_diffusers_rmsnorm_of_unknown_size_is_left_to_the_rewriter():
    """diffusers RMSNorm(0, eps, elementwise_affine=False) (Mochi's modulated norms): no size to
    build a scale from; skipped with the reason, not swapped with an empty scale."""
    from diffusers.models.normalization import RMSNorm

    m = RMSNorm(0, eps=1e-6, elementwise_affine=False)
    report = []
    new = prepare(nn.Sequential(m), report)
    assert new[0].__class__ is RMSNorm and not swapped(report)
    assert "normalized size is unknown" in report[0]["reason"], report


# ---- negatives ---------------------------------------------------------------------------------
class FakeRMSNorm(nn.Module):
    """Named and shaped like an RMSNorm but subtracts the mean: not an RMSNorm."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class ScaleNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.tensor(1.7))

    def forward(self, x):
        return self.g * x / x.norm(dim=-1, keepdim=True).clamp_min(1e-5)


def test_fake_norm_is_skipped():
    m = nn.Sequential(nn.Linear(16, 16), FakeRMSNorm(16), ScaleNorm())
    randomize(m, seed=15)
    report = []
    new = prepare(m, report)
    assert not swapped(report)
    by_name = {e["name"]: e for e in report}
    assert by_name["1"]["action"] == "skipped" and by_name["1"]["kind"] == "FakeRMSNorm"
    assert "rel err" in by_name["1"]["reason"] and by_name["1"]["max_rel_err"] > REL_TOL
    assert by_name["2"]["action"] == "skipped" and by_name["2"]["reason"]
    x = randn(3, 16, seed=16)
    torch.testing.assert_close(new(x), m(x), rtol=0, atol=0)
