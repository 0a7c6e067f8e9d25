"""`normexport convert PIPELINE_DIR` (issue 28 item 2, DESIGN §9): a whole diffusers pipeline folder
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

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = "a photo of cat dog"


def clip_tokenizer(d, max_length=16):
    """A CLIP BPE tokenizer from a vocab.json / merges.txt written here (single characters, no merges)."""
    chars = "abcdefghijklmnopqrstuvwxyz0123456789"
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    d.mkdir(parents=True, exist_ok=True)
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n")
    return transformers.CLIPTokenizer(str(d / "vocab.json"), str(d / "merges.txt"), model_max_length=max_length)


def word_tokenizer():
    """A T5-like tokenizer: a tokenizers-library WordLevel model wrapped as a fast tokenizer."""
    from tokenizers import models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    vocab.update({w: 3 + i for i, w in enumerate(WORDS.split())})
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                                unk_token="<unk>")


def vae():
    return diffusers.AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8),
                                   down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                                   norm_num_groups=4, layers_per_block=1)


def clip_text(cls, hidden=16, projection=None):
    kw = dict(vocab_size=80, hidden_size=hidden, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              max_position_embeddings=16)
    if projection:
        kw["projection_dim"] = projection
    return cls(transformers.CLIPTextConfig(**kw)).eval()


def t5(d_model):
    return transformers.T5EncoderModel(transformers.T5Config(vocab_size=16, d_model=d_model, d_kv=8, d_ff=32,
                                                             num_layers=1, num_heads=2)).eval()


def _perturb(m):
    """Norm weights away from their init (ones / zeros), so a wrong fusion shows."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return m


def build(kind, d):
    torch.manual_seed(0)
    if kind == "pixart":
        transformer = diffusers.PixArtTransformer2DModel(
            num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
            patch_size=2, cross_attention_dim=16, caption_channels=16)
        pipe = diffusers.PixArtAlphaPipeline(tokenizer=word_tokenizer(), text_encoder=t5(16), vae=vae(),
                                             transformer=_perturb(transformer),
                                             scheduler=diffusers.DDIMScheduler())
    elif kind == "sd3":
        transformer = diffusers.SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
            joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
            pos_embed_max_size=16)
        clip = transformers.CLIPTextModelWithProjection
        pipe = diffusers.StableDiffusion3Pipeline(
            transformer=_perturb(transformer), scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae(),
            text_encoder=clip_text(clip, 16, 8), tokenizer=clip_tokenizer(d / "tok1"),
            text_encoder_2=clip_text(clip, 16, 8), tokenizer_2=clip_tokenizer(d / "tok2"),
            text_encoder_3=t5(32), tokenizer_3=word_tokenizer())
    elif kind == "wan":  # a video pipeline; WanTransformer3DModel keeps modules in float32
        transformer = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
            text_dim=32, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32)
        wan_vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                             temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                                             latents_std=[1.0] * 4)
        text_encoder = transformers.UMT5EncoderModel(transformers.UMT5Config(
            vocab_size=16, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2)).eval()
        pipe = diffusers.WanPipeline(tokenizer=word_tokenizer(), text_encoder=text_encoder, vae=wan_vae,
                                     transformer=transformer, scheduler=diffusers.FlowMatchEulerDiscreteScheduler())
    elif kind == "controlnet":  # two diffusers models in the loop: the ControlNet, then the UNet
        unet = diffusers.UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8,),
            norm_num_groups=4, cross_attention_dim=16, down_block_types=("CrossAttnDownBlock2D",),
            up_block_types=("CrossAttnUpBlock2D",), attention_head_dim=2)
        controlnet = diffusers.ControlNetModel(
            in_channels=4, layers_per_block=1, block_out_channels=(8,), norm_num_groups=4, cross_attention_dim=16,
            down_block_types=("CrossAttnDownBlock2D",), attention_head_dim=2,
            conditioning_embedding_out_channels=(4, 4, 4, 4))
        pipe = diffusers.StableDiffusionControlNetPipeline(
            vae=vae(), text_encoder=clip_text(transformers.CLIPTextModel), tokenizer=clip_tokenizer(d / "tok"),
            unet=unet, controlnet=controlnet, scheduler=diffusers.EulerDiscreteScheduler(), safety_checker=None,
            feature_extractor=None, requires_safety_checker=False)
    else:
        unet = diffusers.UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8,),
            norm_num_groups=4, cross_attention_dim=16, down_block_types=("CrossAttnDownBlock2D",),
            up_block_types=("CrossAttnUpBlock2D",), attention_head_dim=2)
        pipe = diffusers.StableDiffusionPipeline(
            vae=vae(), text_encoder=clip_text(transformers.CLIPTextModel), tokenizer=clip_tokenizer(d / "tok"),
            unet=_perturb(unet), scheduler=diffusers.EulerDiscreteScheduler(), safety_checker=None,
            feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(d / kind)
    return d / kind


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
