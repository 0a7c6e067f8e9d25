"""Swaps that cannot break a model (issue 22, mechanism 5).

A norm module is swapped only when the replacement takes every call the model makes (the call
forms seen in one forward, captured with hooks; without example inputs: as many positional inputs)
and its outputs match on random input and on the inputs its class receives in that forward. Else
it is left to the ONNX rewriter and the terminal says why, one line per class with the count.

Real library classes: transformers' MambaRMSNormGated (called norm(hidden_states, gate)), with the
gated hypothesis disabled, is what issue 22 hit: it passes the one-input RMSNorm check on random
input, and the swap broke the export ("forward() takes 2 positional arguments but 3 were given").
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from normexport.prepare import nn as nenn  # noqa: E402
from normexport.prepare import swap  # noqa: E402
from normexport.prepare.recognisers import gated_rms  # noqa: E402

MambaRMSNormGated = transformers.models.mamba2.modeling_mamba2.MambaRMSNormGated
LlamaRMSNorm = transformers.models.llama.modeling_llama.LlamaRMSNorm


class _Mixer(torch.nn.Module):
    """A Mamba2-style mixer: the gated norm called with the gate, a plain norm after it."""

    def __init__(self, hidden=32, groups=1):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, 2 * hidden)
        self.norm = MambaRMSNormGated(hidden, group_size=hidden // groups, eps=1e-5)
        self.out_norm = LlamaRMSNorm(hidden, eps=1e-6)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + (1.0 if p.dim() == 1 else 0.0))

    def forward(self, x):
        h, g = self.proj(x).chunk(2, dim=-1)
        return self.out_norm(self.norm(h, g))


def _x(seed=1, shape=(2, 5, 32)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) + 0.3


def test_two_input_norm_not_swapped_for_one_input_rmsnorm(monkeypatch):
    monkeypatch.setattr(gated_rms, "recognise", lambda m: [])  # only the one-input hypotheses remain
    model, x = _Mixer().eval(), _x()
    report: list = []
    new = swap.prepare(model, report, example_inputs=(x,))
    assert isinstance(new.norm, MambaRMSNormGated)  # left alone
    assert isinstance(new.out_norm, nenn.RMSNorm)  # the one-input norm is still swapped
    (entry,) = [r for r in report if r["name"] == "norm"]
    assert entry["action"] == "skipped" and "called as forward(2x5x32, 2x5x32)" in entry["reason"], entry
    with torch.no_grad():
        assert torch.allclose(new(x), model(x), rtol=1e-5, atol=1e-6)  # the model still runs, unchanged
    lines = swap.summary_lines(report)
    assert lines[0] == "  swapped: 1 LlamaRMSNorm -> RMSNorm", lines
    assert lines[1].startswith("  not swapped, left to the rewriter: 1 MambaRMSNormGated: behaviour differs from "
                               "every hypothesis: RMSNorm by behaviour: y = x / rms(x) * weight: signature: called as "
                               "forward(2x5x32, 2x5x32)"), lines


def test_without_example_inputs_the_signature_decides(monkeypatch):
    monkeypatch.setattr(gated_rms, "recognise", lambda m: [])
    report: list = []
    new = swap.prepare(_Mixer().eval(), report)
    assert isinstance(new.norm, MambaRMSNormGated)
    (entry,) = [r for r in report if r["name"] == "norm"]
    assert "forward(hidden_states, gate) takes 2 inputs, RMSNorm.forward(x) 1" in entry["reason"], entry


def test_inputs_from_the_forward_decide_where_random_input_cannot(monkeypatch):
    """Random check inputs that happen to be blind to the group structure (each group of channels
    with the same RMS) accept per-row statistics for MambaRMSNormGated with 2 groups; the inputs
    the norm receives in the model's forward reject them, and the per-group hypothesis is taken."""
    rand = gated_rms.rand

    def blind(shape, seed, offset=0.0):
        half = rand(shape[:-1] + (shape[-1] // 2,), seed, offset)
        return torch.cat([half, half.flip(-1)], dim=-1)  # both halves: the same mean square

    monkeypatch.setattr(gated_rms, "rand", blind)  # the gated hypotheses' check inputs
    model, x = _Mixer(groups=2).eval(), _x(2)
    report: list = []
    new = swap.prepare(model, report, example_inputs=(x,))
    assert isinstance(new.norm, nenn.GatedRMSNorm) and new.norm.groups == 2, report
    (entry,) = [r for r in report if r["name"] == "norm"]
    assert "checked on random input and on its 1 call form(s) in the example forward" in entry["reason"], entry
    with torch.no_grad():
        assert torch.allclose(new(x), model(x), rtol=1e-5, atol=1e-6)


def test_calls_without_the_gate_are_checked_too():
    """The same class called with and without its gate in one forward: both call forms captured,
    both bind to and match the replacement."""

    class Both(_Mixer):
        def forward(self, x):
            h, g = self.proj(x).chunk(2, dim=-1)
            return self.norm(h, g) + self.norm(h)

    model, x = Both().eval(), _x(3)
    report: list = []
    new = swap.prepare(model, report, example_inputs=(x,))
    (entry,) = [r for r in report if r["name"] == "norm"]
    assert entry["action"] == "swapped" and "its 2 call form(s)" in entry["reason"], entry
    with torch.no_grad():
        assert torch.allclose(new(x), model(x), rtol=1e-5, atol=1e-6)


def test_a_model_that_does_not_run_is_said_and_checked_on_signatures():
    report: list = []
    new = swap.prepare(_Mixer().eval(), report, example_inputs=(torch.zeros(2, 5, 7),))  # wrong width
    assert isinstance(new.norm, nenn.GatedRMSNorm)  # random input + signature still decide
    (note,) = [r for r in report if r["action"] == "note"]
    assert "did not run on the example inputs" in note["reason"]
    assert any(line.startswith("  note: the model did not run") for line in swap.summary_lines(report))
