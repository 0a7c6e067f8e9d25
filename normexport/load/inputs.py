"""`--input NAME:DIMS[:DTYPE]` and `--dynamic NAME:AXES`, and the random inputs they describe."""

from __future__ import annotations

import dataclasses
import re

import torch

from ..errors import UsageError

DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "double": torch.float64,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "bool": torch.bool,
}


@dataclasses.dataclass(frozen=True)
class InputSpec:
    name: str
    dims: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    dtype_given: bool = True  # False: `--input NAME:DIMS` named no DTYPE (for_parameter picks one)


#: names of token-like inputs that hold integers: a tokenizer's ids (input_ids, token_type_ids, position_ids)
#: and indices. A library model's masks are integers too, unless documented boolean (tokenizers give int64
#: masks, where BERT documents a FloatTensor). Any other name keeps float32 whatever its documentation says: diffusers
#: documents Flux's float timestep as `torch.LongTensor`, and Flux's `img_ids` are float coordinates.
TOKEN_NAME = re.compile(r"(^|_)(input|token_type|position)_ids$|^ids$|(^|_)indices$")


def for_parameter(spec: InputSpec, module, library: bool = False) -> InputSpec:
    """`spec` with the dtype the module's forward parameter of its name takes when --input named none: int64
    for token ids and indices (TOKEN_NAME); for a transformers / diffusers model (`library`) int64 for masks
    too (bool where documented `torch.BoolTensor`), their tokenizers' convention, where any other module's
    `mask` may be a float it multiplies by; bool where documented so; else float32."""
    if spec.dtype_given:
        return spec
    from . import docs

    try:
        doc = docs.params(module).get(spec.name)
    except Exception:  # noqa: BLE001 - a forward without documentation: by its name
        doc = None
    boolean = getattr(doc, "dtype", None) == "bool"
    if TOKEN_NAME.search(spec.name) or (library and "mask" in spec.name and not boolean):
        dtype = torch.int64
    else:
        dtype = torch.bool if boolean else torch.float32
    return dataclasses.replace(spec, dtype=dtype)


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


def parse_input(text: str) -> InputSpec:
    """`x:2x16x64` or `ids:2x16:int64` -> InputSpec."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not _NAME.match(parts[0]):
        raise UsageError(f"malformed --input '{text}': use NAME:DIMS[:DTYPE], e.g. --input x:2x16x64:float32")
    name, dims_text = parts[0], parts[1]
    try:
        dims = tuple(int(d) for d in dims_text.lower().split("x")) if dims_text else ()
    except ValueError:
        raise UsageError(f"malformed dims '{dims_text}' in --input '{text}': write sizes joined by 'x', e.g. 2x16x64") from None
    if any(d < 0 for d in dims):
        raise UsageError(f"negative size in --input '{text}': sizes must be >= 0")
    dtype, given = torch.float32, len(parts) == 3
    if given:
        if parts[2].lower() not in DTYPES:
            raise UsageError(f"unknown dtype '{parts[2]}' in --input '{text}': use one of float32, float16, bfloat16, int64, int32, bool")
        dtype = DTYPES[parts[2].lower()]
    return InputSpec(name, dims, dtype, given)


def parse_dynamic(text: str) -> tuple[str, list[int]]:
    """`x:0,1` -> ("x", [0, 1])."""
    name, sep, axes_text = text.partition(":")
    try:
        axes = [int(a) for a in axes_text.split(",")] if sep else []
    except ValueError:
        axes = []
    if not sep or not axes or not _NAME.match(name) or any(a < 0 for a in axes):
        raise UsageError(f"malformed --dynamic '{text}': use NAME:AXES with axes a comma list, e.g. --dynamic x:0,1")
    return name, axes


def padded_mask(batch: int, seq: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """An example attention mask [batch, seq]: ones, the last 2 positions padding in all but the first
    row (a batch of prompts of two lengths, as a tokenizer pads them)."""
    mask = torch.ones(batch, seq, dtype=dtype)
    if seq > 2:
        mask[1:, -2:] = 0
    return mask


def make_inputs(specs, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random, non-zero inputs for `specs` (normal floats, small non-negative ints); an integer or
    boolean mask [B, S] is ones with the last 2 positions padding in all but the first row."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for spec in specs:
        if "mask" in spec.name and not spec.dtype.is_floating_point and len(spec.dims) == 2:
            t = padded_mask(*spec.dims, dtype=spec.dtype)
        elif spec.dtype.is_floating_point:
            t = torch.randn(spec.dims, generator=gen, dtype=torch.float32).to(spec.dtype)
        elif spec.dtype == torch.bool:
            t = torch.randint(0, 2, spec.dims, generator=gen).bool()
        else:
            t = torch.randint(0, 8, spec.dims, generator=gen, dtype=spec.dtype)
        out.append(t)
    return tuple(out)

