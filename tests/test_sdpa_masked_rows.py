"""A query row whose keys are all masked: torch's scaled_dot_product_attention gives 0 there,
onnxscript's translation the mean of the values (a boolean mask filled with the dtype's finite
minimum) or NaN (a float mask of -inf). exporter/sdpa.py sets those rows to 0 after torch_lib's
translation (docs/design.md §9).

Found on Flux2KleinPipeline: its Qwen3 text encoder reads an empty negative prompt, all padding
(attention_mask all 0), and its transformer attends to the whole padded text: the exported pipeline
was 33.6 dB from eager (the plain torch.onnx export too) while every component passed at the
recorded prompts. Here the real transformers Qwen3Model with that mask, converted by normexport,
against eager. Planted once (2026-11-28): the translation off (sdpa.table -> {}): the masked row
differs from eager by more than 1e-2 and the test fails.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

import normexport

transformers = pytest.importorskip("transformers")


def _encoder():
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   max_position_embeddings=64, pad_token_id=0)
    model = transformers.Qwen3Model(cfg).eval()
    model.config.use_cache = False
    return model


class _Hidden(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def _run(model, ids, mask):
    proto = normexport.convert_module(model, (ids, mask), target="onnx", input_names=["input_ids", "attention_mask"],
                                      dynamic_axes={"input_ids": [0], "attention_mask": [0]})
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]


def test_all_padding_prompt_matches_eager():
    """Row 0: a prompt of 3 tokens padded to 8; row 1: masked everywhere (the empty negative prompt: a
    chat template's tokens, its mask all 0)."""
    model = _Hidden(_encoder())
    ids = torch.tensor([[5, 6, 7, 0, 0, 0, 0, 0], [9, 10, 11, 12, 13, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0], [0] * 8])
    with torch.no_grad():
        want = model(ids, mask).numpy()
    got = _run(model, ids, mask)
    assert np.isfinite(want).all()
    assert np.abs(want[1]).max() > 0.1  # the masked row is not trivially zero (its tokens are not padding)
    err = float(np.abs(got - want).max())
    assert err < 1e-5, err
