"""normexport.prepare: behaviour-checked swaps of norm modules for normexport modules, through the
driver (prepare.swap): whole models, the input left unmodified, ONNX export of the swapped modules.
Each recogniser has its own test in tests/prepare/test_<module>.py."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from torch import nn

from normexport.prepare import nn as nenn
from normexport.prepare.swap import REL_TOL, prepare, rel_err

torch.set_grad_enabled(False)


# seeded inputs, random weights and the report helpers: shared with tests/prepare/ (one test per recogniser)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "prepare"))
from _prep import check_swap, count_modules, randn, randomize, swapped  # noqa: E402,F401


# ---- whole modules ---------------------------------------------------------------------------
def _hf_llama_layer():
    """A transformers LlamaDecoderLayer (tiny config, random weights) with its rotary embedding
    computed inside forward, so it takes one tensor x [B, S, H]."""
    from transformers.models.llama.modeling_llama import LlamaConfig, LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=64, intermediate_size=172, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_hidden_layers=1, vocab_size=32, rms_norm_eps=1e-6,
                      attn_implementation="sdpa")

    class HFLlamaLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.rope = LlamaRotaryEmbedding(cfg)
            self.layer = LlamaDecoderLayer(cfg, layer_idx=0)

        def forward(self, x):
            pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            return self.layer(x, position_embeddings=self.rope(x, pos))

    torch.manual_seed(0)
    return randomize(HFLlamaLayer(), seed=5)


def test_llama_decoder_layer():
    m = _hf_llama_layer()
    x = randn(2, 9, 64, seed=6, offset=0.0)
    report = []
    new = prepare(m, report)
    assert [e["name"] for e in swapped(report, "RMSNorm")] == ["layer.input_layernorm",
                                                                "layer.post_attention_layernorm"]
    assert {e["kind"] for e in swapped(report)} == {"LlamaRMSNorm"}
    assert count_modules(new, nenn.RMSNorm) == 2
    assert rel_err(new(x), m(x)) <= REL_TOL
    assert type(m.layer.input_layernorm).__name__ == "LlamaRMSNorm"  # input not mutated


# ---- reference models --------------------------------------------------------------------------
def test_reference_llama_block():
    from normexport.models import llama

    m = llama.tiny()
    x = m.example_inputs()
    new, report = check_swap(m, *x, n=2)
    assert {e["kind"] for e in report} == {"LlamaStyleRMSNorm"}


def test_reference_models_other():
    from normexport.models import bert, conv_bn, norm_heavy

    for mod, n_rms in ((bert, 0), (conv_bn, 0), (norm_heavy, 2)):
        m = mod.tiny()
        report = []
        new = prepare(m, report)
        assert len(swapped(report, "RMSNorm")) == n_rms, report
        x = m.example_inputs()
        assert rel_err(new(*x), m(*x)) <= REL_TOL
        assert all(e["reason"] for e in report)


# ---- negatives ---------------------------------------------------------------------------------
def test_no_norm_model():
    m = randomize(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)), seed=17)
    report = []
    new = prepare(m, report)
    assert report == [] and new is not m
    x = randn(5, 8, seed=18)
    assert torch.equal(new(x), m(x))


def test_input_not_mutated_and_training_flag_kept():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    m = nn.Sequential(randomize(LlamaRMSNorm(24)), nn.Linear(24, 24)).train()
    state = {k: v.clone() for k, v in m.state_dict().items()}
    new = prepare(m)
    assert isinstance(m[0], LlamaRMSNorm) and isinstance(new[0], nenn.RMSNorm)
    assert all(torch.equal(state[k], v) for k, v in m.state_dict().items())
    assert m.training and new.training


# ---- ONNX export ---------------------------------------------------------------------------------
def _export(module, inputs, dynamic_shapes):
    import onnx

    from normexport import ops

    program = torch.onnx.export(module, inputs, dynamo=True, custom_translation_table=ops.TRANSLATION_TABLE,
                                dynamic_shapes=dynamic_shapes, verbose=False)
    model = ops.attach_functions(program.model_proto)
    onnx.checker.check_model(model, full_check=True)
    return model


def _ort_run(model, names, inputs):
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = dict(zip([i.name for i in sess.get_inputs()], [t.numpy() for t in inputs]))
    return sess.run(None, feed)[0]


@pytest.mark.parametrize("name,op", [("llama", "RMSNorm"), ("dit", "AdaLNZero")])
def test_onnx_export(name, op):
    import importlib

    from torch.export import Dim

    mod = importlib.import_module(f"normexport.models.{name}")
    m = mod.tiny()
    new = prepare(m)
    batch, seq = Dim("batch", min=1, max=64), Dim("seq", min=1, max=512)
    dyn = {"x": {0: batch, 1: seq}} | ({"c": {0: batch}} if name == "dit" else {})
    model = _export(new, m.example_inputs(), dyn)
    nodes = [n for n in model.graph.node if n.domain == "normexport"]
    assert [n.op_type for n in nodes] == [op, op]
    assert not [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    for shape in ((2, None), (3, 5)):
        x = m.example_inputs(*shape)
        y = _ort_run(model, m.input_names, x)
        want = m(*x).double().numpy()
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max() + 1e-6


def test_onnx_export_hf_llama_decoder_layer():
    from torch.export import Dim

    m = _hf_llama_layer()
    new = prepare(m)
    model = _export(new, (randn(2, 9, 64, seed=19),), {"x": {0: Dim("batch", min=1, max=64),
                                                            1: Dim("seq", min=1, max=512)}})
    assert [n.op_type for n in model.graph.node if n.domain == "normexport"] == ["RMSNorm", "RMSNorm"]
    for shape in ((2, 9), (3, 5)):
        x = randn(*shape, 64, seed=20)
        want = m(x).double().numpy()
        assert np.abs(_ort_run(model, ["x"], (x,)) - want).max() <= 1e-5 * np.abs(want).max() + 1e-6
