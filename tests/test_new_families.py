"""Families released lately, from save_pretrained folders (tiny configs, random weights): inputs
derived from the config in general (RoPE axes -> id columns, packed latents, img_shapes), --input
merged with the derived ones by forward parameter, norms fused, onnxruntime parity passing."""

from __future__ import annotations

import pytest
import torch

import normexport

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
