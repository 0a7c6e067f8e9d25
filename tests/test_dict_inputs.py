"""A dict-typed forward parameter (`added_cond_kwargs: dict[str, Tensor]`) made by one mechanism
(normexport/load/entries.py + probe): its keys are those the forward reads from it (a recording
dict in the eager check), their shapes from what the key's name says and the model's own error
("mat1 and mat2 shapes cannot be multiplied" gives a projection's width). Real
UNet2DConditionModel configs with diffusers' addition_embed_type values, bare save_pretrained
folders, no --input; every conversion checks parity (no --no-check)."""

from __future__ import annotations

import pytest
import torch

import normexport

from _new_families import _perturb_norms, convert

diffusers = pytest.importorskip("diffusers")

UNET = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=12, attention_head_dim=4, norm_num_groups=4)
CONFIGS = {
    # SDXL: text_embeds (pooled, width = 34 - 6 time ids x 4) and time_ids
    "text_time": dict(addition_embed_type="text_time", addition_time_embed_dim=4,
                      projection_class_embeddings_input_dim=6 * 4 + 10),
    # Kandinsky 2.2: image_embeds, also the cross-attention context (image_proj)
    "image": dict(addition_embed_type="image", encoder_hid_dim=10, encoder_hid_dim_type="image_proj"),
    # Kandinsky 2.1: image_embeds read twice, text_embeds read with a default that does not fit
    "text_image": dict(addition_embed_type="text_image", encoder_hid_dim=10, encoder_hid_dim_type="text_image_proj"),
    # Kandinsky 2.2 ControlNet: image_embeds and a hint image, whose embedding is concatenated to the latents
    # (in_channels 8 = 4 latent + 4 from the hint)
    "image_hint": dict(addition_embed_type="image_hint", encoder_hid_dim=10, encoder_hid_dim_type="image_proj",
                       in_channels=8),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("dict_inputs")
    for name, extra in CONFIGS.items():
        torch.manual_seed(0)
        m = diffusers.UNet2DConditionModel(**{**UNET, **extra})
        _perturb_norms(m)
        m.eval().save_pretrained(d / name)
    return d


def _shapes(loaded) -> dict:
    return {n: tuple(t.shape) for n, t in zip(loaded.input_names, loaded.example_inputs)}


@pytest.mark.parametrize("kind, entries", [
    ("text_time", {"added_cond_kwargs.text_embeds": (2, 10), "added_cond_kwargs.time_ids": (2, 6)}),
    ("image", {"added_cond_kwargs.image_embeds": (2, 10)}),
    ("text_image", {"added_cond_kwargs.image_embeds": (2, 12), "added_cond_kwargs.text_embeds": (2, 12)}),
    ("image_hint", {"added_cond_kwargs.image_embeds": (2, 10), "added_cond_kwargs.hint": (2, 3, 64, 64)}),
])
def test_dict_entries_are_the_keys_the_forward_reads(folders, kind, entries):
    """The keys are found by calling the forward, their widths from the model's projections."""
    loaded = normexport.load(str(folders / kind))
    shapes = _shapes(loaded)
    assert {n: s for n, s in shapes.items() if n.startswith("added_cond_kwargs.")} == entries, shapes
    assert shapes["sample"] == (2, 4, 8, 8)  # image_hint: the 4 channels the hint's embedding leaves
    # the batch of the entries is dynamic with the others'
    assert all(loaded.dynamic_axes.get(n) == [0] for n in entries), loaded.dynamic_axes


@pytest.mark.parametrize("kind", ["text_time", "image"])
def test_unet_with_added_conditions_converts_from_its_folder(cli, folders, tmp_path, kind):
    stdout, rep, errs = convert(cli, folders / kind, tmp_path / f"{kind}.onnx")
    assert "GroupNorm" not in str(rep["op_counts"]) and rep["op_counts"].get("LayerNormalization", 0) > 0, rep["op_counts"]
    assert "STATIC SHAPES" not in stdout and len(errs) == 3, stdout  # batch 2, 3, 4 checked
    names = [i["name"] for i in rep["inputs"]]
    assert [n for n in names if n.startswith("added_cond_kwargs.")] == list(
        {"text_time": ["added_cond_kwargs.text_embeds", "added_cond_kwargs.time_ids"],
         "image": ["added_cond_kwargs.image_embeds"]}[kind]), names
