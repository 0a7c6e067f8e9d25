"""The numeric check of a swap (docs/design.md §1): random float32 inputs, max relative error, float32
copies of a module. Shared by the recognisers (normexport.prepare.recognisers) and the driver
(normexport.prepare.swap); imports nothing else of normexport."""

from __future__ import annotations

import copy
import math
from typing import Callable

import torch
from torch import nn

#: a swap is kept when max|new - old| / max|old| on random float32 input is at most this
REL_TOL = 1e-5


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(shape, seed: int, offset: float = 0.0) -> torch.Tensor:
    """Seeded check input N(offset, 1.5²); non-zero mean on purpose: tells mean-subtracting norms
    from RMS norms apart."""
    return torch.randn(shape, generator=gen(seed)) * 1.5 + offset


def _flatten(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flatten(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _flatten(o)]
    return []


def rel_err(new, ref) -> float:
    """max |new - ref| / max |ref| over all tensor outputs (inf on a structure mismatch)."""
    a, b = [t.detach() for t in _flatten(new)], [t.detach() for t in _flatten(ref)]
    if len(a) != len(b) or not b or any(x.shape != y.shape for x, y in zip(a, b)):
        return math.inf
    diff = max(float((x.double() - y.double()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))
    scale = max(float(y.double().abs().max()) if y.numel() else 0.0 for y in b)
    if not math.isfinite(diff):
        return math.inf
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def compare(new: Callable, old: Callable, inputs: tuple) -> float:
    """rel_err of new(*inputs) against old(*inputs), without autograd."""
    with torch.no_grad():
        return rel_err(new(*inputs), old(*inputs))


def as_eval(module: nn.Module) -> nn.Module:
    try:
        return module.eval()
    except NotImplementedError:  # e.g. ExportedProgram.module() refuses eval()
        return module


def float32_copy(module: nn.Module) -> nn.Module:
    """A float32 deep copy of `module` in eval mode (the reference of a check)."""
    return as_eval(copy.deepcopy(module).float())


def float32_inputs(x):
    """`x` (tensors nested in tuples / lists / dicts) with its floating tensors as float32."""
    if isinstance(x, torch.Tensor):
        return x.float() if x.is_floating_point() else x
    if isinstance(x, (list, tuple)):
        return type(x)(float32_inputs(v) for v in x) if not hasattr(x, "_fields") else type(x)(*(float32_inputs(v) for v in x))
    if isinstance(x, dict):
        return {k: float32_inputs(v) for k, v in x.items()}
    return x


def param_dtype(module: nn.Module) -> torch.dtype:
    for t in list(module.parameters()) + list(module.buffers()):
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def device(module: nn.Module) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")
