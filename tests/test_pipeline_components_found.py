"""Issue 46 items 3 and 6: every neural component a pipeline runs is found and exported for the call
the pipeline makes, whatever its scheduler or the component's class.

- Item 3, LongCatAudioDiTPipeline (diffusers 0.42.1, tiny real config, random weights): its
  `__init__` makes its own scheduler (an `__init__` parameter with a default, so `pipe.components`
  leaves it out and save_pretrained writes no folder for it), and its audio VAE is a
  LongCatAudioDiTVae (no "Autoencoder" in the class name) that the pipeline calls through `decode`.
  The recording finds the decoder with the latents the pipeline decodes (against the eager
  pipeline's own final latents), the single-component path finds the denoiser by the scheduler's
  first step, and load() rebuilds the pipeline with the class's own scheduler, as from_pretrained does.
- Item 6, a LlamaForCausalLM read for its hidden states (HiDream's text_encoder_4): the pipeline
  slot is exported for its recorded call (input_ids, attention_mask, output_hidden_states=True),
  not as the KV-cache graph; its file's hidden states agree with the float64 eager model.
- `check` on a folder convert did not write says so (not "is a single file").

Planted (each seen failing once, then removed): `registered` replaced by `pipe.components`
(the single-file path refuses: "has no scheduler whose step would tell its denoiser"); the class-name
test of `_is_autoencoder` restored (no vae_decoder slot); `ns.task = None` in _export_slot (the
Llama slot fails: the KV-cache graph "got an unexpected keyword argument 'input_ids'"); the old check
message; the MoE's dense form switched off; the einsum promotion switched off.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from _pipelines import _perturb, word_tokenizer

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")


def _longcat(d: Path) -> Path:
    torch.manual_seed(0)
    tr = diffusers.LongCatAudioDiTTransformer(dit_dim=16, dit_depth=2, dit_heads=2, dit_text_dim=32, latent_dim=4,
                                              ff_mult=2.0)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # the output projection starts at zero: moved off it, so the denoiser's output shows
        for p in tr.parameters():
            if not p.abs().gt(0).any():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    vae = diffusers.LongCatAudioDiTVae(in_channels=1, channels=4, c_mults=[1, 2], strides=[2, 2], latent_dim=4,
                                       encoder_latent_dim=8, downsampling_ratio=4, sample_rate=64)
    umt5 = transformers.UMT5EncoderModel(transformers.UMT5Config(
        vocab_size=16, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2)).eval()
    pipe = diffusers.LongCatAudioDiTPipeline(vae=vae.eval(), text_encoder=umt5, tokenizer=word_tokenizer(),
                                             transformer=_perturb(tr).eval())
    pipe.save_pretrained(d / "longcat")
    return d / "longcat"


@pytest.fixture(scope="module")
def longcat(tmp_path_factory):
    return _longcat(tmp_path_factory.mktemp("longcat"))


def test_longcat_scheduler_not_saved(longcat):
    """The setting of item 3: model_index.json names the scheduler, save_pretrained wrote no folder."""
    index = json.loads((longcat / "model_index.json").read_text())
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    assert not (longcat / "scheduler").exists()


def test_longcat_recording_finds_audio_vae_decoder(longcat):
    from normexport.load import pipeline as folder_pipeline
    from normexport.pipeline import recording

    index = json.loads((longcat / "model_index.json").read_text())
    rec = recording.record(longcat, index)
    assert list(rec.slots) == ["text_encoder", "transformer", "vae_decoder"], list(rec.slots)
    # its UMT5 tokenizer pads to the longest prompt: the one-prompt run's longer prompt makes the text axis vary at
    # the converted size, so the files keep it dynamic (a generated prompt of another length is served; the swept
    # LongCat had refused 'input_ids [1, 5] (the file takes [2, 2])')
    text = rec.slots["text_encoder"]
    assert text.dynamic(at_size=True).get("input_ids") == [0, 1], text.dynamic(at_size=True)
    assert 1 in rec.slots["transformer"].dynamic(at_size=True).get("encoder_hidden_states", []), \
        rec.slots["transformer"].dynamic(at_size=True)
    slot = rec.slots["vae_decoder"]
    assert slot.method == "decode" and slot.component == "vae"
    got = slot.kwargs["latents"].double().numpy()
    # the reference: the eager pipeline's own final latents for the same (two-prompt, seeded) call, as it hands
    # them to decode (B, latent_dim, T)
    pipe = folder_pipeline.build(longcat, index)
    kwargs, _ = folder_pipeline.call_arguments(pipe, {}, longcat, None)
    call = {**kwargs, "prompt": [kwargs["prompt"]] * 2, "output_type": "latent",
            "generator": torch.Generator().manual_seed(0)}
    with torch.no_grad():
        want = pipe(**call).audios.permute(0, 2, 1).double().numpy()
    assert got.shape == want.shape == (2, 4, want.shape[2])
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_longcat_single_file_finds_denoiser(longcat, tmp_path):
    """`convert PIPELINE_DIR` (one file): the denoiser is the module called last before the first
    step of the scheduler the class made itself."""
    from normexport.load import pipeline as folder_pipeline

    index = json.loads((longcat / "model_index.json").read_text())
    model = folder_pipeline.record(longcat, index, None, tmp_path / "inputs.pt")
    assert type(model.module).__name__ == "LongCatAudioDiTTransformer"
    assert "the denoiser" in model.headline
    args, kwargs = torch.load(tmp_path / "inputs.pt", weights_only=True)
    assert kwargs["hidden_states"].shape[0] == 1 and kwargs["hidden_states"].shape[2] == 4


def test_runtime_leaves_out_a_component_with_a_default(longcat):
    """load() builds the class as from_pretrained does: a component with no folder whose `__init__`
    parameter has a default is not passed (the class makes its own)."""
    from normexport.pipeline import runtime

    assert runtime._has_default(diffusers.LongCatAudioDiTPipeline, "scheduler")
    assert not runtime._has_default(diffusers.LongCatAudioDiTPipeline, "vae")
    assert not runtime._has_default(diffusers.StableDiffusionPipeline, "safety_checker")


def test_causal_lm_component_exported_for_its_call(tmp_path):
    """A LlamaForCausalLM slot recorded as HiDream calls text_encoder_4 (input_ids, attention_mask,
    output_hidden_states=True): exported for that call, its hidden states as eager's (float64)."""
    import onnxruntime as ort

    from normexport.cli import build_parser
    from normexport.pipeline import exporting
    from normexport.pipeline.recording import Slot

    torch.manual_seed(0)
    llama = _perturb(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=1, eos_token_id=1))).eval()
    src = tmp_path / "src"
    llama.save_pretrained(src / "text_encoder_4")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 16, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.int64)
    mask[1, 4:] = 0  # a padded row, as the pipeline's max_length padding gives
    kwargs = {"input_ids": ids, "attention_mask": mask, "output_hidden_states": True}
    slot = Slot("text_encoder_4", "text_encoder_4", "forward", (), kwargs,
                shapes=[{"input_ids": [2, 6], "attention_mask": [2, 6]}])
    args = build_parser().parse_args(["convert", str(src), "-o", str(tmp_path / "out") + "/"])
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    entry = exporting._export_slot(args, src, slot, tmp)
    assert entry is not None, "the causal LM's slot failed to export"
    assert "input_ids" in entry["inputs"] and "attention_mask" in entry["inputs"]
    sess = ort.InferenceSession(str(tmp / entry["file"]), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    feeds = {i.name: {"input_ids": ids, "attention_mask": mask}[i.name].numpy() for i in sess.get_inputs()}
    outs = dict(zip(names, sess.run(None, feeds)))
    hidden = [n for n in names if n.startswith("hidden_states")]
    assert len(hidden) == 3, names  # embeddings + 2 layers: what HiDream reads (outputs.hidden_states[1:])
    ref = llama.double()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    for n, w in zip(sorted(hidden, key=lambda s: int(s.rsplit(".", 1)[-1]) if s[-1].isdigit() else 0), want):
        got = outs[n]
        w = w.numpy()
        valid = mask.bool().numpy()  # padded positions are not compared (their values are the model's business)
        np.testing.assert_allclose(got[valid], w[valid], rtol=0, atol=2e-5 * max(1.0, np.abs(w).max()))


def test_check_on_a_folder_convert_did_not_write(longcat, tmp_path, capsys):
    from normexport.cli import main

    missing = tmp_path / "out"
    assert main(["check", str(missing), "--reference", str(longcat), "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not exist" in err and "single file" not in err and "\n" not in err, err
    (tmp_path / "empty").mkdir()
    assert main(["check", str(tmp_path / "empty"), "--reference", str(longcat)]) == 2
    err = capsys.readouterr().err.strip()
    assert "normexport_pipeline.json" in err and "single file" not in err, err


def test_data_dependent_moe_runs_densely_for_export(tmp_path):
    """HiDream's MoE feed-forward (diffusers' MOEFeedForwardSwiGLU: tokens sorted per expert, counts read
    with .cpu().numpy()) exported through prepare's dense form; the file's output against numpy float64
    from the formulas (softmax gate, top-2 weights, SwiGLU experts, shared experts). Planted: the dense
    form switched off, the dynamo export fails (".numpy() is not supported for tensor subclasses")."""
    import onnxruntime as ort

    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    from normexport.prepare.for_export import prepare_for_export

    torch.manual_seed(0)
    moe = MOEFeedForwardSwiGLU(dim=16, hidden_dim=24, num_routed_experts=4, num_activated_experts=2).eval()
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(5))
    report: dict = {}
    module, _ = prepare_for_export(moe, (x,), target="ort", report=report)
    assert [r["action"] for r in report["implementations"] if r["to"] == "dense"] == ["switched"], report
    onnx_file = tmp_path / "moe.onnx"
    torch.onnx.export(module, (x,), str(onnx_file), dynamo=True, input_names=["x"])
    got = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]

    def w(lin):
        return lin.weight.detach().double().numpy()

    def swiglu(e, h):
        a = h @ w(e.w1).T
        return ((a / (1 + np.exp(-a))) * (h @ w(e.w3).T)) @ w(e.w2).T

    h = x.double().numpy().reshape(-1, 16)
    logits = h @ moe.gate.weight.detach().double().numpy().T
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    top = np.argsort(-scores, axis=-1)[:, :2]
    want = swiglu(moe.shared_experts, h)
    for k in range(2):
        for i, e in enumerate(moe.experts):
            chosen = (top[:, k] == i)[:, None]
            want = want + np.where(chosen, scores[np.arange(len(h)), top[:, k]][:, None] * swiglu(e, h), 0.0)
    want = want.reshape(2, 12, 16)
    assert np.abs(want).max() > 0.05
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_mixed_dtype_einsum_exports(tmp_path):
    """HiDream's RoPE table (diffusers' HiDreamImageEmbedND: float32 positions x a float64 frequency
    table through torch.einsum, which eager promotes) exported by normexport's dynamo rung; the file
    against numpy float64 from the formula. Planted: promoted_einsum a no-op: torch's translation
    writes an Einsum of mixed types, which onnxruntime refuses to load (in normexport's full path the
    export stops at shape inference: "Einsum ... Inputs has inconsistent type tensor(double)")."""
    import onnx
    import onnxruntime as ort

    from diffusers.models.transformers.transformer_hidream_image import HiDreamImageEmbedND

    from normexport.exporter import rungs

    embed = HiDreamImageEmbedND(theta=10000, axes_dim=[4, 2, 2]).eval()
    ids = torch.rand(2, 6, 3, generator=torch.Generator().manual_seed(4)) * 8  # float32 (row, column) ids
    model = rungs._torch_onnx_export(embed, (ids,), ["ids"], None, None, 18)
    import onnx_ir as ir

    path = tmp_path / "rope.onnx"
    onnx.save(ir.serde.serialize_model(model), str(path))
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"ids": ids.numpy()})[0]
    parts = []
    for i, dim in enumerate([4, 2, 2]):
        omega = 1.0 / 10000.0 ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        out = ids[..., i].double().numpy()[..., None] * omega  # (B, S, dim/2)
        stacked = np.stack([np.cos(out), -np.sin(out), np.sin(out), np.cos(out)], axis=-1)
        parts.append(stacked.reshape(2, 6, dim // 2, 2, 2))
    want = np.concatenate(parts, axis=-3)[:, :, None]
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
