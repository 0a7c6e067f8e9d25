"""Gated RMSNorm (issue 22, mechanism 5): the RMSNorm part as the normexport op, the gate outside.

- nn.GatedRMSNorm against float64 numpy formulas: gate before the norm (Mamba2), norm before the
  gate (Qwen3-Next), per-group statistics, gate None.
- prepare() recognising the real transformers classes (MambaRMSNormGated with 2 groups,
  Qwen3NextRMSNormGated) is tested with the recogniser, in tests/prepare/test_gated_rms.py.
- a Mamba2ForCausalLM folder converts: every RMSNorm fused (the 2 gated ones swapped, not left to
  the rewriter), onnxruntime parity against float64 passing. Before issue 22 its gated norms were
  swapped for a one-input RMSNorm and the export died ("forward() takes 2 positional arguments").
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from normexport.prepare import nn as nenn  # noqa: E402
from _norm_counts import norm_ops  # noqa: E402


def _silu(g):
    return g / (1.0 + np.exp(-g))


def _rms(x, eps, groups):
    *lead, h = x.shape
    xg = x.reshape(*lead, groups, h // groups)
    y = xg / np.sqrt((xg * xg).mean(-1, keepdims=True) + eps)
    return y.reshape(*lead, h)


def _reference(x, gate, w, eps, groups, norm_before_gate):
    x, w = x.astype(np.float64), w.astype(np.float64)
    g = None if gate is None else _silu(gate.astype(np.float64))
    if g is not None and not norm_before_gate:
        x = x * g
    y = _rms(x, eps, groups) * w
    if g is not None and norm_before_gate:
        y = y * g
    return y


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("with_gate", [True, False])
def test_gated_rmsnorm_matches_float64_formula(groups, norm_before_gate, with_gate):
    gen = torch.Generator().manual_seed(groups + 2 * norm_before_gate)
    h, eps = 32, 1e-5
    w = torch.randn(h, generator=gen) * 0.5 + 1.0
    x = torch.randn(2, 7, h, generator=gen) * 2.0 + 0.4
    x[0, 0] *= 1e-3  # a row where epsilon matters
    gate = torch.randn(2, 7, h, generator=gen) * 1.5 if with_gate else None
    mod = nenn.GatedRMSNorm(w, eps, groups=groups, norm_before_gate=norm_before_gate)
    got = mod(x, gate).double().numpy()
    ref = _reference(x.numpy(), None if gate is None else gate.numpy(), w.numpy(), eps, groups, norm_before_gate)
    err = np.abs(got - ref).max()
    assert err <= 1e-5 * np.abs(ref).max() + 1e-6, err
    if with_gate:  # the other gate position is a different function (the test can tell them apart)
        other = _reference(x.numpy(), gate.numpy(), w.numpy(), eps, groups, not norm_before_gate)
        assert np.abs(other - ref).max() > 100 * (1e-5 * np.abs(ref).max() + 1e-6)


def _norm_calls(model, inputs) -> int:
    """RMSNorm-type module calls in a forward of the model (its own structure)."""
    n = Counter()
    hooks = [m.register_forward_hook(lambda *a: n.update(["rms"])) for m in model.modules()
             if type(m).__name__.endswith(("RMSNorm", "RMSNormGated"))]
    with torch.no_grad():
        model(*inputs)
    for h in hooks:
        h.remove()
    return n["rms"]


def test_mamba2_folder_converts_with_gated_norms_fused(cli, tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=8, expand=2,
                                    head_dim=8, num_heads=8, n_groups=2, chunk_size=256, conv_kernel=4)  # real chunk size
    model = transformers.Mamba2ForCausalLM(cfg).eval()
    _randomize_norms(model)
    folder = tmp_path / "mamba2"
    model.save_pretrained(folder)
    out = tmp_path / "m.onnx"
    code, stdout, err = cli("convert", folder, "-o", out, "--task", "text-generation", "--report", tmp_path / "r.json")
    assert code == 0, (stdout, err)
    rep = json.loads((tmp_path / "r.json").read_text())
    gated = [r for r in rep["prepare"] if r.get("kind") == "MambaRMSNormGated"]
    assert len(gated) == 1 and all(r["action"] == "swapped" for r in gated), gated
    assert "1 MambaRMSNormGated -> RMSNorm" in stdout, stdout
    ops = norm_ops(out)  # a fused residual norm (SkipRMSNorm) counted as its norm
    expected = _norm_calls(model, (torch.randint(0, 64, (2, 8)),))
    assert expected == 3 and ops["RMSNorm"] == expected, ops  # layer norm + gated norm + norm_f
    assert ops["ReduceMean"] == 0, ops
    rows = [row for per in rep["results"]["ort"].values() for row in per]
    assert rows and all(row["passed"] for row in rows), rows


def _randomize_norms(model):
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith(("RMSNorm", "RMSNormGated")):
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
