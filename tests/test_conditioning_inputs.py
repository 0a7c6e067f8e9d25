"""Diffusers denoisers and autoencoders from bare save_pretrained folders with no --input (issue 28,
part 2): the documented layout where it differs from the generic latents (StableAudio's 1-D
[B, C, L], SVD's [B, F, C, H, W]), micro-conditioning values by name (CogView's original_size /
target_size / crop_coords: pairs, their batch dynamic), a documented count no config key names
sized by the model's projection (SVD's num_additional_ids), an autoencoder's `sample`. Tiny
configs, random weights; converted ones checked against float64 (no --no-check)."""

from __future__ import annotations

import pytest


from _new_families import convert, made_shapes, save_folders

D = pytest.importorskip("diffusers")

MODELS = {
    "UNetSpatioTemporalConditionModel": (lambda: D.UNetSpatioTemporalConditionModel(
        sample_size=8, in_channels=8, out_channels=4, block_out_channels=(32, 32), layers_per_block=1,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"), addition_time_embed_dim=4,
        projection_class_embeddings_input_dim=12, cross_attention_dim=12, num_attention_heads=(2, 2), num_frames=2),
        {"sample": (2, 2, 8, 8, 8), "added_time_ids": (2, 3)}),  # 3 ids = 12 / addition_time_embed_dim
    "StableAudioDiTModel": (lambda: D.StableAudioDiTModel(
        sample_size=16, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        num_key_value_attention_heads=1, out_channels=4, cross_attention_dim=12, time_proj_dim=8,
        global_states_input_dim=10, cross_attention_input_dim=12), {"hidden_states": (2, 4, 8)}),
    "CogView3PlusTransformer2DModel": (lambda: D.CogView3PlusTransformer2DModel(
        patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2, out_channels=4,
        text_embed_dim=12, time_embed_dim=8, condition_dim=4, pos_embed_max_size=16, sample_size=8),
        {"original_size": (2, 2), "target_size": (2, 2), "crop_coords": (2, 2)}),
    "CogView4Transformer2DModel": (lambda: D.CogView4Transformer2DModel(
        patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2, out_channels=4,
        text_embed_dim=12, time_embed_dim=8, condition_dim=4, rope_axes_dim=(4, 4)), {"crop_coords": (2, 2)}),
    "AutoencoderKL": (lambda: D.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16), latent_channels=4,
        norm_num_groups=4, layers_per_block=1, sample_size=16), {"sample": (2, 3, 16, 16)}),
    "UNet2DModel": (lambda: D.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=4), {"sample": (2, 3, 8, 8)}),
    "UNet3DConditionModel": (lambda: D.UNet3DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), block_out_channels=(8, 16), layers_per_block=1,
        norm_num_groups=4, cross_attention_dim=12, attention_head_dim=4), {"sample": (2, 4, 2, 8, 8)}),
    "SanaTransformer2DModel": (lambda: D.SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=12,
        mlp_ratio=2.0, sample_size=8, patch_size=1), {"hidden_states": (2, 4, 8, 8)}),
    "AllegroTransformer3DModel": (lambda: D.AllegroTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=1, cross_attention_dim=16,
        caption_channels=12, sample_height=8, sample_width=8, sample_frames=4), {"hidden_states": (2, 4, 2, 8, 8)}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_folders(MODELS, tmp_path_factory.mktemp("conditioning"))


@pytest.mark.parametrize("name", list(MODELS))
def test_inputs_made_and_accepted(folders, name):
    loaded, shapes = made_shapes(folders / name, MODELS[name][1])
    batched = [n for n, s in shapes.items() if s and s[0] == 2]
    assert all(loaded.dynamic_axes.get(n) == [0] for n in batched), (loaded.dynamic_axes, shapes)


@pytest.mark.parametrize("name, fused", [("CogView3PlusTransformer2DModel", "normexport::GatedAdaLNZero"),
                                         ("StableAudioDiTModel", "LayerNormalization")])
def test_converts_from_its_folder(cli, folders, tmp_path, name, fused):
    stdout, rep, errs = convert(cli, folders / name, tmp_path / "m.onnx")
    assert rep["op_counts"].get(fused, 0) > 0 and "ReduceMean" not in rep["op_counts"], rep["op_counts"]
    assert rep["exporter"]["rung"] == "dynamic" and "STATIC SHAPES" not in stdout and len(errs) == 3, stdout
