"""Vision folders (transformers ResNetForImageClassification, ConvNextModel): example images from
the config (num_channels, image_size), `--input pixel_values:...` accepted, norms fused (BatchNorm
folded into the convolutions, LayerNorms as LayerNormalization), onnxruntime parity passing."""

from __future__ import annotations

import pytest
import torch

import normexport
import normexport.errors

from _new_families import _perturb_norms, convert, norm_calls, ops

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("vision")
    torch.manual_seed(0)
    resnet = transformers.ResNetForImageClassification(transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=5))
    convnext = transformers.ConvNextModel(transformers.ConvNextConfig(
        num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], image_size=32))
    for name, m in (("resnet", resnet), ("convnext", convnext)):
        _perturb_norms(m)
        m.eval().save_pretrained(d / name)
    return d


def test_resnet_folder_converts_with_derived_images(cli, folders, tmp_path):
    loaded = normexport.load(str(folders / "resnet"))
    assert loaded.input_names == ["pixel_values"] and loaded.example_inputs[0].shape == (2, 3, 64, 64)
    out = tmp_path / "r.onnx"
    stdout, rep, errs = convert(cli, folders / "resnet", out)
    calls = norm_calls(loaded.module, loaded.example_inputs)
    assert calls["bn"] == 6 and len(rep["fold_batchnorm"]) == calls["bn"], (calls, rep["fold_batchnorm"])
    assert ops(out)["BatchNormalization"] == 0
    assert rep["exporter"]["rung"] == "dynamic" and len(errs) == 3  # batch 2, 3, 4
    assert max(errs) < 1e-5, errs


def test_convnext_folder_accepts_the_input_the_message_asked_for(cli, folders, tmp_path):
    out = tmp_path / "c.onnx"
    stdout, rep, errs = convert(cli, folders / "convnext", out, "--input", "pixel_values:3x3x32x32")
    assert rep["inputs"] == [{"name": "pixel_values", "shape": [3, 3, 32, 32], "dtype": "float32"}]
    loaded = normexport.load(str(folders / "convnext"))
    calls = norm_calls(loaded.module, loaded.example_inputs)
    got = ops(out)
    # nothing left decomposed (the one ReduceMean is the pooler's global average, not a norm)
    assert calls["ln"] == 5 and got["LayerNormalization"] == calls["ln"], (got, calls)
    assert got["Sqrt"] == 0 and got["ReduceMean"] == 1, got
    assert max(errs) < 1e-5, errs


def test_vision_model_without_channels_names_the_shape_and_both_ways():
    """A vision config that names no channel count: derive() makes nothing and the message names
    pixel_values with the shape the config implies, --input, --inputs and normexport.capture; the
    --input it asks for is then taken as given."""
    from normexport.load import examples

    class Vision(torch.nn.Module):
        main_input_name = "pixel_values"
        config = {"image_size": 32}

        def forward(self, pixel_values):
            return pixel_values

    out, missing = examples.derive(Vision(), "transformers")
    assert not out and missing == {"pixel_values": "[2xCHANNELSx32x32]"}
    msg = examples.missing_message("Vision", missing)
    # the --input hint is valid syntax: a size the config does not give (CHANNELS) is not written into it (issue 40)
    for part in ("pixel_values [2xCHANNELSx32x32]", "--input pixel_values:DIMS", "--inputs inputs.pt",
                 "normexport.capture(model"):
        assert part in msg, msg
    assert "--input pixel_values:2xCHANNELS" not in msg, msg
    given = {"pixel_values": torch.randn(2, 4, 32, 32)}
    out, missing = examples.derive(Vision(), "transformers", given)
    assert not missing and out["pixel_values"] is given["pixel_values"]


def test_input_is_taken_when_nothing_can_be_derived(folders, monkeypatch):
    """The issue's refusal: a folder whose images cannot be derived (here the config's channels
    and the stem conv's hidden from derive) said "pass --input pixel_values" and then refused exactly that, because the
    folder failed to load before --input applied. Loading defers the message to the call."""
    from normexport.load import examples

    monkeypatch.setattr(examples, "_image_sizes", lambda config: (None, 32))
    monkeypatch.setattr(examples, "_first_conv_channels", lambda model: None)  # nor from the stem conv
    loaded = normexport.load(str(folders / "resnet"))
    assert loaded.example_inputs is None and "pixel_values" in loaded.missing
    with pytest.raises(normexport.errors.UsageError, match=r"pixel_values \[2xCHANNELSx32x32\].*--inputs"):
        normexport.load.call_for(loaded, str(folders / "resnet"))
    job = normexport.load.call_for(loaded, str(folders / "resnet"), ["pixel_values:2x3x32x32"])
    assert job.names == ["pixel_values"] and job.inputs[0].shape == (2, 3, 32, 32)
    with torch.no_grad():
        assert job.module(*job.inputs)[0].shape == (2, 5)
