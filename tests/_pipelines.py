"""Tiny diffusers pipelines built from real classes (text encoders with tokenizers written here, no
hub access; random weights, norm weights moved off their init so a wrong fusion shows), saved with
save_pretrained: the pipeline-folder tests' inputs (test_pipeline_folder, test_pipeline_out)."""

from __future__ import annotations

import json

import torch

import diffusers
import transformers
import tokenizers

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


def vae(**config):
    """AutoencoderKL; SD3 / Flux decode with `shift_factor` (config=dict(shift_factor=..., scaling_factor=...))."""
    return diffusers.AutoencoderKL(**config, in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8),
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


def converted_unchecked(make, tmp_path_factory, name: str):
    """(pipeline folder, OUT) of `make(d)` (a pipeline saved under d) converted with --no-check: for tests that
    compare the loaded pipeline with eager themselves (each component's parity is test_pipeline_out.py's concern;
    docs/design.md §16)."""
    from normexport.cli import main

    d = tmp_path_factory.mktemp(name)
    folder = make(d)
    out = d / "out"
    assert main(["convert", str(folder), "-o", f"{out}/", "--no-check"]) == 0
    return folder, out


def build(kind, d):
    torch.manual_seed(0)
    if kind == "pixart":
        transformer = diffusers.PixArtTransformer2DModel(
            num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
            patch_size=2, cross_attention_dim=16, caption_channels=16)
        pipe = diffusers.PixArtAlphaPipeline(tokenizer=word_tokenizer(), text_encoder=t5(16), vae=vae(),
                                             transformer=_perturb(transformer),
                                             scheduler=diffusers.DDIMScheduler())
    elif kind == "sd3_shared":  # one CLIP text encoder in both CLIP slots (save_pretrained writes it twice)
        transformer = diffusers.SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=4,
            joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
            pos_embed_max_size=16)
        clip = clip_text(transformers.CLIPTextModelWithProjection, 16, 8)
        tok = clip_tokenizer(d / "tok1")
        pipe = diffusers.StableDiffusion3Pipeline(
            transformer=_perturb(transformer), scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
            vae=vae(shift_factor=0.1, scaling_factor=0.5), text_encoder=clip, tokenizer=tok, text_encoder_2=clip, tokenizer_2=tok,
            text_encoder_3=t5(32), tokenizer_3=word_tokenizer())
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
    elif kind == "flux":  # packed 2x2 latents, RoPE ids made by the pipeline, CLIP pooled + T5 text
        transformer = diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
        flux_vae = diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8),
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            norm_num_groups=4, layers_per_block=1, use_quant_conv=False, use_post_quant_conv=False,
            shift_factor=0.1, scaling_factor=0.5)
        pipe = diffusers.FluxPipeline(
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=flux_vae,
            text_encoder=clip_text(transformers.CLIPTextModel), tokenizer=clip_tokenizer(d / "tok"),
            text_encoder_2=t5(32), tokenizer_2=word_tokenizer(), transformer=_perturb(transformer))
    elif kind == "dit":  # class-conditional: __call__(class_labels), no text encoder; learned sigma
        transformer = diffusers.DiTTransformer2DModel(
            num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
            sample_size=8, patch_size=2, num_embeds_ada_norm=1000, norm_num_groups=4)  # DiTPipeline: null class 1000
        pipe = diffusers.DiTPipeline(transformer=_perturb(transformer), vae=vae(),
                                     scheduler=diffusers.DDIMScheduler())
    else:  # SD 1.5-like (UNet); img2img: the same with an image input (the VAE encodes it: the vae_encoder slot)
        unet = diffusers.UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8,),
            norm_num_groups=4, cross_attention_dim=16, down_block_types=("CrossAttnDownBlock2D",),
            up_block_types=("CrossAttnUpBlock2D",), attention_head_dim=2)
        cls, scheduler = ((diffusers.StableDiffusionImg2ImgPipeline, diffusers.DDIMScheduler()) if kind == "img2img"
                          else (diffusers.StableDiffusionPipeline, diffusers.EulerDiscreteScheduler()))
        pipe = cls(vae=vae(), text_encoder=clip_text(transformers.CLIPTextModel), tokenizer=clip_tokenizer(d / "tok"),
                   unet=_perturb(unet), scheduler=scheduler, safety_checker=None, feature_extractor=None,
                   requires_safety_checker=False)
    pipe.save_pretrained(d / kind)
    return d / kind


