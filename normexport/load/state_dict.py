"""State dicts: `--weights FILE` into a module, and state dicts found inside checkpoints."""

from __future__ import annotations

import os

import torch
from torch import nn

from ..errors import UsageError
from ._util import short


def load_weights(module: nn.Module, weights: str) -> None:
    if not os.path.isfile(weights):
        raise UsageError(f"weights file not found: '{weights}': check the --weights path")
    try:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(f"cannot read --weights '{weights}' as a state dict ({short(e)}): save it with torch.save(model.state_dict(), path)") from None
    if not isinstance(state, dict):
        raise UsageError(f"--weights '{weights}' holds a {type(state).__name__}, not a state dict: save model.state_dict()")
    if not is_state_dict(state):
        found = find_state_dict(state)
        if found is None:
            keys = ", ".join(repr(k) for k in list(state)[:6])
            raise UsageError(f"--weights '{weights}' is a dict ({keys}) with no state dict of tensors in it: "
                             "save model.state_dict()")
        state = found[1]
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        detail = " ".join(s.strip() for s in first[1:3]) if len(first) > 1 else first[0]
        raise UsageError(f"--weights '{weights}' does not fit the model ({detail[:200]}): use weights saved from this model") from None


#: keys under which training checkpoints usually keep the model's state dict, most likely first
CHECKPOINT_KEYS = ("state_dict", "model_state_dict", "model", "module", "net", "network", "weights", "params")


def is_state_dict(obj) -> bool:
    return (isinstance(obj, dict) and bool(obj) and all(isinstance(k, str) for k in obj)
            and all(isinstance(v, torch.Tensor) for v in obj.values()))


def find_state_dict(obj, depth: int = 2) -> tuple[str, dict] | None:
    """(key path, state dict) of the model's state dict nested in a checkpoint dict such as
    {'model': sd, 'epoch': 3} or {'state_dict': sd}; None when there is none."""
    if not isinstance(obj, dict) or depth == 0:
        return None
    keys = [k for k in CHECKPOINT_KEYS if k in obj] + [k for k in obj if k not in CHECKPOINT_KEYS]
    for k in keys:
        v = obj[k]
        if is_state_dict(v):
            return str(k), v
    for k in keys:
        inner = find_state_dict(obj[k], depth - 1)
        if inner is not None:
            return f"{k}.{inner[0]}", inner[1]
    return None


