"""A float64 run of a text encoder whose attention rows are fully masked (left padding, an empty
negative prompt padded to its length) is NaN where float32 eager is finite, unless its lower-float
casts are kept in float64 (docs/design.md §7, the float64 reference).

The mechanism (transformers 5, eager attention): the mask adds finfo(dtype).min for masked keys
(-1.8e308 in a float64 copy) and the softmax is taken with dtype=float32: -1.8e308 cast to float32
is -inf, a fully masked row is softmax(all -inf) = NaN, and NaN x 0 in the next matmul spreads it
over the whole sequence. In float32, finfo(float32).min is finite: a uniform row. The single-file
reference runs its float64 copy under parity.reference._Float64Mode (the float32 softmax kept in
float64); the pipeline check's float64 run did not (Sana, Gemma2 text encoder: NaN latents, the
exported pipeline 135 dB from eager and failing). Real classes, tiny configs, random weights:
transformers Qwen3Model / Gemma2Model, and a diffusers SanaPipeline's float64 run end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from normexport.parity.reference import kept_in_float64  # noqa: E402

#: batch row 0 right-padded, row 1 left-padded (its first 3 query rows fully masked); and an all-padding row
CASES = {
    "left padding": (torch.tensor([[3, 4, 5, 6, 7, 0], [0, 0, 0, 5, 6, 7]]),
                     torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]])),
    "empty prompt": (torch.tensor([[3, 4, 5, 6, 0, 0], [0, 0, 0, 0, 0, 0]]),
                     torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])),
}


def _encoder(kind: str):
    torch.manual_seed(0)
    if kind == "qwen3":
        m = transformers.Qwen3Model(transformers.Qwen3Config(
            vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8))
    else:  # Sana's text encoder
        m = transformers.Gemma2Model(transformers.Gemma2Config(
            vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, head_dim=8, pad_token_id=0))
    m.set_attn_implementation("eager")
    return m.eval()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["qwen3", "gemma2"])
def test_masked_rows_finite_in_the_float64_reference(kind, case):
    ids, mask = CASES[case]
    m = _encoder(kind)
    with torch.no_grad():
        eager = m(input_ids=ids, attention_mask=mask).last_hidden_state.double()
        m.double()
        bare = m(input_ids=ids, attention_mask=mask).last_hidden_state
        with kept_in_float64([m]):
            ref = m(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.isfinite(eager).all()
    assert torch.isnan(bare[1]).all()  # the fact: the float64 copy alone is NaN in the padded batch row
    assert "forward" not in vars(m)  # the class's forward again after the block
    assert torch.isfinite(ref).all()
    # float64 vs float32 eager: float32's rounding alone (inputs ~N(0, 1) after the norms)
    assert float((ref - eager).abs().max()) < 2e-6
    if kind == "qwen3":  # rows with keys to attend to: torch's float64 SDPA (another implementation) agrees
        m.set_attn_implementation("sdpa")
        with torch.no_grad(), kept_in_float64([m]):
            sdpa = m(input_ids=ids, attention_mask=mask).last_hidden_state
        assert float((ref[0] - sdpa[0]).abs().max()) < 1e-12


def test_nested_calls_enter_once_and_other_wrappers_are_kept():
    m = _encoder("qwen3").double()
    outer = m.forward

    def spy(*a, **k):
        return outer(*a, **k)

    m.forward = spy
    ids, mask = CASES["left padding"]
    with kept_in_float64([m, m.layers[0]]), torch.no_grad():
        out = m(input_ids=ids, attention_mask=mask).last_hidden_state  # layer 0 runs inside the model's call
    assert torch.isfinite(out).all()
    assert vars(m)["forward"] is spy and "forward" not in vars(m.layers[0])


def _sana(d):
    """A tiny real SanaPipeline (tools/try_pipeline_families.py's): Gemma2 text encoder, DC-AE, the
    WordLevel tokenizer padding right: the empty negative prompt is all padding."""
    import diffusers
    from _pipelines import _perturb, word_tokenizer

    torch.manual_seed(0)
    transformer = diffusers.SanaTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2, attention_head_dim=8,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=16,
        sample_size=8)
    dc = diffusers.AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2,
        encoder_block_types=("ResBlock",) * 5 + ("EfficientViTBlock",),
        decoder_block_types=("ResBlock",) * 5 + ("EfficientViTBlock",), encoder_block_out_channels=(8,) * 6,
        decoder_block_out_channels=(8,) * 6, encoder_qkv_multiscales=((),) * 5 + ((5,),),
        decoder_qkv_multiscales=((),) * 5 + ((5,),), encoder_layers_per_block=(1,) * 6,
        decoder_layers_per_block=(1,) * 6, downsample_block_type="conv", upsample_block_type="interpolate",
        decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407)
    gemma = transformers.Gemma2Model(transformers.Gemma2Config(
        head_dim=8, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1,
        num_key_value_heads=2, vocab_size=16, max_position_embeddings=512, pad_token_id=0)).eval()
    pipe = diffusers.SanaPipeline(tokenizer=word_tokenizer(), text_encoder=_perturb(gemma), vae=dc,
                                  transformer=_perturb(transformer),
                                  scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))
    pipe.save_pretrained(d / "sana")
    return d / "sana"


def test_sana_pipeline_float64_run_is_finite(tmp_path):
    """The pipeline check's float64 run (compare._float64_run) of a real SanaPipeline: finite, and
    the decoded latents within float32's rounding of the float32 eager run's."""
    pytest.importorskip("diffusers")
    from normexport.load import pipeline as folder_pipeline
    from normexport.pipeline import compare

    folder = _sana(tmp_path)
    index = json.loads((folder / "model_index.json").read_text())
    with compare._float32_noise():
        run64, note = compare._float64_run(folder, index, 32, 1, {}, {}, {"slots": {}})
        run32 = compare._run(folder_pipeline.build(folder, index), folder, 32, 1)
    assert note is None
    assert np.isfinite(run32["latents"]).all() and np.isfinite(run32["image"]).all()
    assert np.isfinite(run64["latents"]).all() and np.isfinite(run64["image"]).all()
    scale = float(np.abs(run64["latents"]).max())
    assert float(np.abs(run32["latents"] - run64["latents"]).max()) < 1e-4 * scale
