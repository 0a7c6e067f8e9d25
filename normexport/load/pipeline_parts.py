"""The model components of a diffusers pipeline folder, loaded one by one with their checkpoint
judged against their config.json (checkpoint_keys, docs/design.md §14), then handed to the
pipeline's from_pretrained (which uses a component passed to it as it is).

DiffusionPipeline.from_pretrained gives no loading report for its components: a text encoder whose
config says one layer more than its weights would load with that layer random, the warning hidden.
Each component whose class (looked up in its library, never imported by name from the file) is a
transformers PreTrainedModel or a diffusers ModelMixin is loaded here as the pipeline would load
it (its folder, the dtype the pipeline would give it); tokenizers, schedulers and processors are
left to the pipeline.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from .pretrained import load_checked


def load_components(pipeline_name: str, path: Path, index: dict, names: list[str], dtypes: dict) -> dict:
    """{component: model} for the model components among `names` that have a folder with
    config.json; `dtypes`: the half dtype of each component stored so (the others then load in
    float32, as the pipeline's `torch_dtype={..., "default": float32}` gives them); empty: each in
    its library's default, as the pipeline loads without torch_dtype."""
    out = {}
    for name in names:
        folder = path / name
        library, class_name = index[name]
        cls = model_class(library, class_name)
        if cls is None or not (folder / "config.json").is_file():
            continue
        kwargs = {}
        if dtypes:
            key = "dtype" if cls.__module__.startswith("transformers") else "torch_dtype"
            kwargs[key] = dtypes.get(name, torch.float32)
        out[name] = load_checked(cls, folder, f"the {name} of {pipeline_name} ('{folder}', {class_name})", **kwargs)
    return out


def model_class(library: str, class_name: str):
    """The class model_index.json names when it is a transformers / diffusers model class (a
    pipeline's own module, e.g. ["stable_diffusion", "StableDiffusionSafetyChecker"], is looked up
    in diffusers.pipelines as diffusers does); None for anything else."""
    bases = []
    for lib, base in (("transformers", "PreTrainedModel"), ("diffusers", "ModelMixin")):
        try:
            bases.append(getattr(importlib.import_module(lib), base))
        except (ImportError, AttributeError):
            pass
    module_name = library if library in ("transformers", "diffusers") else f"diffusers.pipelines.{library}"
    try:
        cls = getattr(importlib.import_module(module_name), class_name, None)
    except (ImportError, ValueError):  # a library name that is no module (a damaged model_index.json)
        return None
    return cls if isinstance(cls, type) and bases and issubclass(cls, tuple(bases)) else None
