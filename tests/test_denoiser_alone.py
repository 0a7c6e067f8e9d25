"""A denoiser folder alone (issue 46 item 7, docs/design.md §9): a diffusers transformer saved
with save_pretrained, no model_index.json beside it, whose inputs derived from its forward and
config the forward refuses. Its call is recorded from a pipeline class of diffusers that takes the
class in its `transformer` slot (normexport/load/standin.py), run with tiny stand-ins for its other
components; the file made from that call passes parity against float64. Switched off (standin.record
refusing), the same folder is refused in one line that names the pipeline class to record it in.

Two classes no other test names, both refused before (tools/try_denoiser_folders.py): BriaTransformer2DModel
(Flux-like: packed latents, position ids per latent token and text token, made by the pipeline) and
AnyFlowTransformer3DModel (video latents [B, F, C, H, W], float64 timesteps of shape [B, F]).
Real classes, tiny configs, random weights (norm weights moved off their init)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from normexport import load
from normexport.load import standin

from _new_families import _perturb_norms, convert

diffusers = pytest.importorskip("diffusers")

CONFIGS = {
    "BriaTransformer2DModel": dict(attention_head_dim=8, axes_dims_rope=(2, 4, 2), in_channels=64,
                                   joint_attention_dim=32, num_attention_heads=2, num_layers=1, num_single_layers=1),
    "AnyFlowTransformer3DModel": dict(attention_head_dim=8, num_attention_heads=2, num_layers=1, ffn_dim=32, text_dim=32,
                                      in_channels=16, out_channels=16),
}
PIPELINES = {"BriaTransformer2DModel": "BriaPipeline", "AnyFlowTransformer3DModel": "AnyFlowPipeline"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("denoiser_alone")
    out = {}
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        m = getattr(diffusers, name)(**config)
        _perturb_norms(m)
        m.eval().save_pretrained(d / name)
        out[name] = d / name
    return out


@pytest.fixture(scope="module")
def calls(folders):
    """Each folder's resolved call (load + call_for, as convert makes it)."""
    return {name: load.call_for(load.load(str(f)), str(f)) for name, f in folders.items()}


def _off(monkeypatch):
    def record(*a, **k):
        raise standin.StandInError("switched off")

    monkeypatch.setattr(standin, "record", record)


def test_pipelines_that_take_the_class():
    """The pipeline classes are found by their __init__ annotation, text-to-X first."""
    found = [p.__name__ for p, slot in standin.pipelines_taking(diffusers.BriaTransformer2DModel)]
    assert found == ["BriaPipeline"], found
    flux = [p.__name__ for p, slot in standin.pipelines_taking(diffusers.FluxTransformer2DModel)]
    assert flux[0] == "FluxPipeline" and "FluxImg2ImgPipeline" in flux, flux


@pytest.mark.parametrize("name", list(CONFIGS))
def test_call_recorded_from_the_pipeline(calls, name):
    """The headline says which pipeline made the inputs; the latents are the pipeline's random ones."""
    call = calls[name]
    assert PIPELINES[name] in call.loaded.headline and "stand-ins" in call.loaded.headline, call.loaded.headline
    latents = call.inputs[call.names.index("hidden_states")]
    assert latents.std() > 0.5 and latents.shape[0] >= 1, latents.shape


def test_bria_positions_match_the_latent_tokens(calls):
    """64x64 through the 8x VAE and 2x2 packing: 4x4 = 16 latent tokens of 4 x 4 channels; img_ids one
    row per token, (0, row, col) in row-major order (numpy reference), txt_ids one per text token."""
    call = calls["BriaTransformer2DModel"]
    t = dict(zip(call.names, call.inputs))
    assert tuple(t["hidden_states"].shape[1:]) == (16, 64), t["hidden_states"].shape
    assert t["encoder_hidden_states"].shape[-1] == CONFIGS["BriaTransformer2DModel"]["joint_attention_dim"]
    rows, cols = np.divmod(np.arange(16), 4)
    expected = np.stack([np.zeros(16), rows, cols], axis=1)
    np.testing.assert_array_equal(t["img_ids"].double().numpy(), expected)
    assert t["txt_ids"].shape == (t["encoder_hidden_states"].shape[1], 3), (t["txt_ids"].shape, t["encoder_hidden_states"].shape)


def test_anyflow_frames_and_timesteps(calls):
    """AnyFlow's latents are [B, F, C, H/8, W/8] (its pipeline permutes them frame-first), its timesteps
    one per frame: [B, F]."""
    call = calls["AnyFlowTransformer3DModel"]
    t = dict(zip(call.names, call.inputs))
    b, f, c, h, w = t["hidden_states"].shape
    assert (c, h, w) == (16, 8, 8), t["hidden_states"].shape
    assert tuple(t["timestep"].shape) == (b, f), t["timestep"].shape
    assert t["encoder_hidden_states"].shape[-1] == CONFIGS["AnyFlowTransformer3DModel"]["text_dim"]


def test_convert_passes_parity(cli, folders, tmp_path):
    """convert FOLDER with no inputs: written, and the file matches float64 on the recorded call."""
    stdout, rep, errors = convert(cli, folders["BriaTransformer2DModel"], tmp_path / "bria.onnx")
    assert "BriaPipeline" in stdout, stdout
    assert max(errors) < 1e-3, errors


@pytest.mark.parametrize("name", list(CONFIGS))
def test_switched_off_refusal_names_the_pipeline(cli, folders, tmp_path, monkeypatch, name):
    """The derived inputs alone (the mechanism off): one line, exit 2, nothing written; it names the
    pipeline class to record the call in and the --inputs to pass."""
    _off(monkeypatch)
    out = tmp_path / "off.onnx"
    code, stdout, err = cli("convert", folders[name], "-o", out)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "forward refused the example inputs normexport made" in err, err
    assert f"record its call in {PIPELINES[name]}" in err and "--inputs inputs.pt" in err, err
    assert not out.exists()
