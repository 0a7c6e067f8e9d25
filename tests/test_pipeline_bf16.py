"""A bfloat16 pipeline folder (real sizes are mostly bf16) converts, loads and generates in
onnxruntime's CPU provider, which has no bfloat16 MatMul: each bf16 file runs through the project's
one onnxruntime runner widened to float32 (parity.runners.OrtRunner, docs/design.md §8), its inputs and
outputs in the file's own dtype, and every component says its own dtype as eager does (the
manifest's `dtype`: PixArt casts the prompt embeddings to `text_encoder.dtype`, whose only inputs
are token ids). Planted: the component dtype read from the inputs again (float32 for the text
encoder): the transformer is then fed float32 and the per-component check fails."""

from __future__ import annotations

import json

import pytest
import torch

from _pipelines import build

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def bf16_pixart(tmp_path_factory):
    from normexport.cli import main

    d = tmp_path_factory.mktemp("pixart_bf16")
    build("pixart", d / "fp32")
    pipe = diffusers.PixArtAlphaPipeline.from_pretrained(str(d / "fp32" / "pixart"))
    folder = d / "pixart_bf16"
    pipe.to(torch.bfloat16).save_pretrained(folder)
    out = d / "out"
    assert main(["convert", str(folder), "-o", f"{out}/"]) == 0
    return folder, out


def test_bf16_folder_loads_and_generates(bf16_pixart, capsys):
    from normexport.pipeline import load

    _, out = bf16_pixart
    manifest = json.loads((out / "normexport_pipeline.json").read_text())
    assert {e["dtype"] for e in manifest["slots"].values()} == {"bfloat16"}, manifest["slots"]
    pipe = load(out)
    assert "run widened to float32" in capsys.readouterr().out
    assert pipe.text_encoder.dtype == torch.bfloat16 and pipe.transformer.dtype == torch.bfloat16
    ids = torch.randint(3, 8, (1, 120), generator=torch.Generator().manual_seed(0))
    emb = pipe.text_encoder(ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    assert emb.dtype == torch.bfloat16 and torch.isfinite(emb.float()).all()
    image = pipe("a photo of a cat", num_inference_steps=2, height=64, width=64, output_type="np",
                 use_resolution_binning=False, generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 64, 64, 3) and image.std() > 0


def test_bf16_check_end_to_end(bf16_pixart, tmp_path):
    from normexport.cli import main

    folder, out = bf16_pixart
    report = tmp_path / "check.json"
    code = main(["check", str(out), "--reference", str(folder), "--steps", "4", "--json", str(report)])
    rep = json.loads(report.read_text())
    assert code == 0 and rep["passed"], rep
    assert all(c["passed"] for c in rep["components"].values()), rep["components"]
    assert rep["image"]["max_abs_err"] <= rep["image"]["limit"], rep["image"]
