"""A component the pipeline calls with different sets of arguments gets a file per set, and the
loaded component runs the file of the arguments it is called with (issue 46, found by the pipeline
sweep on StableAudioPipeline: its projection_model is called with `text_hidden_states` in
encode_prompt, then with `start_seconds` / `end_seconds` in encode_duration; only the first call
was exported and generation stopped at the second, 'called with a tensor start_seconds, which its
file ... was not exported with'). On the real class, alone (the whole pipeline is the sweep's,
tools/try_pipeline_families.py stable_audio).

And the generic call's `image` (SVD): a PIL image where the pipeline's signature takes one, which
SVD resizes to its CLIP encoder's size (a tensor it passed on at the call's size: 'Input image size
(128*128) doesn't match model (224*224)' in convert's one-size-up run); and the loaded component's
`parameters()` (an empty one of its dtype: SVD reads `next(self.image_encoder.parameters()).dtype`,
StopIteration before) and its methods' signatures (SVD passes `num_frames` to its VAE's decode only
where `inspect.signature(self.vae.forward)` has it)."""

from __future__ import annotations

import inspect

import pytest
import torch

diffusers = pytest.importorskip("diffusers")


class EncodeAndDuration:
    """StableAudioPipeline's two calls of its projection model: encode_prompt's, encode_duration's."""

    def __init__(self, proj):
        self.proj = proj

    def __call__(self, hidden, start, end):
        self.proj(text_hidden_states=hidden)
        self.proj(start_seconds=start, end_seconds=end)


def test_a_file_per_argument_set(tmp_path):
    from normexport.cli import build_parser
    from normexport.pipeline import exporting
    from normexport.pipeline.recording import _Run, call_shapes
    from normexport.pipeline.runtime import OrtComponent

    torch.manual_seed(0)
    proj = diffusers.StableAudioProjectionModel(text_encoder_dim=16, conditioning_dim=4, min_value=0,
                                                max_value=32).eval()
    with torch.no_grad():  # not the identity the text projection starts as (text_encoder_dim != conditioning_dim)
        for p in proj.parameters():
            p.add_(0.1 * torch.randn_like(p))
    src = tmp_path / "src"
    proj.save_pretrained(src / "projection_model")
    hidden, start, end = torch.randn(2, 5, 16), torch.tensor([0.0, 3.0]), torch.tensor([10.0, 20.0])
    run = _Run({"projection_model": proj})
    with run.hooks(EncodeAndDuration(proj), first=True), torch.no_grad():
        EncodeAndDuration(proj)(hidden, start, end)
    assert list(run.slots) == ["projection_model", "projection_model_end_seconds_start_seconds"], list(run.slots)
    args = build_parser().parse_args(["convert", str(src), "-o", str(tmp_path / "out") + "/"])
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    files = []
    for name, slot in run.slots.items():
        slot.shapes = call_shapes([run], name)
        entry = exporting._export_slot(args, src, slot, tmp)
        assert entry is not None, f"{name} failed to export"
        files.append((name, entry))
    assert [e["arguments"] for _, e in files] == [["text_hidden_states"], ["end_seconds", "start_seconds"]]
    assert all(e["parity"] for _, e in files)  # each file's own parity check ran
    loaded = OrtComponent(tmp, "projection_model", ["diffusers", "StableAudioProjectionModel"], {"forward": files})
    # a pipeline that reads a component's dtype from its parameters (SVD: `next(self.image_encoder.parameters())`)
    assert next(loaded.parameters()).dtype == torch.float32
    # and what its method takes (SVD passes `num_frames` to vae.decode where its signature has it)
    assert list(inspect.signature(loaded.forward).parameters) == list(inspect.signature(proj.forward).parameters)
    with torch.no_grad():
        for call in ({"text_hidden_states": hidden}, {"start_seconds": start, "end_seconds": end}):
            got, want = loaded(**call), proj(**call)
            for key in ("text_hidden_states", "seconds_start_hidden_states", "seconds_end_hidden_states"):
                if getattr(want, key) is None:
                    assert getattr(got, key, None) is None, key
                else:
                    torch.testing.assert_close(getattr(got, key), getattr(want, key), rtol=0, atol=1e-5)
        with pytest.raises(RuntimeError, match="no exported file takes"):  # a set the run never gave
            loaded(text_hidden_states=hidden, start_seconds=start, end_seconds=end)


def test_generic_image_is_pil_where_the_pipeline_takes_one():
    """SVD's `image` and an img2img pipeline's: PIL images at the call's size (a batch of two: a list)."""
    from PIL import Image

    from normexport.load.pipeline import call_arguments
    from normexport.pipeline.recording import _batched

    for cls in (diffusers.StableVideoDiffusionPipeline, diffusers.StableDiffusionImg2ImgPipeline):
        pipe = cls.__new__(cls)  # call_arguments reads the signature and the modules' configs
        modules = {}
        kwargs, _ = call_arguments(pipe, modules, None, None)
        assert isinstance(kwargs["image"], Image.Image) and kwargs["image"].mode == "RGB", cls.__name__
        assert kwargs["image"].size == (kwargs.get("height", 64), kwargs.get("width", 64))
        if "prompt" in inspect.signature(cls.__call__).parameters:
            assert _batched(pipe, kwargs, modules)["image"] == [kwargs["image"]] * 2


def test_svd_sizes_and_batch_follow_the_pipeline_not_its_image_encoder():
    """SVD's image encoder is a transformers CLIP vision model with patch 32: it sees the image its own
    processor resized to 224 x 224, so its patch size is not a step of the pipeline's image sizes (counted,
    the unit was 128: recorded at 128 and 256, the unet exported static, a 64 x 64 call refused); and a
    pipeline without a prompt records its batch run with two videos per image."""
    import transformers

    from normexport.load.pipeline import call_arguments, image_unit
    from normexport.pipeline.recording import _batched

    clip = transformers.CLIPVisionModelWithProjection(transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=224,
        patch_size=32, projection_dim=8))
    cls = diffusers.StableVideoDiffusionPipeline
    pipe = cls.__new__(cls)
    pipe.vae_scale_factor = 8
    assert image_unit(pipe, {"image_encoder": clip}) == 16
    dit = diffusers.DiTTransformer2DModel(num_attention_heads=1, attention_head_dim=8, in_channels=4, num_layers=1,
                                          sample_size=8, patch_size=2, norm_num_groups=1)
    assert image_unit(pipe, {"image_encoder": clip, "transformer": dit}) == 32  # a diffusers denoiser's patch counts
    kwargs, _ = call_arguments(pipe, {}, None, None)
    assert _batched(pipe, kwargs, {})["num_videos_per_prompt"] == 2
