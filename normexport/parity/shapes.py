"""Shape sweeps: the dynamic axes to vary, extra input shapes along them, and inputs like the given
ones at another shape."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import UsageError
from ._util import _dims

def _normalise_dynamic(dynamic_axes, names: list[str], ranks: list[int]) -> dict[str, dict[int, str | None]]:
    """{onnx input name: {axis: symbol or None}}; names may also be positional `input_<i>`."""
    out: dict[str, dict[int, str | None]] = {}
    for key, axes in (dynamic_axes or {}).items():
        if key in names:
            name = key
        elif isinstance(key, int) and 0 <= key < len(names):
            name = names[key]
        else:
            raise UsageError(f"dynamic axes name unknown input '{key}': the ONNX inputs are {names}")
        rank = ranks[names.index(name)]
        items = axes.items() if isinstance(axes, dict) else ((a, None) for a in axes)
        for a, sym in items:
            a = int(a)
            if not -rank <= a < rank:
                raise UsageError(f"dynamic axis {a} of '{name}' is out of range: it has rank {rank}")
            out.setdefault(name, {})[a % rank] = sym
    return out


def _extra_shapes(inputs: list[torch.Tensor], names: list[str], graph_inputs, dynamic, n: int) -> list[dict[str, list[int]]]:
    """`n` new shape sets. Dynamic axes sharing a symbol (the ONNX dim_param, the name given in
    dynamic_axes, else the same size) change together: size + step, 2 x size, size + 3 x step, ...
    where step is 1, except on the spatial axes of an image-like input (float, rank 4 or 5), where
    it is the largest power of two up to 32 that divides the size (a 64 x 96 image gets 96 x 128,
    not 65 x 97, which strided convolutions and skip connections rarely take)."""
    groups: dict[Any, list[tuple[int, int]]] = {}
    for i, (name, t, vi) in enumerate(zip(names, inputs, graph_inputs)):
        graph_dims = _dims(vi)
        for axis, sym in dynamic.get(name, {}).items():
            gd = graph_dims[axis] if axis < len(graph_dims) else None
            key = ("sym", sym) if sym else (("param", gd) if isinstance(gd, str) else ("size", t.shape[axis]))
            groups.setdefault(key, []).append((i, axis))
    if not groups:
        return []

    def new_size(size: int, k: int, step: int) -> int:
        return [size + step, 2 * size, size + 3 * step, max(step, size - step), 3 * size][k % 5] + (k // 5) * 5 * step

    shapes = []
    for k in range(n):
        dims = [list(t.shape) for t in inputs]
        for members in groups.values():
            i0, a0 = members[0]
            size = inputs[i0].shape[a0]
            size = new_size(size, k, _step(inputs[i0], a0, size))
            for i, axis in members:
                dims[i][axis] = size
        shapes.append({name: d for name, d in zip(names, dims)})
    return shapes


def _step(t: torch.Tensor, axis: int, size: int) -> int:
    """1, or on a spatial axis of an image-like input the power of two (<= 32) that divides `size`."""
    if not t.is_floating_point() or t.dim() not in (4, 5):
        return 1
    channels_last = t.shape[-1] <= 4 < t.shape[1]
    spatial = range(1, t.dim() - 1) if channels_last else range(2, t.dim())
    if axis not in spatial or size <= 0:
        return 1
    step = 1
    while step < 32 and size % (2 * step) == 0:
        step *= 2
    return step


def _inputs_like(inputs: list[torch.Tensor], shape: dict[str, list[int]], names: list[str], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, t in zip(names, inputs):
        dims = shape[name]
        if list(t.shape) == dims:
            out.append(t)
        elif t.is_floating_point():
            tf = t.float()
            mean, std = (tf.mean().item(), tf.std().item()) if t.numel() > 1 else (0.0, 1.0)
            std = std if math.isfinite(std) and std > 0 else 1.0
            out.append((torch.randn(dims, generator=g) * std + mean).to(t.dtype))
        elif (runs := _runs_like(t, dims, g)) is not None:
            out.append(runs)
        elif t.dtype == torch.bool:
            out.append(torch.randint(0, 2, dims, generator=g).bool())
        else:
            lo = int(t.min()) if t.numel() else 0
            hi = int(t.max()) if t.numel() else 1
            out.append(torch.randint(lo, hi + 1, dims, generator=g, dtype=t.dtype))
    return out


def _runs_like(t: torch.Tensor, dims: list[int], g: torch.Generator) -> torch.Tensor | None:
    """A 0/1 tensor whose every row (last axis) is a run of ones followed by zeros (right padding) or
    zeros followed by ones (left padding), as a padding mask or token types are, made at `dims` the
    same way: each row a run of 1..n ones on the same side; None for anything else (values other
    than 0 and 1, all one value, rows not runs). Random 0/1 values would make rows that mask every
    key a query may see (a causal model's first query with its first key masked), whose outputs no
    two implementations agree on, nor need to: the runtime's error there is no signal."""
    if t.is_floating_point() or t.is_complex() or t.dim() < 2 or not t.numel() or not dims[-1]:
        return None
    rows = t.reshape(-1, t.shape[-1]).to(torch.int64)
    if not bool(((rows == 0) | (rows == 1)).all()) or bool((rows == rows.flatten()[0]).all()):
        return None
    right = bool((rows[:, 1:] <= rows[:, :-1]).all())  # ones first, then zeros
    if not right and not bool((rows[:, 1:] >= rows[:, :-1]).all()):
        return None
    n = dims[-1]
    count = math.prod(dims[:-1])
    lengths = torch.randint(1, n + 1, (count, 1), generator=g)
    pos = torch.arange(n).unsqueeze(0)
    ones = pos < lengths if right else pos >= n - lengths
    return ones.reshape(dims).to(t.dtype)
