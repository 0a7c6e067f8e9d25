"""Optimisation profiles (min / opt / max per input) from an ONNX file's dynamic dims.

opt: sizes the model runs at (normexport.sizes: its static dims, then common sizes it accepts in
onnxruntime). min: 1 for batch and sequence-like dims, opt for the spatial dims of rank-4/5 inputs
(image models often take only multiples of some stride). max: 4 x opt. `--shapes` overrides any input.

A file with a KV cache (docs/design.md §10: inputs input_ids, attention_mask, position_ids,
past_key_values.*, dims named batch / sequence / past_sequence / total_sequence) gets one profile
that serves prefill and decode: LLM_DIMS per named dim (total_sequence = past_sequence + sequence),
and `--shapes` takes a dim name as well as an input name (`--shapes past_sequence:0/512/4096`).
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


#: (min, opt, max) per named dim of a file with a KV cache: decode (sequence 1) through prefill of up
#: to 512 tokens, an empty past (prefill) through 1024 cached positions, batch 1 to 4
LLM_DIMS = {"batch": (1, 1, 4), "sequence": (1, 16, 512), "past_sequence": (0, 128, 1024)}


def is_with_past(model: onnx.ModelProto) -> bool:
    names = {i.name for i in sizes.real_inputs(model)}
    return "input_ids" in names and "past_key_values.0.key" in names


def llm_profiles(model: onnx.ModelProto, given: dict) -> tuple[dict, str]:
    """Profiles of a file with a KV cache over its named dims (module docstring); `given` entries
    name a dim (rank-1 MIN/OPT/MAX) or an input."""
    dims = dict(LLM_DIMS)
    names = [i.name for i in sizes.real_inputs(model)]
    for name, (lo, opt, hi) in given.items():
        if name in dims:
            if len(lo) != 1:
                raise UsageError(f"--shapes {name}: give one size per MIN/OPT/MAX for a dim, e.g. {name}:1/16/512")
            dims[name] = (lo[0], opt[0], hi[0])
        elif name not in names:
            raise UsageError(f"--shapes names '{name}', which is neither an input nor a dim of the model: inputs are "
                             f"{', '.join(names[:4])}, ...; dims {', '.join(LLM_DIMS)}")
    if dims["sequence"][0] < 1 or dims["batch"][0] < 1:
        raise UsageError("--shapes batch / sequence: MIN must be >= 1")
    dims["total_sequence"] = tuple(p + s for p, s in zip(dims["past_sequence"], dims["sequence"]))
    out = {}
    for inp in sizes.real_inputs(model):
        if inp.name in given:
            continue
        if inp.dims and all(isinstance(d, int) for d in inp.dims):
            continue
        lo, opt, hi = [], [], []
        for d in inp.dims or []:
            if isinstance(d, int):
                v = (d, d, d)
            elif d in dims:
                v = dims[d]
            else:
                raise UsageError(f"input '{inp.name}' has a dim '{d}' that is not one of {', '.join(dims)}: give its "
                                 f"profile with --shapes {inp.name}:MIN/OPT/MAX")
            lo.append(v[0]), opt.append(v[1]), hi.append(v[2])
        out[inp.name] = (tuple(lo), tuple(opt), tuple(hi))
    checked, _ = _plain_profiles(model, {n: given[n] for n in given if n in names}, allow_missing=True)
    out.update(checked)
    told = [n for n in given if n in LLM_DIMS]
    how = ("a file with a KV cache: " + ", ".join(f"{k} {'/'.join(map(str, v))}" for k, v in dims.items())
           + " (min/opt/max; " + (f"--shapes for {', '.join(told)}, " if told else "")
           + "defaults normexport.trt.profiles.LLM_DIMS)")
    return {n: out[n] for n in names if n in out}, how


def profiles_for(model: onnx.ModelProto, given: dict[str, tuple[tuple[int, ...], ...]]) -> tuple[dict, str]:
    """({input: (min, opt, max)} for every dynamic input, how the sizes were chosen)."""
    if is_with_past(model):
        return llm_profiles(model, given)
    return _plain_profiles(model, given)


def _plain_profiles(model: onnx.ModelProto, given: dict, allow_missing: bool = False) -> tuple[dict, str]:
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
    if allow_missing:  # the caller sizes the others
        return {n: given[n] for n in given}, "--shapes"
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
