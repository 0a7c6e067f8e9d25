"""recognisers/torch_rms_norm.py: torch.nn.RMSNorm -> normexport RMSNorm (any normalized_shape
rank, eps None = finfo(dtype).eps, no affine = ones), against y = x / sqrt(mean(x²) + eps) * w in
float64."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

from normexport.prepare import nn as nenn
from normexport.prepare.recognisers import candidates, torch_rms_norm

sys.path.insert(0, os.path.dirname(__file__))
from _prep import assert_close64, check_swap, randn, randomize, rms_ref, tiny_rows  # noqa: E402

torch.set_grad_enabled(False)


@pytest.mark.parametrize("shape", [(64,), (37,), (5, 12)])
@pytest.mark.parametrize("eps", [1e-3, 1e-6, None])
def test_torch_rmsnorm(shape, eps):
    m = randomize(nn.RMSNorm(shape, eps=eps))
    x = tiny_rows(randn(3, 4, *shape))
    new, report = check_swap(m, x)
    assert isinstance(new, nenn.RMSNorm) and new.axis == -len(shape)
    assert report[0]["reason"] == f"torch.nn.RMSNorm over {len(shape)} dim(s)"
    want = rms_ref(x, m.weight, torch.finfo(torch.float32).eps if eps is None else eps, dims=len(shape))
    assert_close64(new(x), want)


def test_torch_rmsnorm_no_affine():
    m = nn.RMSNorm(40, eps=1e-5, elementwise_affine=False)
    x = tiny_rows(randn(2, 40))
    new, _ = check_swap(m, x)
    assert torch.equal(new.weight, torch.ones(40))
    assert_close64(new(x), rms_ref(x, torch.ones(40), 1e-5))


def test_eps_none_follows_the_dtype():
    """eps None: torch uses finfo(input dtype).eps; the half-precision replacement keeps that."""
    m = randomize(nn.RMSNorm(16, eps=None)).half()
    ((op, build, _, _),) = torch_rms_norm.recognise(m)
    assert op == "RMSNorm" and build(torch.float16).eps == torch.finfo(torch.float16).eps


def test_only_torch_rmsnorm_and_final():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert torch_rms_norm.recognise(LlamaRMSNorm(8)) == [] and torch_rms_norm.recognise(nn.LayerNorm(8)) == []
    # FINAL: the weight + eps hypotheses of rms_family are not asked for a torch.nn.RMSNorm
    assert [c[3] for c in candidates(nn.RMSNorm(8, eps=1e-6))] == ["torch.nn.RMSNorm over 1 dim(s)"]
