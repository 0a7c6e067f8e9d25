"""Optimisation profiles (min / opt / max per input) from an ONNX file's dynamic dims.

opt: sizes the model runs at (normexport.sizes: its static dims, then common sizes it accepts in
onnxruntime). min: 1 for batch and sequence-like dims, opt for the spatial dims of rank-4/5 inputs
(image models often take only multiples of some stride). max: 4 x opt. `--shapes` overrides any input.
"""

from __future__ import annotations

import re

import onnx

from .. import sizes
from ..errors import UsageError

_SHAPES = re.compile(r"^([^:]+):(\d+(?:x\d+)*)/(\d+(?:x\d+)*)/(\d+(?:x\d+)*)$")


def parse_shapes(texts: list[str]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """`NAME:MIN/OPT/MAX` (e.g. x:1x1x64/2x16x64/8x128x64) -> {name: (min, opt, max)}."""
    out = {}
    for text in texts:
        m = _SHAPES.match(text.strip())
        if not m:
            raise UsageError(f"bad --shapes '{text}': write NAME:MIN/OPT/MAX with dims like 1x16x64, e.g. x:1x1x64/2x16x64/8x128x64")
        name, *dims = m.groups()
        lo, opt, hi = (tuple(int(d) for d in s.split("x")) for s in dims)
        if not len(lo) == len(opt) == len(hi):
            raise UsageError(f"--shapes {name}: MIN, OPT and MAX have different ranks: give each the input's rank")
        if any(a > b for a, b in zip(lo, opt)) or any(a > b for a, b in zip(opt, hi)):
            raise UsageError(f"--shapes {name}: needs MIN <= OPT <= MAX in every dim (got {text.split(':', 1)[1]})")
        if name in out:
            raise UsageError(f"--shapes names '{name}' twice: give each input once")
        out[name] = (lo, opt, hi)
    return out


def dynamic_inputs(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """{input: dims (None where dynamic)} for the real inputs with a dynamic dim."""
    out = {}
    for inp in sizes.real_inputs(model):
        dims = [d if isinstance(d, int) else None for d in inp.dims or []]
        if any(d is None for d in dims):
            out[inp.name] = dims
    return out


def profiles_for(model: onnx.ModelProto, given: dict[str, tuple[tuple[int, ...], ...]]) -> tuple[dict, str]:
    """({input: (min, opt, max)} for every dynamic input, how the sizes were chosen)."""
    dynamic = dynamic_inputs(model)
    names = [i.name for i in sizes.real_inputs(model)]
    for name, (lo, opt, hi) in given.items():
        if name not in names:
            raise UsageError(f"--shapes names '{name}', which is not an input of the model: inputs are {', '.join(names)}")
        declared = [d if isinstance(d, int) else None for d in next(i for i in sizes.real_inputs(model) if i.name == name).dims or []]
        if len(declared) != len(lo):
            raise UsageError(f"--shapes {name}: rank {len(lo)}, but '{name}' has rank {len(declared)}")
        for axis, d in enumerate(declared):
            if d is not None and not lo[axis] == opt[axis] == hi[axis] == d:
                raise UsageError(f"--shapes {name}: dim {axis} of '{name}' is fixed at {d}: give {d} there")
    todo = [n for n in dynamic if n not in given]
    if not todo:
        return {n: given[n] for n in dynamic}, "--shapes" if dynamic else "static shapes"
    try:
        found, how = sizes.discover(model, {n: list(given[n][1]) for n in given})
    except sizes.SizesError:
        found, how = sizes.candidates(model, {n: list(given[n][1]) for n in given})[0], "common sizes (onnxruntime ran none)"
    out = dict(given)
    for name in todo:
        dims, opt = dynamic[name], tuple(found[name])
        lo = tuple(o if d is not None or (len(dims) >= 4 and axis >= 2) else 1 for axis, (d, o) in enumerate(zip(dims, opt)))
        hi = tuple(o if d is not None else 4 * o for d, o in zip(dims, opt))
        out[name] = (lo, opt, hi)
    how = how.replace("--input", "--shapes")
    return {n: out[n] for n in dynamic}, f"opt = {how}; min 1 / max 4 x opt along dynamic dims"
