"""Issue 46: a PAG pipeline (diffusers' PAGMixin: StableDiffusionPAGPipeline here; SDXL, PixArt-Sigma,
Sana, SD3 share the mixin) sets its perturbed layers' attention processors on the denoiser inside its own
call (`_set_pag_attn_processor`, only with pag_scale > 0) and restores them after it. The loaded
pipeline's denoiser had no modules ('Cannot find PAG layer to set attention processor for: mid') and its
one file held the default processors. Now convert records each processor state the pipeline called the
denoiser in (the pipeline's call, and the same with pag_scale=0), exports one file per state (the PAG one
with the PAG processors set), and the loaded pipeline's own switch runs on the component's meta module,
which selects the file (pipeline/recording.py, exporting.py, runtime.py).

The tiny real pipeline of tools/try_pipeline_families.py ("sd_pag"), converted without the per-file
parity run (the test compares the pipeline's images itself), generated with PAG on (its default
pag_scale 3) and off (pag_scale=0: no PAG processors, the denoiser at guidance's batch), each against
eager float32; a state no file holds (PAG without classifier-free guidance: another processor class) is
refused in one line.

Planted (seen failing once, then removed): the runtime's selection off (the component's processors read
as its own: the default file serves the PAG call): the PAG-on image is 0.19 from eager's (the test stopped there).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

PAG_SLOT = "unet_PAGCFGIdentitySelfAttnProcessor2_0"
LAYER = "mid_block.attentions.0.transformer_blocks.0.attn1.processor"


def _images(pipe, **kw):
    call = dict(prompt="a photo of a cat", num_inference_steps=2, height=64, width=64, output_type="np")
    with torch.no_grad():
        return pipe(**call, **kw, generator=torch.Generator().manual_seed(0)).images


def test_pag_pipeline_generates_as_eager_with_pag_on_and_off(tmp_path):
    from try_pipeline_families import build

    import normexport.pipeline
    from normexport.cli import main

    folder = build("sd_pag", tmp_path)
    out = tmp_path / "out"
    assert main(["convert", str(folder), "-o", f"{out}/", "--no-check"]) == 0
    slots = json.loads((out / "normexport_pipeline.json").read_text())["slots"]
    assert set(slots) == {"text_encoder", "unet", PAG_SLOT, "vae_decoder"}, slots.keys()
    assert slots[PAG_SLOT]["attn_processors"] == {LAYER: "PAGCFGIdentitySelfAttnProcessor2_0"}
    assert "attn_processors" not in slots["unet"] and slots[PAG_SLOT]["component"] == "unet"
    assert "batch" not in slots[PAG_SLOT]  # its samples are not computed apart: never run in pieces

    pipe = normexport.pipeline.load(out)
    eager = diffusers.StableDiffusionPAGPipeline.from_pretrained(folder)
    eager.set_progress_bar_config(disable=True)
    got = {pag: _images(pipe, pag_scale=pag) for pag in (3.0, 0.0)}
    for pag, image in got.items():
        err = float(np.abs(image - _images(eager, pag_scale=pag)).max())
        assert err < 1e-4, (pag, err)
    assert np.abs(got[3.0] - got[0.0]).max() > 1e-2  # PAG changes the image: the two files are not the same
    assert pipe.unet.changed_processors() == {}  # the pipeline's restore reached the meta module

    with pytest.raises(RuntimeError, match=r"PAGIdentitySelfAttnProcessor2_0 on 1 layers, which no exported file "
                                           r"holds .*convert the pipeline with a call that sets them"):
        _images(pipe, guidance_scale=1.0)  # PAG without guidance: the pipeline's other PAG processor
