"""What loading a MODEL gives: the module and what it says about its inputs (docs/design.md §4)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from torch import nn

TORCH_EXTS = (".pt", ".pth", ".bin", ".ckpt")


@dataclasses.dataclass
class LoadedModel:
    module: nn.Module
    kind: str  # "exported-program" | "torchscript" | "pickle" | "factory" | "pretrained"
    example_inputs: tuple | None = None
    input_names: list[str] | None = None
    dynamic_axes: dict[str, list[int]] | None = None
    exported_program: Any = None  # torch.export.ExportedProgram for .pt2
    output_names: list[str] | None = None
    #: what the user must know about the file this model exports to (printed by convert), e.g.
    #: sizes a forward fixes by reading input values in python
    notes: list[str] = dataclasses.field(default_factory=list)
    #: forward parameters normexport cannot make example inputs for, with the shape the config
    #: implies (a save_pretrained folder): the user gives them (--input, --inputs), else the one-line
    #: error (examples.missing_message) when the call is resolved
    missing: dict[str, str] = dataclasses.field(default_factory=dict)
    #: set where the example inputs were not yet run in eager (a folder's causal LM loaded with
    #: probe_generating=False: its KV-cache graph makes inputs of its own): `probe()` is this model
    #: with its inputs checked by the eager forward(s) of load.probe.settle
    probe: Any = None
    #: narrower sets of dynamic_axes the exporter ladder tries, in order, before a fully static file
    #: (exporter/ladder.py "fewer axes"; a pipeline component: the sizes that vary at one image size, the batch)
    fewer_axes: list[dict[str, list[int]]] = dataclasses.field(default_factory=list)
    #: axes of dynamic_axes the caller serves another way where the model fixes them: the ladder raises
    #: errors.AxesFixed rather than export without them (a pipeline's text axis, pipeline/padding.py)
    required_axes: dict[str, list[int]] = dataclasses.field(default_factory=dict)


def generates(model) -> bool:
    """A transformers model that generates on its own: a decoder (not encoder-decoder) whose
    `can_generate()` says so (normexport.llm's causal LMs)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    try:
        return bool(model.can_generate())
    except Exception:  # noqa: BLE001
        return False


def is_factory(model: str) -> bool:
    return ":" in model and not os.path.exists(model) and not model.endswith((".pt2",) + TORCH_EXTS)
