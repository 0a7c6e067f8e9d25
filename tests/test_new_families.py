"""Families released lately, from save_pretrained folders (tiny configs, random weights): inputs
derived from the config in general (RoPE axes -> id columns, packed latents, img_shapes), --input
merged with the derived ones by forward parameter, norms fused, onnxruntime parity passing."""

from __future__ import annotations

import pytest
import torch

import normexport
from normexport.errors import UsageError

from _new_families import _perturb_norms, convert, norm_calls, ops

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def flux2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux2") / "flux2"
    torch.manual_seed(0)
    m = diffusers.Flux2Transformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                                          timestep_guidance_channels=16, axes_dims_rope=(4, 4, 4, 4))
    _perturb_norms(m)
    m.eval().save_pretrained(folder)
    return folder


def test_flux2_ids_have_one_column_per_rope_axis(cli, flux2, tmp_path):
    loaded = normexport.load(str(flux2))
    shapes = dict(zip(loaded.input_names, [tuple(t.shape) for t in loaded.example_inputs]))
    assert shapes["img_ids"] == (8, 4) and shapes["txt_ids"] == (6, 4), shapes
    out = tmp_path / "f.onnx"
    stdout, rep, errs = convert(cli, flux2, out)
    calls = norm_calls(loaded.module, loaded.example_inputs)
    got = ops(out)
    assert calls["rms"] == 6 and got["RMSNorm"] == calls["rms"], (got, calls)
    assert got["AdaLNZero"] + got["LayerNormalization"] == calls["ln"] and got["ReduceMean"] == 0, (got, calls)
    assert rep["exporter"]["rung"] == "dynamic" and len(errs) == 3 and max(errs) < 1e-5, errs


def test_input_merges_with_the_derived_inputs_at_the_users_batch(flux2):
    """--input names some parameters; the others are derived at the batch and lengths they imply."""
    loaded = normexport.load(str(flux2))
    job = normexport.load.call_for(loaded, str(flux2), ["hidden_states:3x10x8", "encoder_hidden_states:3x5x24"])
    shapes = dict(zip(job.names, [tuple(t.shape) for t in job.inputs]))
    assert shapes == {"hidden_states": (3, 10, 8), "encoder_hidden_states": (3, 5, 24), "timestep": (3,),
                      "img_ids": (10, 4), "txt_ids": (5, 4), "guidance": (3,)}, shapes
    with torch.no_grad():
        job.module(*job.inputs)  # the model takes them


def test_qwen_image_img_shapes_fixed_and_said(cli, tmp_path):
    """QwenImageTransformer2DModel: packed latents and `img_shapes`, a list of (frames, h, w) per
    prompt that no tensor input can carry: derived from the latent length, fixed in the file as
    a constant of the call, and said."""
    torch.manual_seed(0)
    m = diffusers.QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                                              axes_dims_rope=(4, 6, 6))
    _perturb_norms(m)
    m.eval().save_pretrained(tmp_path / "qwen")
    loaded = normexport.load(str(tmp_path / "qwen"))
    assert loaded.module.constants()["img_shapes"] == [(1, 2, 4), (1, 2, 4)]
    out = tmp_path / "q.onnx"
    stdout, rep, errs = convert(cli, tmp_path / "qwen", out)
    assert "fixed in the file (python values of the call, not ONNX inputs): img_shapes=[(1, 2, 4), (1, 2, 4)]" in stdout
    assert "img_shapes" not in [i["name"] for i in rep["inputs"]]
    calls = norm_calls(loaded.module, loaded.example_inputs)
    assert ops(out)["RMSNorm"] == calls["rms"] and max(errs) < 1e-5, (ops(out), calls, errs)


def test_input_by_keyword_reaches_its_parameter():
    """--input NAMEs out of forward order (or skipping a parameter) go by keyword: each tensor
    reaches the parameter it names (positional order would swap them)."""
    from normexport.load.model import LoadedModel

    class M(torch.nn.Module):
        def forward(self, x, bias=None, scale=None):
            return x * scale + (0 if bias is None else bias)

    loaded = LoadedModel(M(), "factory")
    job = normexport.load.call_for(loaded, "m:M", ["x:2x3", "scale:2x3"])
    assert job.names == ["x", "scale"]
    x, scale = job.inputs
    assert torch.equal(job.module(*job.inputs)[0], x * scale)


def _save(tmp_path, cls_name: str, **config):
    tmp_path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    m = getattr(diffusers, cls_name)(**config)
    _perturb_norms(m)
    m.eval().save_pretrained(tmp_path / cls_name)
    return tmp_path / cls_name


def _shapes(job) -> dict:
    return {n: (tuple(t.shape), t.dtype) for n, t in zip(job.names, job.inputs) if isinstance(t, torch.Tensor)}


def test_longcat_image_packed_latents_over_a_stale_docstring(cli, tmp_path):
    """LongCat-Image documents hidden_states as `(batch size, channel, height, width)` (copied from an
    older model) but embeds packed tokens [B, N, C] with one img_ids row per token: the per-token ids
    decide (the documented 4-D latents made its x_embedder refuse them)."""
    cls = diffusers.LongCatImageTransformer2DModel
    assert "(batch size, channel, height, width)" in cls.forward.__doc__  # what the rule overrides
    folder = _save(tmp_path, "LongCatImageTransformer2DModel", attention_head_dim=8, axes_dims_rope=(2, 4, 2),
                   in_channels=64, joint_attention_dim=32, num_attention_heads=2, num_layers=1, num_single_layers=1,
                   patch_size=1, pooled_projection_dim=32)
    job = normexport.load.call_for(normexport.load(str(folder)), str(folder))
    shapes = _shapes(job)
    assert shapes["hidden_states"][0] == (2, 8, 64) and shapes["img_ids"][0] == (8, 3), shapes
    stdout, rep, errs = convert(cli, folder, tmp_path / "longcat.onnx")
    assert len(errs) == 3 and max(errs) < 1e-4, errs


def test_bria_derived_packed_inputs_need_no_pipeline(tmp_path):
    """Bria documents the same stale 4-D latents: with the per-token ids deciding, its derived inputs are
    accepted as they are (before, only a call recorded in BriaPipeline with stand-ins was)."""
    folder = _save(tmp_path, "BriaTransformer2DModel", attention_head_dim=8, axes_dims_rope=(2, 4, 2), in_channels=64,
                   joint_attention_dim=32, num_attention_heads=2, num_layers=1, num_single_layers=1)
    job = normexport.load.call_for(normexport.load(str(folder)), str(folder))
    assert not getattr(job.loaded, "headline", None), job.loaded.headline  # no pipeline was driven
    shapes = _shapes(job)
    assert shapes["hidden_states"][0] == (2, 8, 64) and shapes["img_ids"][0] == (8, 3), shapes


def test_hunyuan_video15_inputs_from_its_config_widths(tmp_path):
    """HunyuanVideo 1.5 reads a second text encoder's embeddings, its mask and image embeddings, none with a
    documented shape: each gets the width its config names (text_embed_2_dim, image_embed_dim), the mask the
    made embeddings' batch and tokens, and the timestep (documented LongTensor, embedded by a Linear) float."""
    folder = _save(tmp_path, "HunyuanVideo15Transformer3DModel", attention_head_dim=8, image_embed_dim=40,
                   in_channels=65, num_attention_heads=2, num_layers=1, num_refiner_layers=1, out_channels=32,
                   patch_size=1, patch_size_t=1, rope_axes_dim=(2, 4, 2), target_size=32, text_embed_2_dim=24,
                   text_embed_dim=32)
    job = normexport.load.call_for(normexport.load(str(folder)), str(folder))
    shapes = _shapes(job)
    assert shapes["timestep"] == ((2,), torch.float32), shapes
    assert shapes["encoder_hidden_states"][0] == (2, 6, 32) and shapes["encoder_hidden_states_2"][0] == (2, 6, 24)
    assert shapes["image_embeds"][0] == (2, 6, 40), shapes
    assert shapes["encoder_attention_mask_2"] == ((2, 6), torch.bool), shapes


def test_a_made_integer_mask_is_tried_as_bool(tmp_path):
    """Qwen-Image 2.1 uses img_mask as a condition (`torch.where`): the made integer mask is tried as bool
    (the model then asks for what only its pipeline's vision-language encoder makes, and the refusal says
    what was tried)."""
    folder = _save(tmp_path, "QwenImage21Transformer2DModel", attention_head_dim=8, axes_dims_rope=(2, 4, 2),
                   context_in_dim=16, in_channels=64, num_attention_heads=2, num_layers=1, out_channels=64,
                   patch_size=1)
    with pytest.raises(UsageError) as info:
        normexport.load.call_for(normexport.load(str(folder)), str(folder))
    assert "tried img_mask as bool" in str(info.value) and "boolean tensor" not in str(info.value)


def test_documented_latents_come_before_packed_ones(tmp_path):
    """HiDream documents [B, C, H, W] latents (or patched ones) and takes img_ids too, patchifying what it is
    given: the documented layout is kept (the packed one is only tried when a projection refuses the latents'
    features); the model then refuses what only its pipeline makes (Llama-3 hidden states of every layer)."""
    folder = _save(tmp_path, "HiDreamImageTransformer2DModel", patch_size=2, in_channels=16, out_channels=16,
                   num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                   caption_channels=[32, 24], text_emb_dim=32, num_routed_experts=2, num_activated_experts=1,
                   axes_dims_rope=(8, 8), max_resolution=(16, 16), llama_layers=[0, 1])
    with pytest.raises(UsageError) as info:
        normexport.load.call_for(normexport.load(str(folder)), str(folder))
    assert "hidden_states [2x16x4x4]" in str(info.value) and "other layout" not in str(info.value), info.value


def test_wan_vace_control_latents_take_the_channels_their_embedding_takes(cli, tmp_path):
    """WanVACE's control_hidden_states (made like the latents once the forward asks for it) go through their
    own patch embedding of vace_in_channels: the channel error is about them (the failing statement names
    them, not the latents of the same shape) and they get its channels; the folder converts."""
    folder = _save(tmp_path, "WanVACETransformer3DModel", num_attention_heads=2, attention_head_dim=8, text_dim=32,
                   freq_dim=16, ffn_dim=32, num_layers=2, vace_layers=[0], vace_in_channels=32)
    job = normexport.load.call_for(normexport.load(str(folder)), str(folder))
    shapes = _shapes(job)
    assert shapes["hidden_states"][0][1] == 16 and shapes["control_hidden_states"][0][1] == 32, shapes
    stdout, rep, errs = convert(cli, folder, tmp_path / "vace.onnx")
    assert errs and max(errs) < 1e-4, errs


def test_a_missing_optional_package_is_named(tmp_path):
    """Cosmos imports torchvision's transforms only where torchvision is installed and uses them for its
    padding mask: without torchvision the refusal names the package to install (not "name 'transforms' is not
    defined"); without the padding mask its derived inputs are accepted."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here")
    cfg = dict(num_attention_heads=2, attention_head_dim=16, num_layers=1, text_embed_dim=32, adaln_lora_dim=8,
               max_size=(8, 16, 16), crossattn_proj_in_channels=32, encoder_hidden_states_channels=32)
    folder = _save(tmp_path / "mask", "CosmosTransformer3DModel", **cfg)
    with pytest.raises(UsageError) as info:
        normexport.load.call_for(normexport.load(str(folder)), str(folder))
    assert "needs the package torchvision, which is not installed" in str(info.value), info.value
    assert "pip install torchvision" in str(info.value)
    folder = _save(tmp_path / "nomask", "CosmosTransformer3DModel", concat_padding_mask=False, **cfg)
    job = normexport.load.call_for(normexport.load(str(folder)), str(folder))
    assert _shapes(job)["hidden_states"][0] == (2, 16, 2, 4, 4)
