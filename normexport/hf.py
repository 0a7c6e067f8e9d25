"""MODEL as a `save_pretrained` folder of transformers or diffusers (config.json + weights).

Loaded offline (local files only, no hub access), with the class the config names, looked up in
the library itself (never imported from a name in the file). Example inputs fit the model class:
token ids for language models, latents + timestep + conditioning for diffusion transformers,
built from the config's sizes; `--input` overrides them by forward parameter name.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import warnings
from pathlib import Path

import torch

from .call import CallAdapter
from .errors import UsageError, first_line

BATCH, SEQ, TEXT_SEQ = 2, 8, 6


def load_folder(path: Path):
    from .loaders import LoadedModel

    config_file = path / "config.json"
    if not config_file.is_file():
        raise UsageError(f"'{path}' is a directory without config.json: pass a save_pretrained folder of transformers "
                         "or diffusers, a .pt2, .pt/.pth file or `package.module:callable`")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read '{config_file}' ({first_line(e, 120)}): re-save the model with save_pretrained") from None
    if not isinstance(config, dict):
        raise UsageError(f"'{config_file}' is not a JSON object: re-save the model with save_pretrained")
    if "_diffusers_version" in config or "_class_name" in config:
        library, class_name = "diffusers", config.get("_class_name")
    else:
        library, class_name = "transformers", (config.get("architectures") or [None])[0]
    if not isinstance(class_name, str) or not class_name.isidentifier():
        key = "_class_name" if library == "diffusers" else "architectures"
        raise UsageError(f"'{config_file}' names no model class ('{key}'): re-save the model with save_pretrained")
    if importlib.util.find_spec(library) is None:
        raise UsageError(f"'{path}' is a {library} folder but {library} is not installed: pip install {library}")
    cls = getattr(importlib.import_module(library), class_name, None)
    if cls is None:
        raise UsageError(f"'{path}' names {class_name}, which this {library} does not have: "
                         f"upgrade {library} or re-save the model with this version")
    module = _from_pretrained(cls, path)
    args = example_kwargs(module, library)
    adapter = CallAdapter(module, (), args)
    dynamic = {name: [0, 1] if name in ("input_ids", "attention_mask") else [0] for name in args
               if name in _BATCHED}
    return LoadedModel(adapter, "pretrained", adapter.example_inputs, adapter.input_names, dynamic or None)


def _from_pretrained(cls, path: Path):
    saved = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    _quiet_progress(cls.__module__.split(".", 1)[0])
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = cls.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise UsageError(f"cannot load '{path}' as {cls.__name__} ({first_line(e, 160)}): "
                         "check that the folder holds config.json and its weights (save_pretrained)") from None
    finally:
        logging.disable(previous)
        if saved is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False  # no KV cache objects among the outputs
    return model.eval()


def _quiet_progress(library: str) -> None:
    """No progress bars on the terminal while the weights load."""
    try:
        importlib.import_module(f"{library}.utils.logging").disable_progress_bar()
    except (ImportError, AttributeError):
        pass


#: inputs whose first axis is the batch (and, for token ids, the second the sequence)
_BATCHED = ("input_ids", "attention_mask", "hidden_states", "timestep", "class_labels", "encoder_hidden_states",
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
    params = _required_and_known(model)
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


def _required_and_known(model) -> list[str]:
    import inspect

    return list(inspect.signature(model.forward).parameters)


def with_inputs(loaded, specs):
    """A pretrained model called with the user's --input tensors, by forward parameter name."""
    from .inputs import make_inputs

    module = loaded.module.inner
    params = _required_and_known(module)
    unknown = [s.name for s in specs if s.name not in params]
    if unknown:
        raise UsageError(f"--input {unknown[0]} is not a parameter of {type(module).__name__}.forward: "
                         f"use one of {', '.join(p for p in params if p not in ('self', 'kwargs'))[:200]}")
    adapter = CallAdapter(module, (), dict(zip([s.name for s in specs], make_inputs(specs))))
    return adapter
