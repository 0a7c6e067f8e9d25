"""`normexport convert FOLDER` makes the inputs of any save_pretrained folder (issue 28, docs/design.md §9):
from what the folder says (config.json, preprocessor_config.json written by the real image
processor), what the library says (the forward's annotations, its documented shapes) and one
eager forward that tries the alternative when the model refuses (probe). Real classes, tiny
configs, random weights; every conversion checks parity against float64 (no --no-check)."""

from __future__ import annotations

import pytest
import torch

import normexport
from normexport.errors import UsageError
from normexport.load import pretrained

from _new_families import _perturb_norms, convert

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

UNET = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=12, attention_head_dim=4, norm_num_groups=4)
MEL, POSITIONS = 10, 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("folder_inputs")
    torch.manual_seed(0)
    models = {
        "unet": diffusers.UNet2DConditionModel(**UNET),
        # SDXL: added_cond_kwargs={"text_embeds", "time_ids"}: the keys the forward reads, widths from its error
        "sdxl": diffusers.UNet2DConditionModel(**UNET, addition_embed_type="text_time", addition_time_embed_dim=4,
                                               projection_class_embeddings_input_dim=6 * 4 + 8),
        "whisper": transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
            vocab_size=64, num_mel_bins=MEL, encoder_layers=1, decoder_layers=1, d_model=16, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=POSITIONS,
            max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)),
        "segformer": transformers.SegformerForSemanticSegmentation(transformers.SegformerConfig(
            num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
            patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=16,
            num_labels=3)),
        "ltx2": diffusers.LTX2VideoTransformer3DModel(
            in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
            audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=8,
            audio_cross_attention_dim=16, num_layers=1, caption_channels=16),
    }
    for name, m in models.items():
        _perturb_norms(m)
        m.eval().save_pretrained(d / name)
    # the size of these images lives only in the processor's file, as the hub lays a folder out
    transformers.SegformerImageProcessorPil(size={"height": 32, "width": 48}).save_pretrained(d / "segformer")
    return d


def _shapes(loaded) -> dict:
    return {n: tuple(t.shape) for n, t in zip(loaded.input_names, loaded.example_inputs)}


def test_unet_sample_from_its_documented_shape(cli, folders, tmp_path):
    """UNet2DConditionModel's `sample` is documented `(batch, channel, height, width)`: channels
    and size from the config (in_channels, sample_size)."""
    loaded = normexport.load(str(folders / "unet"))
    assert _shapes(loaded) == {"sample": (2, 4, 8, 8), "timestep": (2,), "encoder_hidden_states": (2, 6, 12)}
    stdout, rep, errs = convert(cli, folders / "unet", tmp_path / "unet.onnx")
    assert "GroupNorm" not in str(rep["op_counts"]) and rep["op_counts"].get("LayerNormalization", 0) > 0, rep["op_counts"]


def test_sdxl_unet_dict_parameter(cli, folders, tmp_path):
    """added_cond_kwargs is a dict[str, Tensor]: its entries are ONNX inputs, the keys those the forward
    reads from it, the widths fixed by the model's own 'mat1 and mat2' error (normexport.load.entries)."""
    loaded = normexport.load(str(folders / "sdxl"))
    shapes = _shapes(loaded)
    assert shapes["added_cond_kwargs.text_embeds"] == (2, 8) and shapes["added_cond_kwargs.time_ids"] == (2, 6), shapes
    stdout, rep, errs = convert(cli, folders / "sdxl", tmp_path / "sdxl.onnx")
    assert [i["name"] for i in rep["inputs"]][-2:] == ["added_cond_kwargs.text_embeds", "added_cond_kwargs.time_ids"]


def test_whisper_optional_main_input_found_by_the_eager_check(cli, folders, tmp_path):
    """input_features is optional (default None) and documented `(batch_size, sequence_length,
    feature_dim)`; the model reads it as [B, num_mel_bins, 2 * max_source_positions]: the eager
    check moves the axes and takes the length the model's error names. Only decoder_input_ids
    of the exclusive decoder pair is made."""
    loaded = normexport.load(str(folders / "whisper"))
    assert _shapes(loaded) == {"input_features": (2, MEL, 2 * POSITIONS), "decoder_input_ids": (2, 4)}
    stdout, rep, errs = convert(cli, folders / "whisper", tmp_path / "whisper.onnx")
    # input_features's batch is dynamic (documented `batch_size` first): 2 outputs x batch 2, 3, 4 checked
    assert rep["op_counts"].get("LayerNormalization", 0) > 0 and len(errs) == 6, (errs, stdout)
    stdout, rep, errs = convert(cli, folders / "whisper", tmp_path / "enc.onnx", "--module", "model.encoder")
    assert rep["inputs"][0]["shape"] == [2, MEL, 2 * POSITIONS] and rep["op_counts"]["LayerNormalization"] == 3


def test_a_pair_the_model_takes_one_of(folders):
    """Given both decoder_input_ids and decoder_inputs_embeds ("You cannot specify both ..."), the
    eager check drops the one normexport made; the user's own input is never dropped."""
    loaded = normexport.load(str(folders / "whisper"))
    model = loaded.module.inner
    kwargs = dict(zip(loaded.input_names, loaded.example_inputs), decoder_inputs_embeds=torch.randn(2, 4, 16))
    assert list(pretrained.checked(model, "transformers", kwargs)) == ["input_features", "decoder_input_ids"]
    with pytest.raises(UsageError, match="refused your input decoder_"):  # both the user's: said, not dropped
        pretrained.checked(model, "transformers", kwargs, given=["decoder_inputs_embeds", "decoder_input_ids"])


def test_processor_config_gives_the_image_size(cli, folders, tmp_path):
    """SegformerConfig names no image size; the folder's preprocessor_config.json (written by
    SegformerImageProcessorPil.save_pretrained) says 32x48."""
    loaded = normexport.load(str(folders / "segformer"))
    assert _shapes(loaded) == {"pixel_values": (2, 3, 32, 48)}
    stdout, rep, errs = convert(cli, folders / "segformer", tmp_path / "seg.onnx")
    assert rep["inputs"][0]["shape"] == [2, 3, 32, 48] and rep["op_counts"]["LayerNormalization"] > 0


def test_ltx2_audio_inputs_and_an_int_from_the_documentation(cli, folders, tmp_path):
    """LTX2VideoTransformer3DModel needs audio_hidden_states / audio_encoder_hidden_states (documented
    shapes: audio_in_channels, caption_channels) and, once the eager check finds a None read in
    prepare_audio_coords, audio_num_frames: the int counts what num_audio_tokens counts."""
    loaded = normexport.load(str(folders / "ltx2"))
    shapes = _shapes(loaded)
    tokens = shapes["audio_hidden_states"][1]
    assert shapes["audio_hidden_states"] == (2, tokens, 8) and shapes["audio_encoder_hidden_states"] == (2, 6, 16), shapes
    assert loaded.module.constants()["audio_num_frames"] == tokens
    stdout, rep, errs = convert(cli, folders / "ltx2", tmp_path / "ltx2.onnx")
    assert f"audio_num_frames={tokens}" in stdout


@pytest.fixture(scope="module")
def zimage(folders):
    torch.manual_seed(0)
    path = folders / "zimage"
    m = diffusers.ZImageTransformer2DModel(in_channels=4, dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                                           cap_feat_dim=16, axes_dims=[4, 6, 6], axes_lens=[64, 32, 32])
    _perturb_norms(m)
    m.eval().save_pretrained(path)
    return path


def test_list_parameters_from_their_documented_role(cli, zimage, tmp_path):
    """Z-Image takes `x: list[Tensor]` ("Input latents"), `t` ("denoising step") and `cap_feats:
    list[Tensor]` ("caption embeddings"): one tensor per batch item, each shaped as the role's
    batched example without its batch axis; the latents' frame axis (`C, F, H, W = image.size()`:
    "not enough values to unpack (expected 4, got 3)") is added by the eager check."""
    loaded = normexport.load(str(zimage))
    assert _shapes(loaded) == {"x.0": (4, 1, 2, 2), "x.1": (4, 1, 2, 2), "t": (2,), "cap_feats.0": (6, 16),
                               "cap_feats.1": (6, 16)}
    stdout, rep, errs = convert(cli, zimage, tmp_path / "zimage.onnx")
    assert rep["op_counts"].get("normexport::RMSNorm", 0) > 0, rep["op_counts"]


def test_refusal_names_the_parameter_and_both_ways(zimage, monkeypatch):
    """List parameters whose documentation says nothing normexport knows (Z-Image's, its roles
    hidden): one line naming them, --inputs and normexport.capture, and no --input suggestion for
    a list."""
    from normexport.load import examples, standin

    monkeypatch.setattr(examples, "_role", lambda documented: None)

    def record(*args, **kwargs):  # the refusal alone: no pipeline class drives the folder (tests/test_denoiser_alone.py)
        raise standin.StandInError("switched off")

    monkeypatch.setattr(standin, "record", record)
    loaded = normexport.load(str(zimage))
    with pytest.raises(UsageError) as e:
        normexport.load.call_for(loaded, str(zimage))
    msg = str(e.value)
    assert "x [a list of tensors]" in msg and "--inputs inputs.pt" in msg and "normexport.capture" in msg, msg
    assert "--input x:" not in msg and "\n" not in msg


def test_folder_output_carries_the_image_processor(folders, tmp_path):
    """`-o DIR/` of a vision folder: its image processor's file beside model.onnx (normexport.companions), so the
    folder's own processor loads from DIR and gives the size the file was exported for."""
    from normexport import companions

    lines = companions.write(tmp_path / "model.onnx", str(folders / "segformer"))
    assert (tmp_path / "preprocessor_config.json").is_file() and (tmp_path / "config.json").is_file(), lines
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path)
    assert processor.size == {"height": 32, "width": 48}
