"""The streamed float64 reference (docs/design.md §8) never upcasts a large Linear / Embedding whole: the
lm_head of an 8 B LLaMA in float64 alone is 4 GiB. It computes their float64 outputs in pieces
(Linear: output columns in slices; Embedding: rows looked up, then upcast): the same values as the
float64 copy of the model, and the model's weights stay in their dtype."""

from __future__ import annotations

import pytest
import torch


def _llama(tie: bool):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg).eval().to(torch.bfloat16)


@pytest.mark.parametrize("tie", [False, True])
def test_pieced_reference_equals_the_float64_copy(monkeypatch, tie):
    from normexport.parity import reference as R

    m = _llama(tie)
    ids = torch.randint(0, 300, (2, 7))
    copied, why = R._Float64Reference(m)((ids,))
    assert why is None
    monkeypatch.setattr(R, "FP64_COPY_LIMIT_BYTES", 0)
    # 300 x 64 lm_head and embedding over the limit (slices of 110 rows: 110, 110, 80), the
    # 96 x 64 MLP weights under it (upcast whole as before)
    monkeypatch.setattr(R, "FP64_PIECE_BYTES", 110 * 64 * 8)
    pieced = [n for n, mod in m.named_modules() if R._piecewise_forward(mod) is not None]
    assert sorted(pieced) == ["lm_head", "model.embed_tokens"]
    ref = R._Float64Reference(m)
    got, why = ref((ids,))
    assert why is None and got[0].dtype == torch.float64
    assert torch.allclose(got[0], copied[0], rtol=1e-12, atol=1e-12), (got[0] - copied[0]).abs().max()
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert not any("forward" in mod.__dict__ for mod in m.modules())  # the class forwards are back


def test_pieced_linear_with_bias_and_odd_slices(monkeypatch):
    from normexport.parity import reference as R

    torch.manual_seed(1)
    lin = torch.nn.Linear(24, 37).to(torch.float16)
    x = torch.randn(3, 5, 24, dtype=torch.float16)
    monkeypatch.setattr(R, "FP64_PIECE_BYTES", 5 * 24 * 8)  # slices of 5 output rows: 37 = 7 x 5 + 2
    fwd = R._piecewise_forward(lin)
    assert fwd is not None
    want = x.double() @ lin.weight.double().T + lin.bias.double()
    assert torch.allclose(fwd(x), want, rtol=1e-13, atol=1e-13)
