"""`normexport convert PIPELINE_DIR` (issue 28 item 2, docs/design.md §9): a whole diffusers pipeline folder
(model_index.json + one folder per component, as `pipe.save_pretrained` writes it) is built offline
and run once (one step, 64x64) with normexport.capture on its components; the denoiser (or
`--module NAME[.submodule]`) is exported with exactly the call the pipeline made.

The pipelines are built here from real, tiny components: text encoders (CLIPTextModel[WithProjection],
T5EncoderModel) with tokenizers written by the test (a CLIP BPE vocab.json + merges.txt, a
tokenizers-library WordLevel model; no hub access), an AutoencoderKL, the denoiser (PixArt
transformer, SD3 transformer, UNet2DConditionModel) and a scheduler. The exported inputs are
compared with a call recorded independently from a pipeline loaded from the same folder."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

import normexport
from normexport.load.call import CallAdapter

from _new_families import convert, norm_calls, ops
from _pipelines import build

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

DENOISER = {"pixart": "transformer", "sd3": "transformer", "sd": "unet"}
CLASS = {"pixart": "PixArtAlphaPipeline", "sd3": "StableDiffusion3Pipeline", "sd": "StableDiffusionPipeline"}


def recorded_call(folder, component, tmp_path):
    """The component's first call in a one-step run of the pipeline loaded from the folder,
    recorded here with normexport.capture (independently of convert)."""
    pipe = diffusers.DiffusionPipeline.from_pretrained(str(folder), local_files_only=True)
    kwargs = dict(prompt="a photo", num_inference_steps=1, height=64, width=64, output_type="latent",
                  generator=torch.Generator().manual_seed(0))
    if "use_resolution_binning" in inspect.signature(pipe.__call__).parameters:
        kwargs["use_resolution_binning"] = False
    module = getattr(pipe, component)
    with normexport.capture(module, tmp_path / "ref.pt", stop=True, quiet=True):
        pipe(**kwargs)
    args, kw = torch.load(tmp_path / "ref.pt", weights_only=True)
    return module, args, kw


class _KwargsCall(torch.nn.Module):
    def __init__(self, inner, args, kwargs):
        super().__init__()
        self.inner, self.args, self.kwargs = inner, args, kwargs

    def forward(self):
        return self.inner(*self.args, **self.kwargs)


@pytest.mark.parametrize("kind", ["pixart", "sd3", "sd"])
def test_pipeline_folder_converts_its_denoiser(cli, tmp_path, kind):
    """The folder alone: the pipeline runs once, its denoiser (found by the run: the component
    called last before the scheduler's first step) is exported with the exact call the pipeline
    made (CFG batch 2, the text encoder's padded length, the mask) — norms fused, parity passing."""
    folder = build(kind, tmp_path)
    out = tmp_path / f"{kind}.onnx"
    stdout, rep, errs = convert(cli, folder, out)
    component = DENOISER[kind]
    module, args, kwargs = recorded_call(folder, component, tmp_path)
    want = CallAdapter(module, args, kwargs)
    got = [(i["name"], i["shape"]) for i in rep["inputs"]]
    assert got == [(n, list(t.shape)) for n, t in zip(want.input_names, want.example_inputs)], got
    assert rep["inputs"][0]["shape"][0] == 2  # the pipeline's classifier-free guidance batch
    # the pipeline's return_dict=False left out: the output keeps its name (UNet's renamed from its input's)
    assert list(rep["results"]["ort"]) == ["sample_out" if kind == "sd" else "sample"], list(rep["results"]["ort"])
    first = stdout.splitlines()[0]
    assert first.startswith(f"inputs: recorded from one {CLASS[kind]} step (1 step, 64x64) on component "
                            f"{component} (the denoiser"), first
    calls = norm_calls(_KwargsCall(module, args, kwargs), ())
    found = ops(out)
    assert calls["ln"] > 0 and found["RMSNorm"] == calls["rms"], (found, calls)
    assert found["AdaLNZero"] + found["LayerNormalization"] == calls["ln"], (found, calls)
    if kind != "sd":  # the DiTs' modulated LayerNorms become AdaLNZero (UNet's plain ones LayerNormalization)
        assert found["AdaLNZero"] == calls["ln"], (found, calls)
    assert max(errs) < 1e-4, errs
    if kind == "pixart":  # `check --reference PIPELINE_DIR`: the same run gives the reference's call
        code, stdout, err = cli("check", out, "--reference", folder)
        assert code == 0 and "(recorded from one PixArtAlphaPipeline step (1 step, 64x64) on component transformer)" \
            in stdout, (stdout, err)


def test_module_names_a_component_and_a_submodule(cli, tmp_path):
    """--module transformer.transformer_blocks.0: one block of the component, with the inputs it
    receives in the pipeline's call of the component."""
    folder = build("pixart", tmp_path)
    out = tmp_path / "block.onnx"
    stdout, rep, errs = convert(cli, folder, out, "--module", "transformer.transformer_blocks.0")
    shapes = {i["name"]: i["shape"] for i in rep["inputs"]}
    assert shapes["hidden_states"] == [2, 4 * 4, 16] and shapes["encoder_hidden_states"][:2] == [2, 120], shapes
    assert shapes["encoder_attention_mask"] == [2, 1, 120], shapes  # the pipeline's text mask, as the block gets it
    assert stdout.splitlines()[0].startswith("inputs: recorded from one PixArtAlphaPipeline step (1 step, 64x64) "
                                             "on component transformer (--module"), stdout
    assert ops(out)["AdaLNZero"] == 2  # the block's norm1 / norm2
    assert max(errs) < 1e-4, errs


def test_the_denoiser_is_found_by_the_run(tmp_path):
    """A ControlNet pipeline has two diffusers models in its loop: the one called last before the
    scheduler's first step is the UNet (fed the ControlNet's residuals); --module controlnet records
    the ControlNet's own call (the generic call gives the pipeline its control image). No export."""
    from normexport.load import pipeline

    folder = build("controlnet", tmp_path)
    index = json.loads((folder / "model_index.json").read_text())
    unet = pipeline.record(folder, index, None, tmp_path / "u.pt")
    assert type(unet.module).__name__ == "UNet2DConditionModel", unet.headline
    assert unet.headline.startswith("inputs: recorded from one StableDiffusionControlNetPipeline step (1 step, 64x64) "
                                    "on component unet (the denoiser"), unet.headline
    _, kwargs = torch.load(tmp_path / "u.pt", weights_only=True)
    assert len(kwargs["down_block_additional_residuals"]) > 0 and kwargs["mid_block_additional_residual"] is not None
    control = pipeline.record(folder, index, "controlnet", tmp_path / "c.pt")
    assert type(control.module).__name__ == "ControlNetModel" and "component controlnet (--module" in control.headline
    _, kwargs = torch.load(tmp_path / "c.pt", weights_only=True)
    assert kwargs["controlnet_cond"].shape == (2, 3, 64, 64)  # the control image at the run's size, CFG batch


def test_a_video_pipeline_whose_denoiser_keeps_fp32_modules(tmp_path):
    """WanPipeline: diffusers without accelerate refuses to load WanTransformer3DModel
    (_keep_in_fp32_modules) unless the list is set aside for the load (then restored); the run
    records the transformer's 5-D latents. No export (test_families converts a Wan folder)."""
    from normexport.load import pipeline

    folder = build("wan", tmp_path)
    keep = diffusers.WanTransformer3DModel._keep_in_fp32_modules
    got = pipeline.record(folder, json.loads((folder / "model_index.json").read_text()), None, tmp_path / "w.pt")
    assert diffusers.WanTransformer3DModel._keep_in_fp32_modules == keep  # restored
    assert type(got.module).__name__ == "WanTransformer3DModel" and "component transformer (the denoiser" in got.headline
    _, kwargs = torch.load(tmp_path / "w.pt", weights_only=True)
    assert kwargs["hidden_states"].dim() == 5 and kwargs["hidden_states"].shape[-2:] == (8, 8), kwargs["hidden_states"].shape


def test_pipeline_that_cannot_run_is_one_line(cli, tmp_path, capsys):
    """A component folder missing (the tokenizer), or a component that is not a module: exit 2, one
    line naming the cause and the escape hatches; no file written."""
    import shutil

    folder = build("sd", tmp_path)
    shutil.rmtree(folder / "tokenizer")
    capsys.readouterr()  # save_pretrained's progress bars
    out = tmp_path / "x.onnx"
    code, stdout, err = cli("convert", folder, "-o", out)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    for part in ("tokenizer (CLIPTokenizer)", "normexport.capture(pipe.unet", f"{folder / 'unet'} --inputs inputs.pt",
                 "--module unet --inputs"):
        assert part in err, err
    code, stdout, err = cli("convert", folder, "--module", "scheduler", "-o", out)
    assert code == 2 and "no folder there: tokenizer" in err, err
    code, stdout, err = cli("convert", folder, "--inputs", tmp_path / "i.pt", "-o", out)  # which component?
    assert code == 2 and "--module (one of text_encoder, unet, vae)" in err and f"{folder / 'unet'}" in err, err
    code, stdout, err = cli("convert", folder, "--module", "nothere", "-o", out)
    assert code == 2 and "has no component 'nothere'" in err and "unet" in err, err
    assert not out.exists()
