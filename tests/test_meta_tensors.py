"""Weights on the meta device never reach a run as the torch error "Cannot copy out of meta tensor; no
data!" (issue 46 item 4, docs/design.md §12).

- The loaded (exported) pipeline's components stand on their class built on the meta device
  (runtime.OrtComponent). LTXPipeline denormalises the latents with the VAE's own buffers
  (`self.vae.latents_mean` / `latents_std`, AutoencoderKLLTXVideo) before it decodes: on the meta
  device that was the torch error in `check`'s exported run. Convert writes the component's own
  buffers beside its file (pipeline/buffers.py) and load puts them in: the diffusers pipeline's
  own `_denormalize_latents` gives, on the loaded component, what it gives on the real VAE. Any
  other tensor the pipeline reads from a loaded component is refused in one line naming it.
- Eager: a pipeline / model whose from_pretrained left weights on the meta device (a lazy or
  incomplete load) is refused in one line naming them, before any run or float64 copy.

Real classes (diffusers AutoencoderKLLTXVideo, DiTPipeline; transformers T5EncoderModel), tiny."""

from __future__ import annotations

import json

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from normexport.errors import UsageError  # noqa: E402
from normexport.pipeline import buffers  # noqa: E402
from normexport.pipeline.runtime import OrtComponent, _meta_module  # noqa: E402

MEAN = torch.tensor([0.5, -1.25, 2.0, 0.125])
STD = torch.tensor([1.5, 0.25, 3.0, 0.75])


def _ltx_vae():
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4, upsample_factor=(1,) * 4)
    vae.latents_mean.copy_(MEAN)
    vae.latents_std.copy_(STD)
    return vae.eval()


def _exported_folder(tmp_path, vae, with_buffers: bool):
    """An exported pipeline folder's vae_decoder slot as convert writes it: config.json (+ buffers)."""
    slot = tmp_path / "vae_decoder"
    slot.mkdir()
    vae.save_config(str(slot))
    if with_buffers:
        assert {"latents_mean", "latents_std"} <= set(buffers.write(vae, slot))
    return _meta_module(tmp_path, ["diffusers", "AutoencoderKLLTXVideo"], {"decode": ("vae_decoder", {})})


def _component(meta) -> OrtComponent:
    """runtime.OrtComponent around `meta` without its sessions (only attribute reads are tested)."""
    c = OrtComponent.__new__(OrtComponent)
    torch.nn.Module.__init__(c)
    object.__setattr__(c, "_meta", meta)
    c.component = "vae"
    return c


def test_meta_module_alone_is_the_torch_error(tmp_path):
    """The fact behind the issue: the class on the meta device has no values for its buffers."""
    meta = _exported_folder(tmp_path, _ltx_vae(), with_buffers=False)
    latents = torch.randn(1, 4, 1, 2, 2)
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        diffusers.LTXPipeline._denormalize_latents(latents, meta.latents_mean, meta.latents_std, 1.0)
    with pytest.raises(UsageError, match=r"reads vae\.latents_mean \(4 float32\).*convert the pipeline folder again"):
        _component(meta).latents_mean


def test_loaded_vae_denormalises_as_the_real_one(tmp_path):
    vae = _ltx_vae()
    comp = _component(_exported_folder(tmp_path, vae, with_buffers=True))
    latents = torch.randn(1, 4, 1, 2, 2, generator=torch.Generator().manual_seed(1))
    got = diffusers.LTXPipeline._denormalize_latents(latents, comp.latents_mean, comp.latents_std, 0.5)
    want = latents * STD.view(1, -1, 1, 1, 1) / 0.5 + MEAN.view(1, -1, 1, 1, 1)  # the formula, by hand
    assert torch.equal(comp.latents_mean, MEAN) and torch.equal(comp.latents_std, STD)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert comp.config.latent_channels == 4  # config and submodules still from the meta class
    # a submodule is handed over as it is (SDXL reads add_embedding.linear_1.in_features) ...
    assert comp.decoder.conv_in.conv.in_channels == 4  # the latent channels
    # ... a tensor without values read from the component itself is refused in one line, naming it
    comp._meta.extra = torch.nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(UsageError, match=r"reads vae\.extra \(3 float32\)"):
        comp.extra


def test_loaded_component_passes_its_pipelines_type_checks(tmp_path):
    """A pipeline's own isinstance checks on its components hold for the loaded one (the swept
    StableDiffusionControlNetPipeline's check_inputs: `isinstance(self.controlnet, ControlNetModel)`, else
    `assert False`, stopped generation); type() stays the runtime's own class."""
    comp = _component(_exported_folder(tmp_path, _ltx_vae(), with_buffers=True))
    assert isinstance(comp, diffusers.AutoencoderKLLTXVideo) and type(comp) is OrtComponent
    assert not isinstance(comp, diffusers.AutoencoderKL)
    object.__setattr__(comp, "_meta", None)  # a class that could not be built: the component is what it is
    assert not isinstance(comp, diffusers.AutoencoderKLLTXVideo) and isinstance(comp, OrtComponent)


def test_submodule_buffers_are_written_and_put_back(tmp_path):
    """Flux2KleinPipeline normalises and denormalises latents with its VAE's batch-norm statistics, read
    through a submodule (`self.vae.bn.running_mean`): the swept pipeline's generate stopped at "Cannot copy
    out of meta tensor". Submodule buffers are written by their dotted names and put back into the meta module."""
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=4,
                                       norm_num_groups=4, sample_size=64).eval()
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn(vae.bn.running_mean.shape))
        vae.bn.running_var.copy_(torch.rand(vae.bn.running_var.shape) + 0.5)
    slot = tmp_path / "vae_decoder"
    slot.mkdir()
    vae.save_config(str(slot))
    assert {"bn.running_mean", "bn.running_var"} <= set(buffers.write(vae, slot))
    comp = _component(_meta_module(tmp_path, ["diffusers", "AutoencoderKLFlux2"], {"decode": ("vae_decoder", {})}))
    assert torch.equal(comp.bn.running_mean, vae.bn.running_mean) and torch.equal(comp.bn.running_var, vae.bn.running_var)
    assert comp.decoder.conv_in.weight.is_meta  # weights stay where they are: in the file


def test_damaged_buffers_file_is_one_line(tmp_path):
    slot = tmp_path / "vae_decoder"
    slot.mkdir()
    _ltx_vae().save_config(str(slot))
    (slot / buffers.FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(UsageError, match=r"buffers\.safetensors' cannot be read .*convert the pipeline folder again"):
        _meta_module(tmp_path, ["diffusers", "AutoencoderKLLTXVideo"], {"decode": ("vae_decoder", {})})


def _dit_pipeline():
    torch.manual_seed(0)
    transformer = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                                  out_channels=8, num_layers=1, sample_size=8, patch_size=2,
                                                  num_embeds_ada_norm=10, norm_num_groups=1)
    vae = diffusers.AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,),
                                  down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                                  norm_num_groups=4, layers_per_block=1)
    return diffusers.DiTPipeline(transformer=transformer, vae=vae, scheduler=diffusers.DDIMScheduler())


def test_pipeline_with_weights_left_on_meta_is_refused_in_one_line(tmp_path, monkeypatch):
    """from_pretrained (a lazy load, an incomplete folder) returning a pipeline with weights on the
    meta device: build refuses it in one line naming them, before anything runs."""
    from normexport.load import pipeline as folder_pipeline

    index = {"_class_name": "DiTPipeline", "_diffusers_version": diffusers.__version__,
             "transformer": ["diffusers", "DiTTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
             "scheduler": ["diffusers", "DDIMScheduler"]}
    for n in ("transformer", "vae", "scheduler"):
        (tmp_path / n).mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    pipe = _dit_pipeline()
    monkeypatch.setattr(folder_pipeline, "_from_pretrained", lambda *a, **k: pipe)
    assert folder_pipeline.build(tmp_path, index) is pipe  # all weights with values: built
    w = pipe.transformer.proj_out_2.weight
    pipe.transformer.proj_out_2.weight = torch.nn.Parameter(torch.empty(w.shape, device="meta"))
    with pytest.raises(UsageError) as e:
        folder_pipeline.build(tmp_path, index)
    msg = str(e.value)
    assert "\n" not in msg and "1 weight(s) left on the meta device" in msg
    assert "transformer.proj_out_2.weight" in msg and "Cannot copy" not in msg


def test_model_folder_with_weights_left_on_meta_is_refused_in_one_line(tmp_path, monkeypatch):
    import transformers

    from normexport.load import pretrained

    model = transformers.T5EncoderModel(transformers.T5Config(vocab_size=16, d_model=16, d_kv=8, d_ff=32,
                                                              num_layers=1, num_heads=2))
    model.save_pretrained(tmp_path)
    loaded, _ = pretrained.load_module(tmp_path)  # a complete folder loads
    assert not any(p.is_meta for p in loaded.parameters())
    real = pretrained._load_weights

    def lazy(cls, path):  # a load that leaves one weight without values
        m = real(cls, path)
        m.encoder.final_layer_norm.weight = torch.nn.Parameter(torch.empty(16, device="meta"))
        return m

    monkeypatch.setattr(pretrained, "_load_weights", lazy)
    with pytest.raises(UsageError, match=r"^cannot load .* as T5EncoderModel: 1 weight\(s\) left on the meta device "
                                         r"by from_pretrained, with no values \(encoder\.final_layer_norm\.weight\)"):
        pretrained.load_module(tmp_path)
