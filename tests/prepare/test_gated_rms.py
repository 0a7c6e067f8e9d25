"""recognisers/gated_rms.py: norms called norm(hidden_states, gate) (transformers' Mamba2
MambaRMSNormGated, Qwen3-Next Qwen3NextRMSNormGated) swapped for nn.GatedRMSNorm by behaviour: the
gate before or after the norm, whole-row or per-group statistics; outputs against the float64
formulas y = rms_g(x * silu(gate)) * w and y = rms_g(x) * w * silu(gate)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from normexport.prepare import nn as nenn  # noqa: E402
from normexport.prepare.recognisers import candidates, gated_rms  # noqa: E402
from normexport.prepare.swap import prepare  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _prep import assert_close64, f64, gen, tiny_rows  # noqa: E402

torch.set_grad_enabled(False)

MambaRMSNormGated = transformers.models.mamba2.modeling_mamba2.MambaRMSNormGated
Qwen3NextRMSNormGated = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNormGated


def gated_ref(x, gate, w, eps, groups=1, norm_before_gate=False):
    """float64: gate before the norm: rms_g(x * silu(gate)) * w; after: rms_g(x) * w * silu(gate)."""
    x, w = f64(x), f64(w)
    g = f64(gate) / (1.0 + np.exp(-f64(gate)))
    if not norm_before_gate:
        x = x * g
    *lead, h = x.shape
    xg = x.reshape(*lead, groups, h // groups)
    y = (xg / np.sqrt((xg * xg).mean(-1, keepdims=True) + eps)).reshape(*lead, h) * w
    return y * g if norm_before_gate else y


class _Caller(torch.nn.Module):
    """Calls a gated norm as the library's mixers do: norm(hidden_states, gate)."""

    def __init__(self, norm, hidden):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, 2 * hidden)
        self.norm = norm

    def forward(self, x):
        h, g = self.proj(x).chunk(2, dim=-1)
        return self.norm(h, g)


def _randomize(module, seed=0):
    g = gen(seed)
    for p in module.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return module


_LIBRARY = [
    (lambda: MambaRMSNormGated(32, group_size=16, eps=1e-5), 2, False, 1e-5),
    (lambda: Qwen3NextRMSNormGated(32, eps=1e-6), 1, True, 1e-6),
]


@pytest.mark.parametrize("make, groups, before, eps", _LIBRARY)
def test_prepare_swaps_library_gated_norms(make, groups, before, eps):
    model = _randomize(_Caller(make(), 32)).eval()
    x = torch.randn(2, 5, 32, generator=gen(1)) + 0.3
    report = []
    new = prepare(model, report, example_inputs=(x,))
    assert isinstance(new.norm, nenn.GatedRMSNorm), report
    assert (new.norm.groups, new.norm.norm_before_gate) == (groups, before)
    (entry,) = [r for r in report if r["name"] == "norm"]
    assert entry["action"] == "swapped" and "gate outside" in entry["reason"], entry
    assert torch.allclose(new(x), model(x), rtol=1e-5, atol=1e-6)
    h, g = model.proj(x).chunk(2, dim=-1)
    h = tiny_rows(h)  # a row where eps matters
    assert_close64(new.norm(h, g), gated_ref(h, g, model.norm.weight, eps, groups, before))


def test_hypotheses_of_mamba2_gated_norm():
    """MambaRMSNormGated with 2 groups: gate before the norm first (its norm_before_gate is False),
    whole row and 2 groups, then the other order; the plain RMSNorm hypotheses come after."""
    m = _randomize(MambaRMSNormGated(32, group_size=16, eps=1e-5))
    reasons = [c[3] for c in gated_rms.recognise(m)]
    assert reasons == [
        "gated RMSNorm by behaviour: y = RMSNorm(x * silu(gate)) * w; RMSNorm fused, the gate outside",
        "gated RMSNorm by behaviour: y = RMSNorm(x * silu(gate)) * w over 2 groups; RMSNorm fused, the gate outside",
        "gated RMSNorm by behaviour: y = RMSNorm(x) * w * silu(gate); RMSNorm fused, the gate outside",
        "gated RMSNorm by behaviour: y = RMSNorm(x) * w * silu(gate) over 2 groups; RMSNorm fused, the gate outside",
    ]
    assert [c[3] for c in candidates(m)][:4] == reasons and len(candidates(m)) == 6  # + rms_family's 2
    x, gate = tiny_rows(torch.randn(3, 4, 32, generator=gen(2)) * 2), torch.randn(3, 4, 32, generator=gen(3))
    for (_, build, _, _), (before, groups) in zip(gated_rms.recognise(m), [(False, 1), (False, 2), (True, 1), (True, 2)]):
        assert_close64(build(torch.float32)(x, gate), gated_ref(x, gate, m.weight, 1e-5, groups, before))


def test_one_input_norms_are_not_gated_candidates():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert gated_rms.recognise(LlamaRMSNorm(16)) == []
    assert gated_rms.recognise(torch.nn.LayerNorm(16)) == []
