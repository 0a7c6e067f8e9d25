"""A pipeline whose schedule cannot be one step long is recorded from two-step runs (issue 46, "Prove it
broadly": tools/try_pipeline_families.py's MochiPipeline).

MochiPipeline (diffusers 0.42.1) builds its sigmas with `linear_quadratic_schedule(num_steps, ...)`, which
divides by `num_steps // 2`: the folder convert's one-step recording runs stopped with "ZeroDivisionError:
division by zero" before any component was recorded. The recording now runs the same three calls two steps
long when the one-step run fails (pipeline/recording.py, record), and every component the pipeline calls is
found. Tiny real config (random weights), the recording alone (no export).

Planted (seen failing once, then removed): the two-step retry off (UsageError naming the ZeroDivisionError).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _pipelines import _perturb, t5, word_tokenizer

diffusers = pytest.importorskip("diffusers")


def _mochi(d: Path) -> Path:
    torch.manual_seed(0)
    tr = diffusers.MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=1, pooled_projection_dim=16,
        in_channels=12, out_channels=None, qk_norm="rms_norm", text_embed_dim=32, time_embed_dim=4,
        activation_fn="swiglu", max_sequence_length=16)
    vae = diffusers.AutoencoderKLMochi(latent_channels=12, out_channels=3, encoder_block_out_channels=(32,) * 4,
                                       decoder_block_out_channels=(32,) * 4, layers_per_block=(1, 1, 1, 1, 1))
    tok = word_tokenizer()
    tok.model_max_length = 16
    pipe = diffusers.MochiPipeline(transformer=_perturb(tr), vae=vae.eval(),
                                   scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), text_encoder=t5(32),
                                   tokenizer=tok)
    pipe.save_pretrained(d / "mochi")
    return d / "mochi"


def test_mochi_schedule_needs_two_steps_recorded(tmp_path):
    from diffusers.pipelines.mochi.pipeline_mochi import linear_quadratic_schedule

    from normexport.pipeline import recording

    with pytest.raises(ZeroDivisionError):  # the pipeline's own: one step cannot be scheduled
        linear_quadratic_schedule(1, 0.025)
    folder = _mochi(tmp_path)
    rec = recording.record(folder, json.loads((folder / "model_index.json").read_text()))
    assert {"text_encoder", "transformer", "vae_decoder"} <= set(rec.slots), sorted(rec.slots)
    # the denoiser's batch recorded from the two-prompt run: classifier-free guidance doubles it
    first = rec.slots["transformer"].shapes[0]
    assert next(v for k, v in first.items() if k.startswith("hidden_states"))[0] == 4, first
