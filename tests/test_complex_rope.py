"""Complex rotary embeddings made real before export (normexport.prepare.rope, issue 19): a diffusers
Lumina2Transformer2DModel folder (tiny config, random weights; freqs_cis tables complex128, applied by
diffusers apply_rotary_emb(use_real=False), the mask's values read with .tolist()) converts with its
norms fused (counted from the model's structure) and onnxruntime parity vs float64; the real form is
checked against the complex arithmetic in float64; a wrong real form is refused by the swap's own
check; complex arithmetic normexport does not cover is reported, not silently exported."""

from __future__ import annotations

import json
from collections import Counter

import onnx
import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import normexport  # noqa: E402
from normexport.prepare import rope  # noqa: E402


def _lumina2():
    torch.manual_seed(0)
    return diffusers.Lumina2Transformer2DModel(
        sample_size=4, patch_size=2, in_channels=4, hidden_size=32, num_layers=1, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(32, 32, 32),
        cap_feat_dim=16).eval()


def _rms_calls(module, inputs) -> Counter:
    """Normalizations the forward runs: calls of *RMSNorm / LayerNorm modules (structure, not ONNX)."""
    calls: Counter = Counter()
    handles = []
    for m in module.modules():
        kind = "rms" if type(m).__name__.endswith("RMSNorm") else "ln" if isinstance(m, torch.nn.LayerNorm) else None
        if kind:
            handles.append(m.register_forward_hook(lambda *a, kind=kind: calls.update([kind])))
    with torch.no_grad():
        module(*inputs)
    for h in handles:
        h.remove()
    return calls


def test_lumina2_folder_converts_fused_with_parity(cli, tmp_path):
    folder = tmp_path / "lumina2"
    _lumina2().save_pretrained(folder)
    loaded = normexport.load(str(folder))
    names = loaded.input_names
    mask = loaded.example_inputs[names.index("encoder_attention_mask")]
    assert bool(mask.all()), "the forward reads the mask's values: the example is all ones"
    assert not loaded.dynamic_axes and loaded.notes and "all ones" in loaded.notes[0]
    assert rope.complex_tables(loaded.module), "the tiny model must hold complex tables (else nothing is tested)"

    out, report = tmp_path / "l.onnx", tmp_path / "l.json"
    code, stdout, err = cli("convert", folder, "-o", out, "--report", report)
    assert code == 0, (stdout, err)
    assert "PASSED" in stdout and "note: Lumina2Transformer2DModel reads encoder_attention_mask" in stdout
    rep = json.loads(report.read_text())
    swaps = [e for e in rep["prepare"] if e["op"] == "RealRoPE"]
    assert {e["action"] for e in swaps} == {"swapped"}, swaps
    assert any(e["name"].endswith("rope_embedder") for e in swaps)
    assert any(e["name"].endswith("apply_rotary_emb") for e in swaps)
    assert all(e["max_rel_err"] <= 1e-5 for e in swaps)

    # norms fused: one normexport::RMSNorm per RMSNorm call of the model's forward, the one
    # LayerNorm (norm_out: scale without shift, not an AdaLN-Zero form) kept as LayerNormalization
    calls = _rms_calls(loaded.module, loaded.example_inputs)
    ops = Counter(n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node)
    assert calls["rms"] == 19 and ops["RMSNorm"] == calls["rms"], (ops, calls)
    assert ops["AdaLNZero"] + ops["LayerNormalization"] == calls["ln"], (ops, calls)
    assert ops["ReduceMean"] == 0
    rows = [r for per in rep["results"]["ort"].values() for r in per]
    assert rows and all(r["passed"] for r in rows), rows
    assert max(r["max_abs_err"] for r in rows) < 1e-5  # onnxruntime vs the float64 reference


def test_real_form_matches_complex_arithmetic_in_float64():
    """diffusers apply_rotary_emb(use_real=False) on interleaved real freqs equals the complex
    product (float64 reference); complex freqs still go to the original function."""
    from diffusers.models import embeddings

    torch.manual_seed(1)
    x = torch.randn(2, 5, 3, 8)
    angles = torch.randn(2, 5, 4, dtype=torch.float64) * 3
    freqs = torch.polar(torch.ones_like(angles), angles)  # complex128 [B, S, D/2]
    orig = embeddings.apply_rotary_emb
    orig = getattr(orig, "_normexport_real_rope", orig)
    real = rope._replacement(orig)
    want = torch.view_as_real(torch.view_as_complex(x.double().unflatten(-1, (-1, 2))) * freqs.unsqueeze(2)).flatten(3)
    got = real(x, rope.pack(freqs), use_real=False)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert float((got.double() - want).abs().max()) < 1e-5
    assert torch.equal(real(x, freqs, use_real=False), orig(x, freqs, use_real=False))
    assert torch.equal(rope.unpack(rope.pack(freqs)).to(torch.complex64), freqs.to(torch.complex64))


def test_wrong_real_form_is_refused(monkeypatch):
    """A planted error in the real rotation (the sine's sign) is caught by the swap's own check:
    nothing swapped, the report says why, the functions are left as they were."""
    import diffusers.models.transformers.transformer_lumina2 as L

    model = _lumina2()
    loaded_args = (torch.randn(2, 4, 4, 4), torch.rand(2), torch.randn(2, 6, 16), torch.ones(2, 6, dtype=torch.bool))

    def wrong(x, freqs):
        xr, xi = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        c, s = freqs[..., 0::2], freqs[..., 1::2]
        return torch.stack([xr * c + xi * s, xr * s + xi * c], dim=-1).flatten(-2)

    monkeypatch.setattr(rope, "_rotate", wrong)
    monkeypatch.setattr(rope, "_REPLACED", {})
    before = L.apply_rotary_emb
    report: list = []
    assert rope.real_rope(model, loaded_args, report) is model
    assert report and {e["action"] for e in report} == {"skipped"}, report
    assert "rejected" in report[0]["reason"] and report[0]["max_rel_err"] > 1e-5, report
    assert L.apply_rotary_emb is before


def test_complex_in_forward_is_reported_not_covered():
    """torch.polar inside a forward (as transformers' Llama4 rotary module does) is not covered:
    reported as skipped with the reason, the module returned unchanged."""

    class Rotary(torch.nn.Module):
        def forward(self, x):
            f = torch.polar(torch.ones(x.shape[-1] // 2), torch.arange(x.shape[-1] // 2).float())
            return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * f).flatten(-2)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rot = Rotary()

        def forward(self, x):
            return self.rot(x)

    m, report = M(), []
    assert rope.real_rope(m, (torch.randn(2, 8),), report) is m
    assert [e["name"] for e in report] == ["rot"] and report[0]["action"] == "skipped"
    assert "not covered" in report[0]["reason"]
