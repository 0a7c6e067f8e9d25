"""A denoiser folder alone (issue 46 item 7, docs/design.md §9): a diffusers transformer saved
with save_pretrained, no model_index.json beside it, whose inputs derived from its forward and
config the forward refuses. Its call is recorded from a pipeline class of diffusers that takes the
class in its `transformer` slot (normexport/load/standin.py), run with tiny stand-ins for its other
components; the file made from that call passes parity against float64. Switched off (standin.record
refusing), the same folder is refused in one line that names the pipeline class to record it in.

Two classes whose derived inputs their forward refuses (tools/try_denoiser_folders.py --off):
CogVideoXTransformer3DModel (frame-first video latents at the latent frame count its VAE makes, the
text padded to the model's max_text_seq_length) and AnyFlowTransformer3DModel (video latents
[B, F, C, H, W], float64 timesteps of shape [B, F]). (BriaTransformer2DModel was the first class here;
its derived packed latents are accepted since 2026-11-29: tests/test_new_families.py.)
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
    "CogVideoXTransformer3DModel": dict(attention_head_dim=8, num_attention_heads=2, num_layers=1, text_embed_dim=32,
                                        time_embed_dim=32),
    "AnyFlowTransformer3DModel": dict(attention_head_dim=8, num_attention_heads=2, num_layers=1, ffn_dim=32, text_dim=32,
                                      in_channels=16, out_channels=16),
}
PIPELINES = {"CogVideoXTransformer3DModel": "CogVideoXPipeline", "AnyFlowTransformer3DModel": "AnyFlowPipeline"}


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


def test_cogvideox_frames_and_text_from_the_pipeline(calls):
    """The pipeline's call: its default 49 frames through the VAE's temporal compression (4: 13 latent
    frames) and 8x spatial one (64 -> 8), frame-first [B, F, C, H, W]; the prompt padded to the model's
    max_text_seq_length (226) at the stand-in encoder's width, the config's text_embed_dim."""
    call = calls["CogVideoXTransformer3DModel"]
    t = dict(zip(call.names, call.inputs))
    assert tuple(t["hidden_states"].shape[1:]) == (13, 16, 8, 8), t["hidden_states"].shape
    assert tuple(t["encoder_hidden_states"].shape[1:]) == (226, CONFIGS["CogVideoXTransformer3DModel"]["text_embed_dim"])
    assert t["timestep"].shape == (t["hidden_states"].shape[0],), t["timestep"].shape


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
    stdout, rep, errors = convert(cli, folders["AnyFlowTransformer3DModel"], tmp_path / "anyflow.onnx")
    assert "AnyFlowPipeline" in stdout, stdout
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
