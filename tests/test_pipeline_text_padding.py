"""Issue 46: a text length that a component's file fixes, served by padding with masked rows
(normexport/pipeline/padding.py).

diffusers' QwenImagePipeline (tiny real classes: Qwen2.5-VL text encoder, QwenImageTransformer2DModel,
AutoencoderKLQwenImage): the transformer's RoPE takes `int(text length)`, which torch.export
specialises, so its file holds one text length, and its pipeline passes `encoder_hidden_states_mask=None`
whenever every token of the batch is valid. convert proves on the eager transformer that zero rows with a
mask of 0 change none of its outputs (and that random rows there reach none), exports the file again at the
pipeline's max_sequence_length (512) with the mask as an input, and the loaded pipeline pads each call and
makes the mask. Before: "transformer.forward called with encoder_hidden_states [1, 14, 16] (the file
takes [2, 11, 16]): ... keeps those sizes static".

Checked against the eager pipeline: a prompt shorter and one longer than any convert recorded, and two
prompts of different lengths with negative prompts (the pipeline's own mask, true CFG); a text longer than
the file's is one line naming the limit; a forward that takes a mask but ignores it is not padded.

Planted and seen failing: the runtime's padding off (padding.pad returning the call unchanged): "called
with encoder_hidden_states [1, 3, 16] ... keeps those sizes static" in the prompt test; the padded mask
rows 1 instead of 0: the images far from eager; padding._verify passing every plan: the ignored-mask test
fails.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from _pipelines import _perturb, converted_unchecked, word_tokenizer

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

CALL = dict(num_inference_steps=2, height=64, width=64, output_type="np")


def _transformer():
    torch.manual_seed(0)
    return _perturb(diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(2, 2, 4)).eval())


def _qwenimage(d):
    """A tiny QwenImagePipeline (a two-level causal VAE: 64x64 images are 32x32 latents)."""
    transformer = _transformer()
    vae = diffusers.AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 1], num_res_blocks=1,
                                           temperal_downsample=[False], latents_mean=[0.1, -0.1, 0.2, 0.0],
                                           latents_std=[1.1, 0.9, 1.2, 1.0])
    text = dict(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, rope_theta=10000.0, bos_token_id=None, eos_token_id=None,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    qwen = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                             out_hidden_size=16),
        vocab_size=16, hidden_size=16, bos_token_id=None, eos_token_id=None)).eval()
    pipe = diffusers.QwenImagePipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                                       text_encoder=_perturb(qwen), tokenizer=word_tokenizer(), transformer=transformer)
    pipe.save_pretrained(d / "qwenimage")
    return d / "qwenimage"


@pytest.fixture(scope="module")
def qwenimage(tmp_path_factory):
    return converted_unchecked(_qwenimage, tmp_path_factory, "qwenimage")


def test_the_file_is_padded_to_the_pipelines_text_length(qwenimage):
    _, out = qwenimage
    entry = json.loads((out / "normexport_pipeline.json").read_text())["slots"]["transformer"]
    plan, = entry["text_padding"]
    assert plan["inputs"] == {"encoder_hidden_states": 1} and plan["length"] == 512, plan
    assert plan["mask"] == "encoder_hidden_states_mask" and plan["mask_made"] and plan["mask_pad"] == 0, plan
    assert entry["inputs"]["encoder_hidden_states"]["shape"][1] == 512
    assert entry["inputs"]["encoder_hidden_states_mask"]["shape"][1] == 512
    assert 1 not in entry["inputs"]["encoder_hidden_states"]["dynamic"]  # the exporter fixed it: why padding is needed


def test_prompts_of_other_lengths_match_eager(qwenimage):
    import normexport.pipeline

    folder, out = qwenimage
    pipe = normexport.pipeline.load(out)
    eager = diffusers.DiffusionPipeline.from_pretrained(str(folder), local_files_only=True)
    long = " ".join(["a photo of cat dog"] * 8)  # 40 words: longer than any text convert recorded
    calls = [dict(prompt="dog"), dict(prompt=long),
             dict(prompt=["a", "a photo of cat dog dog"], negative_prompt=["cat", "dog dog dog dog dog dog dog"])]
    images = []
    for call in calls:
        got = pipe(generator=torch.Generator().manual_seed(0), **call, **CALL).images
        want = eager(generator=torch.Generator().manual_seed(0), **call, **CALL).images
        assert got.shape == want.shape and np.isfinite(got).all()
        assert np.abs(got - want).max() < 1e-5, (call, np.abs(got - want).max())  # measured 1.8e-7
        images.append(want)
    # the text reaches the image, far above the tolerance (measured 8.9e-4 in this tiny model): a padding error shows
    assert np.abs(images[0] - images[1]).max() > 2e-4
    assert np.abs(images[2][0] - images[2][1]).max() > 2e-4


def test_a_text_longer_than_the_file_is_one_line(qwenimage):
    import normexport.pipeline

    _, out = qwenimage
    pipe = normexport.pipeline.load(out)
    with pytest.raises(RuntimeError) as e:
        pipe.transformer(hidden_states=torch.zeros(1, 256, 16), timestep=torch.ones(1),
                         encoder_hidden_states=torch.zeros(1, 513, 16), img_shapes=[[(1, 16, 16)]],
                         attention_kwargs={}, return_dict=False)
    assert "\n" not in str(e.value) and "at most 512" in str(e.value), e.value


class _MaskIgnored(torch.nn.Module):
    """The real transformer behind a forward that takes the mask and drops it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, encoder_hidden_states, timestep, img_shapes, encoder_hidden_states_mask=None):
        return self.inner(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                          timestep=timestep, img_shapes=img_shapes, return_dict=False)


def test_padding_that_reaches_the_outputs_is_refused():
    from normexport.pipeline import padding

    transformer = _transformer()
    call = dict(hidden_states=torch.randn(1, 16, 16), encoder_hidden_states=torch.randn(1, 5, 16),
                timestep=torch.ones(1), img_shapes=[[(1, 4, 4)]])
    plan, why = padding.plan_for(transformer, (), call, {"encoder_hidden_states": 1}, 12)
    assert plan is not None and plan["mask"] == "encoder_hidden_states_mask", why
    plan, why = padding.plan_for(_MaskIgnored(transformer), (), call, {"encoder_hidden_states": 1}, 12)
    assert plan is None and "outputs change" in why, why
