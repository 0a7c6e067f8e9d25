"""Issue 46 items 1 and 2: a pipeline component called at another batch than the one its file was
exported at (pipeline/batching.py).

Item 1, a file whose batch no exporter keeps dynamic: diffusers' DiTPipeline with its VAE's
exporter rungs failing whenever a dim is asked to stay dynamic, the way a video VAE's did
("symbolically traced variables cannot be used as inputs to control flow"; the failure is injected,
the classes are real). The decoder's `latent_sample` follows the batch by recording (the two-label
run decodes 2, the one-label run 1), so the fallback rungs run: static from the one-label call; the
manifest says what follows the batch, and the loaded pipeline decodes one label and three (pieces
of one) and matches eager, while its transformer (batch dynamic) is called at 2 and 6 with guidance.

Item 2, lists whose length follows the batch: diffusers' ZImagePipeline calls its
ZImageTransformer2DModel with `x` and `cap_feats` as lists of one tensor per sample (and `t` of the
same batch); convert records the two-prompt run (four samples with guidance), so the file takes
x.0..x.3, each sample's text length fixed at its position (the prompts first, the empty negative
prompts after). The loaded pipeline generates one prompt (two samples) and three (six) by running
the file in pieces of four, each sample at a position its text fits, the rest padded, and matches
the eager pipeline.

Planted and seen failing: batching.split switched off (returns None): `transformer.forward called
without x.2, x.3, cap_feats.2, cap_feats.3`, and `vae.decode called with latent_sample [3, ...]:
keeps those sizes static`; batching.recorded returning {} (no batch recorded): the VAE file static
at the two-label batch, refused for one label.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from _pipelines import _perturb, converted_unchecked, vae, word_tokenizer

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")


def _zimage(d):
    """A tiny ZImagePipeline (Qwen3 text encoder read for its hidden states, the list-taking transformer)."""
    torch.manual_seed(0)
    transformer = diffusers.ZImageTransformer2DModel(
        in_channels=4, dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16,
        axes_dims=[4, 6, 6], axes_lens=[64, 32, 32])
    qwen = transformers.Qwen3Model(transformers.Qwen3Config(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0)).eval()
    tok = word_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    pipe = diffusers.ZImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae(shift_factor=0.1, scaling_factor=0.5),
        text_encoder=_perturb(qwen), tokenizer=tok, transformer=_perturb(transformer.eval()))
    pipe.save_pretrained(d / "zimage")
    return d / "zimage"


#: the call both pipelines make; the prompt has convert's token count: the transformer's file fixes each
#: sample's text length (cap_feats.N), which its exporter cannot keep dynamic (not this test's concern)
ZCALL = dict(num_inference_steps=2, height=64, width=64, output_type="np")
PROMPT = "a photo"


@pytest.fixture(scope="module")
def zimage(tmp_path_factory):
    return converted_unchecked(_zimage, tmp_path_factory, "zimage")


def test_list_inputs_whose_length_follows_the_batch(zimage):
    import normexport.pipeline

    folder, out = zimage
    entry = json.loads((out / "normexport_pipeline.json").read_text())["slots"]["transformer"]
    assert entry["batch"] == {"inputs": ["t"], "lists": ["cap_feats", "x"]}, entry.get("batch")
    held = sorted(n for n in entry["inputs"] if n.startswith("x."))
    assert held == ["x.0", "x.1", "x.2", "x.3"], held  # the two-prompt run with guidance: four samples
    pipe = normexport.pipeline.load(out)
    eager = diffusers.DiffusionPipeline.from_pretrained(str(folder), local_files_only=True)
    for prompt in (PROMPT, [PROMPT] * 3):  # two samples, six: pieces of four
        got = pipe(prompt, generator=torch.Generator().manual_seed(0), **ZCALL).images
        want = eager(prompt, generator=torch.Generator().manual_seed(0), **ZCALL).images
        n = 1 if isinstance(prompt, str) else len(prompt)
        assert got.shape == want.shape == (n, 64, 64, 3)
        assert np.isfinite(got).all() and want.std() > 0.01
        assert np.abs(got - want).max() < 1e-3, np.abs(got - want).max()


@pytest.fixture(scope="module")
def dit_static_vae(tmp_path_factory):
    from _pipelines import build

    from normexport.cli import main
    from normexport.exporter import rungs

    d = tmp_path_factory.mktemp("dit")
    folder = build("dit", d)
    out = d / "out"

    def is_vae(module):
        return any(isinstance(m, diffusers.AutoencoderKL) for m in module.modules())

    def refusing(export):
        def rung(module, args, names, output_names, dynamic_axes, *a, **k):
            if dynamic_axes and is_vae(module):
                raise RuntimeError("symbolically traced variables cannot be used as inputs to control flow")
            return export(module, args, names, output_names, dynamic_axes, *a, **k)
        return rung

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rungs, "dynamo", refusing(rungs.dynamo))
        mp.setattr(rungs, "torchscript", refusing(rungs.torchscript))
        assert main(["convert", str(folder), "-o", f"{out}/", "--no-check"]) == 0  # compared with eager below
    return folder, out


def test_a_file_with_a_static_batch_serves_other_batches(dit_static_vae):
    import normexport.pipeline

    folder, out = dit_static_vae
    pipe = normexport.pipeline.load(out)
    eager = diffusers.DiffusionPipeline.from_pretrained(str(folder), local_files_only=True)
    for labels in ([3], [3, 5, 7]):
        kw = dict(class_labels=labels, num_inference_steps=2, output_type="np")
        got = pipe(generator=torch.Generator().manual_seed(0), **kw).images
        want = eager(generator=torch.Generator().manual_seed(0), **kw).images
        assert got.shape == want.shape == (len(labels), 64, 64, 3)
        assert want.std() > 0.01 and np.abs(got - want).max() < 1e-3, np.abs(got - want).max()
    slots = json.loads((out / "normexport_pipeline.json").read_text())["slots"]
    vae_entry = slots["vae_decoder"]
    assert vae_entry["batch"] == {"inputs": ["latent_sample"]}, vae_entry.get("batch")
    assert vae_entry["inputs"]["latent_sample"]["dynamic"] == [], vae_entry["inputs"]  # the exporter kept nothing
    assert 0 in slots["transformer"]["inputs"]["hidden_states"]["dynamic"]  # the denoiser's batch stays dynamic
