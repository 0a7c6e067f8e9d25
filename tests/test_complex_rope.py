"""Complex rotary embeddings carried as real pairs before export (normexport.prepare.complex, issues
19 and 22), on folders of real library classes (tiny configs, random weights), through `normexport
convert`: each converts with its norms fused (counted from the model's own modules), no complex type
in the file, and onnxruntime parity against the float64 reference.

- diffusers Lumina2Transformer2DModel: complex128 tables stored on the rotary module (a list, plain
  attribute), gathered per position, applied by diffusers apply_rotary_emb(use_real=False);
- transformers Llama4ForCausalLM: torch.polar inside the rotary module's forward, view_as_complex of
  q / k, complex product, view_as_real(...).flatten(3); its weightless L2 norm on q / k fused as an
  RMSNorm by the rewriter.

Without the lowering (tests/test_complex_lowering.py plants it out) neither exports."""

from __future__ import annotations

import json
from collections import Counter

import onnx
import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import normexport  # noqa: E402
from normexport.prepare import complex as cx  # noqa: E402
from _norm_counts import norm_ops  # noqa: E402


def _lumina2():
    torch.manual_seed(0)
    return diffusers.Lumina2Transformer2DModel(
        sample_size=4, patch_size=2, in_channels=4, hidden_size=32, num_layers=1, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(32, 32, 32),
        cap_feat_dim=16).eval()


def _lowering(rep) -> dict:
    entries = [e for e in rep["prepare"] if e.get("lowering") == "complex"]
    assert len(entries) == 1, rep["prepare"]
    return entries[0]


def _assert_lowered(rep, stdout, kind):
    e = _lowering(rep)
    assert e["action"] == "swapped" and e["op"] == "ComplexAsReal" and e["max_rel_err"] <= 1e-5, e
    assert e["kind"] == kind and "view_as_complex" in e["reason"] and "view_as_real" in e["reason"], e
    assert f"complex values carried as real (re, im) pairs: {kind} (" in stdout, stdout


def _assert_no_complex(path):
    m = onnx.load(str(path), load_external_data=False)
    types = [v.type.tensor_type.elem_type for v in list(m.graph.value_info) + list(m.graph.input) + list(m.graph.output)]
    types += [t.data_type for t in m.graph.initializer]
    assert not {onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128} & set(types)


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
    assert cx.complex_tables(loaded.module), "the tiny model must hold complex tables (else nothing is tested)"

    out, report = tmp_path / "l.onnx", tmp_path / "l.json"
    code, stdout, err = cli("convert", folder, "-o", out, "--report", report)
    assert code == 0, (stdout, err)
    assert "PASSED" in stdout and "note: Lumina2Transformer2DModel reads encoder_attention_mask" in stdout
    rep = json.loads(report.read_text())
    _assert_lowered(rep, stdout, "Lumina2Transformer2DModel")
    assert "rope_embedder.freqs_cis: list of 3" in _lowering(rep)["reason"]
    _assert_no_complex(out)

    # norms fused: one normexport::RMSNorm per RMSNorm call of the model's forward, the one
    # LayerNorm (norm_out: scale without shift, not an AdaLN-Zero form) kept as LayerNormalization
    calls = _rms_calls(loaded.module, loaded.example_inputs)
    ops = norm_ops(out)  # a fused residual norm (SkipRMSNorm) counted as its norm
    assert calls["rms"] == 19 and ops["RMSNorm"] == calls["rms"], (ops, calls)
    assert ops["AdaLNZero"] + ops["LayerNormalization"] == calls["ln"], (ops, calls)
    assert ops["ReduceMean"] == 0
    rows = [r for per in rep["results"]["ort"].values() for r in per]
    assert rows and all(r["passed"] for r in rows), rows
    assert max(r["max_abs_err"] for r in rows) < 1e-5  # onnxruntime vs the float64 reference


def test_llama4_text_folder_converts_fused_with_parity(cli, tmp_path):
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    cfg = Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
                           max_position_embeddings=64, attention_chunk_size=16)
    folder = tmp_path / "llama4"
    Llama4ForCausalLM(cfg).eval().save_pretrained(folder)
    out, report = tmp_path / "l4.onnx", tmp_path / "l4.json"
    code, stdout, err = cli("convert", folder, "--task", "text-generation", "-o", out, "--report", report)
    assert code == 0, (stdout, err)
    rep = json.loads(report.read_text())
    _assert_lowered(rep, stdout, "Llama4ForCausalLM")
    assert "polar x1" in _lowering(rep)["reason"]
    _assert_no_complex(out)

    # norms: every RMSNorm call of the forward, the weightless L2 norms on q / k included
    loaded = normexport.load(str(folder))
    calls: Counter = Counter()
    hooks = [m.register_forward_hook(lambda *a, n=type(m).__name__: calls.update([n]))
             for m in loaded.module.modules() if type(m).__name__ in ("Llama4TextRMSNorm", "Llama4TextL2Norm")]
    with torch.no_grad():
        loaded.module(*loaded.example_inputs)
    for h in hooks:
        h.remove()
    assert calls["Llama4TextL2Norm"] > 0, calls
    ops = norm_ops(out)  # a fused residual norm (SkipRMSNorm) counted as its norm
    assert ops["RMSNorm"] == sum(calls.values()), (ops, calls)
    assert "PASSED" in stdout
    rows = [r for per in rep["results"]["ort"].values() for r in per]
    assert rows and all(r["passed"] for r in rows), rows
