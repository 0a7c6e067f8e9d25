"""MoE experts and attention switched to implementations the exporters take (issue 22, mechanism 4).

- A Qwen3-MoE folder (transformers' default experts implementation "grouped_mm": the custom op
  transformers::grouped_mm_fallback under torch.export, which no exporter translates; both
  exporters failed on it) converts: experts switched to "batched_mm" through transformers' own
  setter, said on the terminal, every RMSNorm fused, onnxruntime parity against float64 passing;
  `check` of the file against the folder switches its reference too (else no float64 reference).
- Attention set to flex_attention (no exporter takes it on CPU: "FlexAttention does not support
  backward on CPU") is switched to sdpa and the model exports with the dynamo exporter.
- The switch is checked against transformers' eager implementations (reference loops / attention
  math; flex_attention itself is off by 0.1 on CPU here): a switch that changes the outputs is
  reverted and reported; inplace=False leaves the caller's model alone.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from normexport.export import convert_module_ir  # noqa: E402
from normexport.prepare.implementations import exportable_implementations, summary_lines  # noqa: E402
from _norm_counts import norm_ops  # noqa: E402


def _qwen3_moe():
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, moe_intermediate_size=16, num_experts=4,
                                      num_experts_per_tok=2, decoder_sparse_step=1)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
    return model


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids, use_cache=False).logits


def test_qwen3_moe_folder_converts_with_batched_experts(cli, tmp_path):
    model = _qwen3_moe()
    assert model.config._experts_implementation == "grouped_mm"  # transformers' default: not exportable
    folder = tmp_path / "qwen3moe"
    model.save_pretrained(folder)
    out = tmp_path / "m.onnx"
    code, stdout, err = cli("convert", folder, "-o", out, "--task", "text-generation", "--report", tmp_path / "r.json")
    assert code == 0, (stdout, err)
    assert "experts: Qwen3MoeForCausalLM grouped_mm -> batched_mm for export" in stdout, stdout
    rep = json.loads((tmp_path / "r.json").read_text())
    (sw,) = rep["implementations"]
    assert (sw["what"], sw["from"], sw["to"], sw["action"]) == ("experts", "grouped_mm", "batched_mm", "switched")
    assert sw["max_rel_err"] <= 1e-5, sw  # vs the model on transformers' eager experts loop
    ops = norm_ops(out)  # a fused residual norm (SkipRMSNorm) counted as its norm
    # 1 layer: input / post-attention norms, q_norm, k_norm; final norm
    assert ops["RMSNorm"] == 5 and ops["ReduceMean"] == 0, ops
    rows = [row for per in rep["results"]["ort"].values() for row in per]
    assert len(rows) >= 2 and all(row["passed"] for row in rows), rows  # dynamic batch / sequence kept
    # `check` switches the reference the same way: a float64 reference exists (grouped_mm has no float64 kernel)
    code, stdout, err = cli("check", out, "--reference", folder)
    assert code == 0, (stdout, err)
    assert "experts: Qwen3MoeForCausalLM grouped_mm -> batched_mm" in stdout and "no float64 reference" not in stdout
    # passed against that float64 reference, by either legitimate rule (which one decides varies by machine)
    assert re.search(r"(2x eager|plain export) +PASS", stdout), stdout


def test_flex_attention_switched_to_sdpa_exports():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).eval()
    model.set_attn_implementation("flex_attention")
    wrapper = _Logits(model).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    report: list = []
    switched = exportable_implementations(wrapper, (ids,), report, inplace=False)
    assert switched is not wrapper and model.config._attn_implementation == "flex_attention"  # caller's untouched
    assert switched.model.config._attn_implementation == "sdpa"
    (entry,) = report
    assert (entry["what"], entry["from"], entry["to"], entry["action"]) == \
        ("attention", "flex_attention", "sdpa", "switched") and entry["max_rel_err"] <= 1e-5, entry
    assert summary_lines(report) == [
        f"  attention: LlamaForCausalLM flex_attention -> sdpa for export (flex_attention runs kernels no exporter "
        f"translates; equal to transformers' eager to {entry['max_rel_err']:.2g} of max|output|)"]
    sections: dict = {}
    onnx_model = convert_module_ir(switched, (ids,), input_names=["input_ids"], output_names=["logits"],
                                   report=sections, rewrite=False)
    assert sections["exporter"]["name"] == "dynamo"
    import onnx_ir as ir
    import onnxruntime as ort

    sess = ort.InferenceSession(ir.serde.serialize_model(onnx_model).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    got = torch.from_numpy(sess.run(None, {"input_ids": ids.numpy()})[0])
    with torch.no_grad():
        want = switched(ids)  # sdpa, checked against eager attention by the switch
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()


def test_switch_reverted_when_outputs_move(monkeypatch):
    """A switch that changes what the model computes is undone and reported (here transformers'
    batched_mm planted to drop the routing weights)."""
    from transformers.integrations import moe

    model = _Logits(_qwen3_moe()).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))

    def wrong(self, hidden_states, top_k_index, top_k_weights):
        return moe.batched_mm_experts_forward(self, hidden_states, top_k_index, torch.ones_like(top_k_weights))

    monkeypatch.setitem(moe.ALL_EXPERTS_FUNCTIONS._global_mapping, "batched_mm", wrong)
    report: list = []
    exportable_implementations(model, (ids,), report)
    (entry,) = report
    assert entry["action"] == "reverted" and "outputs differ from transformers' eager" in entry["reason"], entry
    assert model.model.config._experts_implementation == "grouped_mm"
