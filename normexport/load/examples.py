"""Example inputs, in one place: what a module declares (`example_inputs()`, `input_names`,
`dynamic_axes`), and what normexport derives for a pretrained model from its forward signature
and config.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..errors import UsageError
from ._util import short

BATCH, SEQ, TEXT_SEQ = 2, 8, 6


def declared_inputs(module: nn.Module):
    """Example inputs, names and dynamic axes a module may declare (see models/)."""
    fn = getattr(module, "example_inputs", None)
    example = None
    if callable(fn):
        name = type(module).__name__
        try:
            example = fn()
        except Exception as e:
            raise UsageError(f"{name}.example_inputs() raised {type(e).__name__} ({short(e)}): fix it, "
                             "or remove it and pass --input NAME:DIMS[:DTYPE]") from None
        if isinstance(example, torch.Tensor):
            example = (example,)
        if not isinstance(example, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in example):
            got = type(example).__name__ if not isinstance(example, (tuple, list)) else \
                "a " + type(example).__name__ + " of " + ", ".join(sorted({type(t).__name__ for t in example}))
            raise UsageError(f"{name}.example_inputs() returned {got}, not a tuple of tensors: "
                             "return tensors, or pass --input NAME:DIMS[:DTYPE]")
        example = tuple(example)
    return example, getattr(module, "input_names", None), getattr(module, "dynamic_axes", None)




#: inputs whose first axis is the batch (and, for token ids, the second the sequence)
BATCHED = ("input_ids", "attention_mask", "hidden_states", "timestep", "class_labels", "encoder_hidden_states",
            "pooled_projections", "guidance", "encoder_attention_mask", "pixel_values", "sample")


def _cfg(config, *names, default=None):
    for n in names:
        v = config.get(n) if isinstance(config, dict) else getattr(config, n, None)
        if v is not None:
            return v
    return default


def example_kwargs(model, library: str) -> dict[str, torch.Tensor]:
    """Random example inputs (keyword, by forward parameter) that fit the model class."""
    gen = torch.Generator().manual_seed(0)
    config = model.config
    params = forward_parameters(model)
    if library == "transformers":
        name = getattr(model, "main_input_name", "input_ids")
        if name == "input_ids":
            vocab = int(_cfg(config, "vocab_size", default=32))
            return {"input_ids": torch.randint(0, vocab, (BATCH, SEQ), generator=gen)}
        raise UsageError(f"{type(model).__name__} takes '{name}', for which normexport makes no example input: "
                         f"pass --input {name}:DIMS[:DTYPE]")
    out: dict[str, torch.Tensor] = {}
    in_ch = int(_cfg(config, "in_channels", default=4))
    size = int(_cfg(config, "sample_size", default=8) or 8)
    text_dim = _cfg(config, "joint_attention_dim", "cross_attention_dim", "caption_channels")
    for p in params:
        if p == "hidden_states":
            if "img_ids" in params:  # Flux: packed latents [B, tokens, C]
                out[p] = torch.randn(BATCH, SEQ, in_ch, generator=gen)
            else:
                out[p] = torch.randn(BATCH, in_ch, size, size, generator=gen)
        elif p == "timestep":
            out[p] = (torch.rand(BATCH, generator=gen) if "img_ids" in params
                      else torch.randint(1, 1000, (BATCH,), generator=gen))
        elif p == "class_labels" and _cfg(config, "num_embeds_ada_norm"):
            out[p] = torch.randint(0, int(_cfg(config, "num_embeds_ada_norm")), (BATCH,), generator=gen)
        elif p == "encoder_hidden_states" and text_dim:
            out[p] = torch.randn(BATCH, TEXT_SEQ, int(text_dim), generator=gen)
        elif p == "pooled_projections" and _cfg(config, "pooled_projection_dim"):
            out[p] = torch.randn(BATCH, int(_cfg(config, "pooled_projection_dim")), generator=gen)
        elif p == "img_ids":
            out[p] = torch.randn(SEQ, 3, generator=gen)
        elif p == "txt_ids":
            out[p] = torch.randn(TEXT_SEQ, 3, generator=gen)
        elif p == "guidance" and _cfg(config, "guidance_embeds"):
            out[p] = torch.full((BATCH,), 3.5)
        elif p == "added_cond_kwargs" and _cfg(config, "use_additional_conditions"):
            out[p] = {"resolution": torch.full((BATCH, 2), float(size * 8)),
                      "aspect_ratio": torch.ones(BATCH, 1)}
    if "hidden_states" not in out:
        raise UsageError(f"{type(model).__name__} takes no 'hidden_states': normexport makes example inputs for "
                         "diffusion transformers only; pass --input NAME:DIMS[:DTYPE] for each forward input")
    return out


def forward_parameters(model) -> list[str]:
    return list(inspect.signature(model.forward).parameters)


