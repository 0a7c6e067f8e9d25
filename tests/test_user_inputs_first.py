"""Issue 40: the user's call wins before anything is invented (a folder whose made-up inputs its
forward refuses converts with `--inputs`); a component folder inside a pipeline repo is run
through its pipeline; DiTPipeline's required `class_labels` are filled from its signature and
the transformer's number of classes."""

from __future__ import annotations

import pytest
import torch

import normexport

from _new_families import convert, ops
from _pipelines import build

diffusers = pytest.importorskip("diffusers")


def hunyuan_folder(d):
    """HunyuanDiT2DModel (real class, tiny): its pooler wants exactly text_len_t5 tokens and a
    RoPE table, which the inputs normexport makes from the config do not give."""
    torch.manual_seed(0)
    m = diffusers.HunyuanDiT2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, patch_size=2,
                                    sample_size=8, num_layers=2, cross_attention_dim=16, cross_attention_dim_t5=16,
                                    pooled_projection_dim=8, text_len=8, text_len_t5=8, hidden_size=16)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape))
    m.save_pretrained(d / "hunyuan")
    return m.eval(), d / "hunyuan"


def hunyuan_call(m, batch=2):
    """The call HunyuanDiTPipeline makes (RoPE from diffusers' own helper, masks, meta size, style)."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(batch, 4, 8, 8, generator=g), timestep=torch.tensor([500.0] * batch),
                encoder_hidden_states=torch.randn(batch, 8, 16, generator=g),
                text_embedding_mask=torch.ones(batch, 8, dtype=torch.long),
                encoder_hidden_states_t5=torch.randn(batch, 8, 16, generator=g),
                text_embedding_mask_t5=torch.ones(batch, 8, dtype=torch.long),
                image_meta_size=torch.tensor([[64.0, 64, 64, 64, 0, 0]] * batch), style=torch.zeros(batch, dtype=torch.long),
                image_rotary_emb=get_2d_rotary_pos_embed(8, ((0, 0), (4, 4)), (4, 4), use_real=True), return_dict=False)


def test_inputs_file_wins_over_invented_inputs(cli, tmp_path, monkeypatch):
    """Bare, the folder is refused (the made-up call fails in its forward; no pipeline class drives
    it here: normexport/load/standin.py switched off); with --inputs holding the real call it
    converts and passes parity. Before the fix, the made-up call was probed at load time and the
    --inputs run was refused with the same message."""
    from normexport.load import standin

    m, folder = hunyuan_folder(tmp_path)
    with monkeypatch.context() as off:
        off.setattr(standin, "record", lambda *a, **k: (_ for _ in ()).throw(standin.StandInError("off")))
        code, _, err = cli("convert", folder, "-o", tmp_path / "bare.onnx")
    assert code == 2 and "forward refused the example inputs normexport made" in err, err
    with normexport.capture(m, tmp_path / "inputs.pt", quiet=True):
        m(**hunyuan_call(m))
    out = tmp_path / "hy.onnx"
    stdout, rep, errs = convert(cli, folder, out, "--inputs", tmp_path / "inputs.pt")
    assert [i["name"] for i in rep["inputs"]][:3] == ["hidden_states", "timestep", "encoder_hidden_states"], rep["inputs"]
    assert rep["inputs"][0]["shape"] == [2, 4, 8, 8]
    assert max(errs) < 1e-4, errs
    assert not (tmp_path / "bare.onnx").exists()


def test_component_folder_inside_a_pipeline_repo_runs_the_pipeline(cli, tmp_path):
    """repo/transformer/ beside repo/model_index.json: the parent DiTPipeline is run (its class
    labels filled from the transformer's 1000 classes) and the transformer kept, said first."""
    folder = build("dit", tmp_path)
    out = tmp_path / "t.onnx"
    stdout, rep, errs = convert(cli, folder / "transformer", out)
    first = stdout.splitlines()[0]
    assert first.startswith(f"{folder / 'transformer'} is the transformer of the DiTPipeline in {folder}: ran that "
                            "pipeline once and kept transformer"), first
    shapes = {i["name"]: i["shape"] for i in rep["inputs"]}
    assert shapes["hidden_states"] == [2, 4, 8, 8] and shapes["class_labels"] == [2], shapes  # CFG batch
    assert ops(out)["AdaLNZero"] >= 2, ops(out)
    assert max(errs) < 1e-4, errs


def test_dit_pipeline_folder_class_labels(cli, tmp_path):
    """DiTPipeline.__call__(class_labels: List[int]) has no default: filled as [1] (< the config's
    num_embeds_ada_norm); the pipeline folder converts its denoiser."""
    from normexport.load import pipeline

    folder = build("dit", tmp_path)
    pipe = diffusers.DiTPipeline.from_pretrained(str(folder), local_files_only=True)
    modules = {n: c for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    kwargs, _ = pipeline.call_arguments(pipe, modules, folder, None)
    assert kwargs["class_labels"] == [1] and "prompt" not in kwargs, kwargs
    # no class count in any config: nothing to fill from, the refusal names the argument
    pipe.transformer.register_to_config(num_embeds_ada_norm=None)
    with pytest.raises(normexport.errors.UsageError, match="needs class_labels"):
        pipeline.call_arguments(pipe, modules, folder, None)


def test_component_save_pretrained_skipped_is_not_refused(tmp_path):
    """save_pretrained writes model_index.json from the pipeline's config but saves only the
    components its __init__ takes: an extra one registered on the pipeline (here a second
    scheduler) is named with its class and has no folder. from_pretrained loads such a folder; so
    does normexport (it refused it as incomplete before)."""
    import json

    from normexport.load import pipeline

    torch.manual_seed(0)
    folder = build("dit", tmp_path)
    pipe = diffusers.DiTPipeline.from_pretrained(str(folder), local_files_only=True)
    pipe.register_modules(extra_scheduler=diffusers.DDIMScheduler())
    pipe.save_pretrained(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["extra_scheduler"] == ["diffusers", "DDIMScheduler"] and not (tmp_path / "saved" / "extra_scheduler").exists()
    diffusers.DiffusionPipeline.from_pretrained(str(tmp_path / "saved"), local_files_only=True)  # the library loads it
    built = pipeline.build(tmp_path / "saved", index)
    assert type(built).__name__ == "DiTPipeline"
    # a component the class needs, its folder removed: still refused, one line naming it
    import shutil

    shutil.rmtree(tmp_path / "saved" / "vae")
    with pytest.raises(normexport.errors.UsageError, match=r"no folder there: vae \(AutoencoderKL\)"):
        pipeline.build(tmp_path / "saved", index)
