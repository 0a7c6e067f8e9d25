"""normexport.llm.weight_plan (issue 47 item 2): the exported file's large tensors predicted from the
eager model, on real transformers classes (tiny configs, random weights): grouped-query attention with
separate q / k / v (LLaMA), biases and a tied embedding (Qwen2), fused qkv / gate_up projections (Phi-3).
Whether a prediction is a real file's is proven where it is used: tests/test_prewrite.py converts with
it (the file taken, eager's numbers, every byte of the data file an initializer's); here, what it
predicts and that it reads the weights in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from normexport.llm import weight_plan  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def _plan(cls, config_cls, **extra):
    torch.manual_seed(0)
    model = cls(config_cls(**COMMON, **extra)).eval()
    with weight_plan.observe(model) as calls, torch.no_grad():
        model(torch.randint(0, 96, (2, 5)))
    return model, {e.name: e for e in weight_plan.predict(model, calls, min_bytes=0)}


def _t(w: torch.Tensor) -> np.ndarray:
    return w.detach().numpy().T


def _same_memory(entry, *arrays) -> bool:
    """The entry reads these arrays in place: same address, shape and strides, nothing copied."""
    want = tuple((a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.itemsize) for a in arrays)
    return entry.key == want


def test_llama_groups_siblings_by_input_and_transposes_linears():
    model, plan = _plan(transformers.LlamaForCausalLM, transformers.LlamaConfig, tie_word_embeddings=False)
    for i, layer in enumerate(model.model.layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        qkv = plan[f"{a}.q_proj+{a}.k_proj+{a}.v_proj"]  # one input, call order: packed as the file packs them
        assert _same_memory(qkv, _t(layer.self_attn.q_proj.weight), _t(layer.self_attn.k_proj.weight),
                            _t(layer.self_attn.v_proj.weight))
        assert qkv.nbytes == (32 * 32 + 2 * 32 * 16) * 4
        assert _same_memory(plan[f"{m}.gate_proj+{m}.up_proj"], _t(layer.mlp.gate_proj.weight), _t(layer.mlp.up_proj.weight))
        assert _same_memory(plan[f"{a}.o_proj"], _t(layer.self_attn.o_proj.weight))
        assert _same_memory(plan[f"{m}.down_proj"], _t(layer.mlp.down_proj.weight))
        assert f"model.layers.{i}.input_layernorm.weight" in plan  # itself (min_bytes 0 here)
    assert _same_memory(plan["lm_head"], _t(model.lm_head.weight))
    assert _same_memory(plan["model.embed_tokens.weight"], model.model.embed_tokens.weight.detach().numpy())
    assert len(plan) == 2 * (4 + 2) + 1 + 2  # per layer 4 MatMuls + 2 norms; the final norm, embedding, lm_head
    # the bytes the entries stand for are the weights' (the writer's view of them)
    e = plan["model.layers.0.self_attn.q_proj+model.layers.0.self_attn.k_proj+model.layers.0.self_attn.v_proj"]
    got = np.concatenate(e.parts, axis=1).view(np.float32)
    attn = model.model.layers[0].self_attn
    want = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).T.detach().numpy()
    assert np.array_equal(got, want)
    # below the size limit nothing is planned (appended when the file is written)
    assert not weight_plan.predict(model, weight_plan.Calls(), min_bytes=1 << 20)


def test_qwen2_tied_embedding_planned_both_ways_and_biases_as_themselves():
    model, plan = _plan(transformers.Qwen2ForCausalLM, transformers.Qwen2Config, tie_word_embeddings=True)
    emb = model.model.embed_tokens.weight
    assert model.lm_head.weight is emb
    assert _same_memory(plan["lm_head"], _t(emb))  # the MatMul's [hidden, vocab]
    assert _same_memory(plan["model.embed_tokens.weight"], emb.detach().numpy())  # the Gather's own
    bias = model.model.layers[0].self_attn.q_proj.bias
    assert _same_memory(plan["model.layers.0.self_attn.q_proj.bias"], bias.detach().numpy())
    assert "model.layers.0.self_attn.q_proj+model.layers.0.self_attn.k_proj+model.layers.0.self_attn.v_proj" in plan


def test_phi3_fused_projections():
    model, plan = _plan(transformers.Phi3ForCausalLM, transformers.Phi3Config, pad_token_id=0)
    layer = model.model.layers[0]
    assert _same_memory(plan["model.layers.0.self_attn.qkv_proj"], _t(layer.self_attn.qkv_proj.weight))
    assert _same_memory(plan["model.layers.0.mlp.gate_up_proj"], _t(layer.mlp.gate_up_proj.weight))


def test_linears_called_twice_are_not_grouped_and_modules_not_run_not_planned():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, tie_word_embeddings=False)).eval()
    with weight_plan.observe(model) as calls, torch.no_grad():
        for _ in range(2):  # each Linear's input not one value: MatMuls of their own
            model(torch.randint(0, 96, (1, 3)))
    plan = {e.name: e for e in weight_plan.predict(model, calls, min_bytes=0)}
    assert not [n for n in plan if "+" in n] and _same_memory(
        plan["model.layers.0.self_attn.k_proj"], _t(model.model.layers[0].self_attn.k_proj.weight))
    with weight_plan.observe(model) as calls, torch.no_grad():
        model.model.embed_tokens(torch.randint(0, 96, (1, 3)))  # only the embedding ran
    assert [e.name for e in weight_plan.predict(model, calls, min_bytes=0)] == ["model.embed_tokens.weight"]


def test_a_scripted_module_is_observed_as_nothing():
    scripted = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with weight_plan.observe(scripted) as calls:
        scripted(torch.randn(1, 4))
    assert calls.order == []
