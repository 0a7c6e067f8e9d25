"""The parity check's inputs at other shapes keep a padding mask a padding mask (parity/shapes.py,
_runs_like): every row a run of ones then zeros (or zeros then ones), 1..n ones, as the recorded mask
had. Random 0/1 values made rows that mask every key a query may see (a causal text encoder's first
query with its first key masked): eager and onnxruntime legitimately differ there (Z-Image's Qwen3
text encoder: 1.92 against float64 at batch 3, on the plain export too), so the check accepted such
rows by the plain-export rule and could not see a real error in them.

Planted and seen failing: _runs_like returning None (the random masks again): the Qwen3 encoder's check
by the 2x-eager rule alone fails (max error ~1 where eager's own is ~1e-6)."""

from __future__ import annotations

import pytest
import torch

from normexport.parity.shapes import _inputs_like


def _rows(t):
    return t.reshape(-1, t.shape[-1]).to(torch.int64)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_masks_keep_their_runs(dtype, side):
    given = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    given = (given if side == "right" else given.flip(-1)).to(dtype)
    for seed in range(5):
        got = _inputs_like([given], {"m": [4, 9]}, ["m"], seed)[0]
        assert got.shape == (4, 9) and got.dtype == dtype
        rows = _rows(got)
        counts = rows.sum(-1)
        assert bool((counts >= 1).all()), rows  # no row masks every key
        steps = rows[:, 1:] - rows[:, :-1]
        assert bool((steps <= 0).all() if side == "right" else (steps >= 0).all()), rows


def test_other_integers_stay_random():
    scattered = torch.tensor([[1, 0, 1, 0, 0], [1, 1, 0, 0, 1]])
    got = _inputs_like([scattered], {"m": [8, 16]}, ["m"], 0)[0]
    steps = _rows(got)[:, 1:] - _rows(got)[:, :-1]
    assert bool((steps > 0).any()) and bool((steps < 0).any())  # not runs: random 0/1 as before
    ones = torch.ones(2, 5, dtype=torch.int64)  # a mask of all ones stays all ones
    assert bool((_inputs_like([ones], {"m": [3, 7]}, ["m"], 0)[0] == 1).all())
    ids = torch.tensor([[5, 3, 9], [2, 7, 1]])  # token ids: within the given range
    got = _inputs_like([ids], {"m": [2, 6]}, ["m"], 0)[0]
    assert int(got.min()) >= 1 and int(got.max()) <= 9


def test_causal_text_encoder_judged_by_eager_alone_at_other_shapes():
    transformers = pytest.importorskip("transformers")
    import normexport
    from normexport.testing import assert_parity

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=128, pad_token_id=0)
    model = transformers.Qwen3Model(cfg).eval()

    class Encoder(torch.nn.Module):  # what a pipeline reads of its text encoder
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    enc = Encoder(model).eval()
    ids = torch.randint(1, 64, (2, 12))
    mask = (torch.arange(12) < torch.tensor([[7], [12]])).long()  # right padding, as tokenizers pad
    axes = {"input_ids": [0, 1], "attention_mask": [0, 1]}
    onnx_model = normexport.convert_module(enc, (ids, mask), target="onnx", input_names=["input_ids", "attention_mask"],
                                           dynamic_axes=axes)
    # judged by the 2x-eager rule alone at two other shapes: the rows every implementation computes alike
    report = assert_parity(enc, onnx_model, (ids, mask), dynamic_axes=axes, extra_shapes=2, plain_export=None)
    checked = [s for s in report.shapes if not s.get("skipped")]
    assert len(checked) == 3, report.shapes
    batches = {s["inputs"]["attention_mask"][0] for s in checked}
    assert len(batches) == 3, report.shapes  # the batch and the text length varied
