"""Audio and time-series folders no other test names (tiny configs of the real transformers classes,
random weights), inputs derived by general rules (docs/design.md §9):

- EncodecModel: `input_values (batch_size, channels, sequence_length)`, where the config calls the
  channels `audio_channels`: the channels the model's first convolution takes (dims.Resolver's
  fallback), the length grown until the convolutions fit (probe).
- Speech2TextModel: `input_features`, documented LongTensor, reach a Conv1d: "Input type (long int) and
  bias type (float) should be the same" turns them to float (probe).
- PatchTSTModel: "Input sequence length (8) doesn't match model configuration (32)": the made length
  takes the one other size the message names (probe). Its BatchNorm (inside PatchTSTBatchNorm, a
  weightless wrapper) is folded, and the wrapper is not reported as an unrecognised norm.
"""

from __future__ import annotations

import pytest
import torch

import normexport

from _new_families import _perturb_norms, convert, norm_calls, ops

transformers = pytest.importorskip("transformers")


def _folder(tmp_path, name, model):
    torch.manual_seed(0)
    _perturb_norms(model)
    with torch.no_grad():
        for n, b in model.named_buffers():  # non-default BatchNorm statistics
            if n.endswith("running_mean"):
                b.copy_(0.3 * torch.randn_like(b))
            elif n.endswith("running_var"):
                b.copy_(0.5 + torch.rand_like(b))
    model.eval().save_pretrained(tmp_path / name)
    return tmp_path / name


def _shapes(loaded):
    return {n: (tuple(t.shape), t.dtype) for n, t in zip(loaded.input_names, loaded.example_inputs)}


def test_encodec_channels_from_its_first_convolution(tmp_path):
    torch.manual_seed(0)
    m = transformers.EncodecModel(transformers.EncodecConfig(
        audio_channels=2, hidden_size=16, num_filters=4, upsampling_ratios=[4, 2], codebook_size=16,
        num_lstm_layers=1))
    loaded = normexport.load(str(_folder(tmp_path, "encodec", m)))
    shape, dtype = _shapes(loaded)["input_values"]
    assert shape[:2] == (2, 2) and dtype == torch.float32, shape  # batch 2, stereo
    with torch.no_grad():
        loaded.module(*loaded.example_inputs)


def test_speech2text_features_made_float(tmp_path):
    m = transformers.Speech2TextModel(transformers.Speech2TextConfig(
        vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=64,
        max_target_positions=64, input_feat_per_channel=16, conv_channels=16))
    loaded = normexport.load(str(_folder(tmp_path, "s2t", m)))
    shape, dtype = _shapes(loaded)["input_features"]
    assert dtype == torch.float32 and shape[0] == 2 and shape[2] == 16, (shape, dtype)


def test_patchtst_length_from_the_models_message_and_batchnorm_folded(cli, tmp_path):
    m = transformers.PatchTSTModel(transformers.PatchTSTConfig(
        num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, d_model=16,
        num_attention_heads=2, num_hidden_layers=1, ffn_dim=32, norm_type="batchnorm"))
    folder = _folder(tmp_path, "patchtst", m)
    loaded = normexport.load(str(folder))
    assert _shapes(loaded)["past_values"] == ((2, 32, 3), torch.float32)
    out = tmp_path / "p.onnx"
    stdout, rep, errs = convert(cli, folder, out)
    bns = norm_calls(loaded.module, loaded.example_inputs)["bn"]
    assert bns == 2 and len(rep["fold_batchnorm"]) == bns and ops(out)["BatchNormalization"] == 0, rep["fold_batchnorm"]
    assert "PatchTSTBatchNorm" not in stdout and "named like a norm" not in stdout, stdout
    assert max(errs) < 1e-4, errs
