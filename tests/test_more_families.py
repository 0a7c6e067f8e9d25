"""`normexport convert FOLDER` with no --input on save_pretrained folders of classes of
transformers 5.24 / diffusers 0.42.1 that no other test names (issue 28, part 2): example inputs
from the signature, documentation and config, checked by one eager forward (probe). Tiny
configs, random weights. Every class is loaded (its inputs made and accepted by the eager
forward); those whose inputs needed a mechanism of this round are also converted, parity
checked against float64 with the batch dynamic."""

from __future__ import annotations

import pytest


from _new_families import convert, made_shapes, save_folders

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")
T, D = transformers, diffusers


def _pixart_sized():
    # use_additional_conditions: added_cond_kwargs={"resolution", "aspect_ratio"}, unpacked into a callee
    # (`self.emb(t, **added_cond_kwargs)`) and replaced when falsy (`or {"resolution": None, ...}`)
    return D.PixArtTransformer2DModel(num_attention_heads=3, attention_head_dim=8, in_channels=4, out_channels=4,
                                      num_layers=1, cross_attention_dim=24, caption_channels=12, sample_size=8,
                                      patch_size=2, norm_num_groups=4, use_additional_conditions=True)


def _wav2vec2():
    # raw audio: the documented (batch_size, sequence_length) is too short for the feature encoder's
    # kernels until the eager check grows it
    return T.Wav2Vec2Model(T.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
        architectures=["Wav2Vec2Model"]))


def _ppocr():
    # the config names no channels and the bare folder has no processor file: the stem conv's in_channels
    return T.PPOCRV5MobileDetForObjectDetection(T.PPOCRV5MobileDetConfig(
        architectures=["PPOCRV5MobileDetForObjectDetection"]))


MODELS = {
    "PixArtTransformer2DModel+sizes": (_pixart_sized, {"hidden_states": (2, 4, 8, 8), "added_cond_kwargs.resolution": (2, 2),
                                                       "added_cond_kwargs.aspect_ratio": (2, 1)}),
    "SD3Transformer2DModel": (lambda: D.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=12, caption_projection_dim=16, pooled_projection_dim=10, out_channels=4,
        pos_embed_max_size=16), {"pooled_projections": (2, 10)}),
    "AuraFlowTransformer2DModel": (lambda: D.AuraFlowTransformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=12, caption_projection_dim=16, out_channels=4,
        pos_embed_max_size=16), {"encoder_hidden_states": (2, 6, 12)}),
    "CogVideoXTransformer3DModel": (lambda: D.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=8, text_embed_dim=12,
        num_layers=1, sample_width=8, sample_height=8, sample_frames=9, patch_size=2, temporal_compression_ratio=4,
        max_text_seq_length=6), {"hidden_states": (2, 2, 4, 8, 8)}),
    "Wav2Vec2Model": (_wav2vec2, {"input_values": (2, 128)}),
    "Dinov2Model": (lambda: T.Dinov2Model(T.Dinov2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2, image_size=16, patch_size=4,
        architectures=["Dinov2Model"])), {"pixel_values": (2, 3, 16, 16)}),
    "SamModel": (lambda: T.SamModel(T.SamConfig(
        vision_config=dict(hidden_size=16, output_channels=8, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                           patch_size=8, mlp_dim=32, global_attn_indexes=[0], num_pos_feats=4),
        prompt_encoder_config=dict(hidden_size=8, image_size=32, patch_size=8, mask_input_channels=4),
        mask_decoder_config=dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, mlp_dim=16,
                                 iou_head_hidden_dim=8), architectures=["SamModel"])), {"pixel_values": (2, 3, 32, 32)}),
    "DetrForObjectDetection": (lambda: T.DetrForObjectDetection(T.DetrConfig(
        use_timm_backbone=False, use_pretrained_backbone=False, backbone=None,
        backbone_config=T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], out_features=["stage2"]),
        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=4, num_labels=3, architectures=["DetrForObjectDetection"])),
        {"pixel_values": (2, 3, 64, 64)}),
    "PPOCRV5MobileDetForObjectDetection": (_ppocr, {"pixel_values": (2, 3, 64, 64)}),
    # random masking unless `noise` ("to control randomness") is given: two eager calls disagree, so it
    # is made, one value per patch ((16 / 4)^2)
    "ViTMAEModel": (lambda: T.ViTMAEModel(T.ViTMAEConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=16, patch_size=4,
        architectures=["ViTMAEModel"])), {"pixel_values": (2, 3, 16, 16), "noise": (2, 16)}),
    "RTDetrForObjectDetection": (lambda: T.RTDetrForObjectDetection(T.RTDetrConfig(
        backbone_config=T.RTDetrResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16], depths=[1, 1, 1],
                                             out_features=["stage1", "stage2", "stage3"]),
        encoder_in_channels=[8, 16, 16], d_model=16, encoder_hidden_dim=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=4,
        num_labels=3, decoder_in_channels=[16, 16, 16], num_feature_levels=3, decoder_n_points=2,
        architectures=["RTDetrForObjectDetection"])), {"pixel_values": (2, 3, 64, 64)}),
    "HubertModel": (lambda: T.HubertModel(T.HubertConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
        architectures=["HubertModel"])), {"input_values": (2, 128)}),
    "ASTForAudioClassification": (lambda: T.ASTForAudioClassification(T.ASTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, patch_size=4, num_mel_bins=16,
        max_length=32, frequency_stride=4, time_stride=4, num_labels=3, architectures=["ASTForAudioClassification"])),
        {"input_values": (2, 32, 16)}),
    "CLIPModel": (lambda: T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         max_position_embeddings=16),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                           patch_size=4), projection_dim=8, architectures=["CLIPModel"])),
        {"input_ids": (2, 8), "pixel_values": (2, 3, 16, 16)}),
    "DPTForDepthEstimation": (lambda: T.DPTForDepthEstimation(T.DPTConfig(
        hidden_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=32, image_size=32, patch_size=8,
        backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[8, 8, 16, 16], fusion_hidden_size=16, head_hidden_size=8,
        reassemble_factors=[4, 2, 1, 0.5], architectures=["DPTForDepthEstimation"])), {"pixel_values": (2, 3, 32, 32)}),
    "YolosForObjectDetection": (lambda: T.YolosForObjectDetection(T.YolosConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=[32, 32],
        patch_size=8, num_detection_tokens=4, num_labels=3, architectures=["YolosForObjectDetection"])),
        {"pixel_values": (2, 3, 32, 32)}),
    "Swinv2Model": (lambda: T.Swinv2Model(T.Swinv2Config(
        image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=4,
        architectures=["Swinv2Model"])), {"pixel_values": (2, 3, 32, 32)}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_folders(MODELS, tmp_path_factory.mktemp("more_families"))


@pytest.mark.parametrize("name", list(MODELS))
def test_inputs_made_and_accepted(folders, name):
    loaded, shapes = made_shapes(folders / name, MODELS[name][1])
    assert all(axes and axes[0] == 0 for axes in loaded.dynamic_axes.values()) and loaded.dynamic_axes, loaded.dynamic_axes


@pytest.mark.parametrize("name, fused", [("PixArtTransformer2DModel+sizes", "normexport::AdaLNZero"),
                                         ("Wav2Vec2Model", "LayerNormalization"), ("Dinov2Model", "LayerNormalization"),
                                         ("ViTMAEModel", "LayerNormalization")])
def test_converts_from_its_folder(cli, folders, tmp_path, name, fused):
    stdout, rep, errs = convert(cli, folders / name, tmp_path / "m.onnx")
    assert rep["op_counts"].get(fused, 0) > 0 and "ReduceMean" not in rep["op_counts"], rep["op_counts"]
    assert rep["exporter"]["rung"] == "dynamic" and "STATIC SHAPES" not in stdout, stdout
