"""Folder inputs where the folder's files and the config say more than the docstring (issue 40):
real classes of transformers 5.24 / diffusers 0.42 that no other test names, tiny random configs,
saved with save_pretrained (and the real processors' save_pretrained), converted with the parity
check.

1. processor_config.json (transformers 5 nests the image processor in it) is read, and wins over
   a stale preprocessor_config.json beside it, as transformers' own loaders decide;
2. a patch input's width is the config's / processor's patch size x channels (the docstring's
   formula), not the model's hidden_size the docstring names, corrected by the model's projection;
3. the config's patch layout wins over a docstring image shape it contradicts, and a docstring dim
   nothing resolves is never written into an --input hint;
4. widths the config holds under other names (encoder_hidden_size, a pooled embedding's
   cond_embed_dim, micro-conditioning counts) are made and written into the refusal's hints.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import normexport
from normexport.load import docs, examples
from normexport.load.dims import Resolver
from normexport.load.folder_files import folder_sizes

from _new_families import _perturb_norms, convert

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")


def _shapes(loaded) -> dict:
    return {n: tuple(t.shape) for n, t in zip(loaded.input_names, loaded.example_inputs)}


def _hints_are_valid(message: str) -> None:
    """Every --input hint of a message is NAME:DIMS[:DTYPE] with digits, or the DIMS placeholder."""
    for name, dims in re.findall(r"--input (\w+):(\S+)", message):
        assert dims.startswith("DIMS") or re.fullmatch(r"\d+(x\d+)*(:\w+)?;?", dims), (name, dims, message)


# --- 1. processor_config.json ------------------------------------------------------------------


def _roberta_tokenizer(d):
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "a": 4, "b": 5}
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n")
    tok = transformers.RobertaTokenizer(str(d / "vocab.json"), str(d / "merges.txt"))
    (d / "vocab.json").unlink()
    (d / "merges.txt").unlink()
    return tok


@pytest.fixture(scope="module")
def trocr(tmp_path_factory):
    """VisionEncoderDecoderModel (ViT encoder of 32x32 images, TrOCR decoder): its image size lives in
    config.json's `encoder`, which normexport does not read; the folder's processor says it. An older
    ViTImageProcessor save left preprocessor_config.json (64x64) beside the TrOCRProcessor saved later,
    whose processor_config.json nests the image processor (32x32)."""
    d = tmp_path_factory.mktemp("trocr")
    torch.manual_seed(0)
    enc = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32)
    dec = transformers.TrOCRConfig(vocab_size=64, d_model=16, decoder_layers=1, decoder_attention_heads=2,
                                   decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=1, bos_token_id=0,
                                   eos_token_id=2, decoder_start_token_id=0)
    cfg = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id = 0, 1
    m = transformers.VisionEncoderDecoderModel(cfg)
    _perturb_norms(m)
    m.eval().save_pretrained(d)
    transformers.ViTImageProcessorPil(size={"height": 64, "width": 64}).save_pretrained(d)  # the stale one
    processor = transformers.TrOCRProcessor(image_processor=transformers.ViTImageProcessorPil(
        size={"height": 32, "width": 32}), tokenizer=_roberta_tokenizer(d))
    processor.save_pretrained(d)
    return d


def test_processor_config_nested_image_processor_wins(cli, trocr, tmp_path):
    saved = json.loads((trocr / "processor_config.json").read_text())
    assert saved["image_processor"]["size"] == {"height": 32, "width": 32}  # what transformers 5.24 writes
    assert json.loads((trocr / "preprocessor_config.json").read_text())["size"] == {"height": 64, "width": 64}
    # transformers' own loader takes the nested section first: so does normexport
    assert transformers.AutoImageProcessor.from_pretrained(trocr).size.height == 32
    assert folder_sizes(trocr)["height"] == 32 and folder_sizes(trocr)["num_channels"] == 3
    loaded = normexport.load(str(trocr))
    assert _shapes(loaded)["pixel_values"] == (2, 3, 32, 32)
    stdout, rep, errs = convert(cli, trocr, tmp_path / "trocr.onnx")
    assert rep["inputs"][0]["shape"][1:] == [3, 32, 32]
    # instead of: the processor's file alone
    (trocr / "preprocessor_config.json").unlink()
    assert folder_sizes(trocr)["height"] == 32


# --- 2. a patch input's width ------------------------------------------------------------------


@pytest.fixture(scope="module")
def pix2struct(tmp_path_factory):
    """Pix2StructForConditionalGeneration documents flattened_patches `(batch_size, seq_length,
    hidden_size)` ("`hidden_size` = `num_channels` * `patch_size` * `patch_size`"); the model takes
    2 + 2 x 2 x 3 = 14 features (row, column, a 2x2 RGB patch) and its hidden_size is 16."""
    d = tmp_path_factory.mktemp("pix2struct")
    torch.manual_seed(0)
    cfg = transformers.Pix2StructConfig(
        text_config=dict(vocab_size=64, hidden_size=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                         decoder_start_token_id=0, pad_token_id=0),
        vision_config=dict(hidden_size=16, patch_embed_hidden_size=12, d_ff=32, d_kv=8, num_hidden_layers=1,
                           num_attention_heads=2, seq_len=16))
    m = transformers.Pix2StructForConditionalGeneration(cfg)
    _perturb_norms(m)
    m.eval().save_pretrained(d / "bare")
    m.save_pretrained(d / "processor")
    tok = transformers.T5Tokenizer(vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(c, -1.0) for c in "abcd"],
                                   extra_ids=0)
    ip = transformers.Pix2StructImageProcessorPil(patch_size={"height": 2, "width": 2}, max_patches=16)
    transformers.Pix2StructProcessor(image_processor=ip, tokenizer=tok).save_pretrained(d / "processor")
    return d


def test_patch_width_from_the_processor_and_the_model_not_hidden_size(cli, pix2struct, tmp_path):
    sizes = folder_sizes(pix2struct / "processor")  # its processor_config.json: patch_size {height, width}
    assert (sizes["patch_height"], sizes["patch_width"], sizes["num_channels"], sizes["max_patches"]) == (2, 2, 3, 16)
    for folder in ("processor", "bare"):  # 3 x 2 x 2 = 12 from the processor, or 16 (hidden_size) from none:
        loaded = normexport.load(str(pix2struct / folder))  # both corrected by the model's projection to 14
        assert _shapes(loaded)["flattened_patches"] == (2, 8, 14), folder
    # --no-residual-fusion: the trt residual fusion leaves this graph unsorted (a rewriter defect, not the inputs')
    stdout, rep, errs = convert(cli, pix2struct / "processor", tmp_path / "p2s.onnx", "--no-residual-fusion")
    assert rep["inputs"][0]["shape"][-1] == 14 and len(errs) == 6, (rep["inputs"], errs)


# --- 3. the config's patch layout over the docstring's image; hints in --input syntax ----------


@pytest.fixture(scope="module")
def siglip2(tmp_path_factory):
    """Siglip2VisionModel (NaFlex) documents pixel_values `(batch_size, num_channels, image_size,
    image_size)` and pixel_attention_mask `(batch_size, image_size, image_size)`; its config has no
    image_size but num_patches and patch_size: the model takes [B, 16, 3 x 4 x 4] patches, a [B, 16]
    mask and each image's patch grid as spatial_shapes."""
    d = tmp_path_factory.mktemp("siglip2")
    torch.manual_seed(0)
    m = transformers.Siglip2VisionModel(transformers.Siglip2VisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_channels=3,
        patch_size=4, num_patches=16))
    _perturb_norms(m)
    m.eval().save_pretrained(d)
    return d


def test_config_patch_layout_wins_over_the_docstring_image(cli, siglip2, tmp_path):
    loaded = normexport.load(str(siglip2))
    assert _shapes(loaded) == {"pixel_values": (2, 16, 48), "pixel_attention_mask": (2, 16), "spatial_shapes": (2, 2)}
    assert loaded.example_inputs[2].tolist() == [[4, 4], [4, 4]]
    stdout, rep, errs = convert(cli, siglip2, tmp_path / "siglip2.onnx")
    assert [i["shape"][1:] for i in rep["inputs"]] == [[16, 48], [16], [2]]


def test_unresolved_docstring_dims_are_no_input_hint(siglip2):
    """Without the layout (a resolver that knows nothing of the folder), the docstring's
    `image_size` resolves to nothing: the refusal says so and writes no `2ximage_size...` hint."""
    model = normexport.load(str(siglip2)).module.inner
    documented = docs.params(model)
    text = examples._documented_text(documented["pixel_attention_mask"], Resolver(model.config, {}, 2))
    assert "image_size: not in the config or the processor files" in text, text
    message = examples.missing_message("Siglip2VisionModel", {"pixel_attention_mask": text})
    assert "--input pixel_attention_mask:DIMS" in message and "2ximage_size" not in message, message
    _hints_are_valid(message)


# --- 4. widths the config holds under other names ------------------------------------------------


def _uvit(path, encode_dim):
    torch.manual_seed(0)
    m = diffusers.UVit2DModel(hidden_size=16, cond_embed_dim=8, micro_cond_encode_dim=encode_dim,
                              micro_cond_embed_dim=20, encoder_hidden_size=12, vocab_size=32, codebook_size=24,
                              in_channels=8, block_out_channels=8, num_res_blocks=1, block_num_heads=2,
                              num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, sample_size=4)
    _perturb_norms(m)
    m.eval().save_pretrained(path)
    return path


def test_config_widths_by_their_names(cli, tmp_path):
    """UVit2DModel (aMUSEd): encoder_hidden_states' width is encoder_hidden_size, pooled_text_emb's
    ("Pooled text embeddings used for additional conditioning") cond_embed_dim, micro_conds counts
    micro_cond_embed_dim / micro_cond_encode_dim values."""
    folder = _uvit(tmp_path / "uvit", encode_dim=4)
    loaded = normexport.load(str(folder))
    assert _shapes(loaded) == {"input_ids": (2, 4, 4), "encoder_hidden_states": (2, 6, 12), "pooled_text_emb": (2, 8),
                               "micro_conds": (2, 5)}
    convert(cli, folder, tmp_path / "uvit.onnx")


def test_refusal_hints_from_the_config(cli, tmp_path):
    """A config whose micro-conditioning widths do not divide (20 / 6): micro_conds cannot be made;
    the refusal's hints for the others are the config's widths, in valid --input syntax."""
    folder = _uvit(tmp_path / "uvit6", encode_dim=6)
    code, out, err = cli("convert", folder, "-o", tmp_path / "u.onnx")
    assert code == 2 and "cannot make example inputs for micro_conds:" in err, err
    assert "encoder_hidden_states [2x6x12]" in err and "pooled_text_emb [2x8]" in err, err
    assert "TEXT_DIM" not in err and "--input micro_conds:DIMS" in err and len(err.strip().splitlines()) == 1, err
    _hints_are_valid(err)
