"""Input sizes to run an ONNX model at: the user's (`--input NAME:DIMS[:DTYPE]`), else sizes the
model accepts, found by running it in onnxruntime (docs/design.md §4: `rewrite` / `check` verify at
`--input` shapes when given, else at sizes the model accepts, and say which).

Public API:

    parse_inputs(model, texts) -> {name: dims}
        `--input` texts checked against the model (name, rank, static dims, dtype): UsageError
        (one line, exit 2) when one does not fit.

    discover(model, given=None) -> (shapes, how)
        shapes: {input name: [int, ...]} for every real graph input; how: one line saying where
        they came from (e.g. "--input", "static dims", "discovered: tried 2 size set(s)").
        Dims fixed in the model are kept; `given` (dims by input name) wins for the inputs it names,
        and a dim name (`dim_param`) the user fixed takes that size in every input; the other
        dynamic dims get common sizes by role, tried in order until onnxruntime runs the model:
        batch 2 then 1, sequence-like 8 / 16 / 4 ... (doubled when equal to a fixed size of the
        same input), image-like (spatial axes of a rank-4/5 input)
        multiples of 32 (64x96, 64x64, 32x32, 128x128, ... 640x640).
        Raises SizesError (a ValueError) naming the first failure when no candidate runs, and
        UsageError when `given` does not fit the model or the model does not run with it.

    find(model, given=None, seed=0) -> Found
        the same search, also keeping the random feeds and the model's outputs at the sizes
        found, so that a caller comparing against this model does not run it twice.

onnxruntime stays quiet: sessions log nothing (severity 4) and its errors come back as the
first line of the exception, quoted in our messages.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import numpy as np
import onnx

from . import ortrun
from .dtypes import BF16, FLOAT_TYPES, np_dtype
from .errors import UsageError

#: the size sets tried, in order, per role of a dynamic dim (one set = one column)
_PLANS: tuple[dict[str, Any], ...] = (
    {"batch": 2, "sequence": 8, "spatial": (64, 96, 32), "feature": 16},
    {"batch": 1, "sequence": 8, "spatial": (64, 64, 64), "feature": 16},
    {"batch": 1, "sequence": 16, "spatial": (32, 32, 32), "feature": 32},
    {"batch": 1, "sequence": 4, "spatial": (128, 128, 32), "feature": 8},
    {"batch": 1, "sequence": 32, "spatial": (224, 224, 32), "feature": 64},
    {"batch": 1, "sequence": 1, "spatial": (256, 256, 64), "feature": 1},
    {"batch": 1, "sequence": 64, "spatial": (512, 512, 64), "feature": 128},
    {"batch": 1, "sequence": 128, "spatial": (640, 640, 64), "feature": 256},
)
#: a size set whose inputs hold more elements than this is not tried
_MAX_ELEMENTS = 64 * 2**20


class SizesError(ValueError):
    """onnxruntime ran the model at none of the sizes tried."""


@dataclasses.dataclass
class Found:
    shapes: dict[str, list[int]]
    how: str
    feeds: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]


@dataclasses.dataclass
class _Input:
    name: str
    elem_type: int
    dims: list[int | str | None] | None  # int: fixed; str: dim_param; None: anonymous; None list: no shape


def real_inputs(model: onnx.ModelProto) -> list[_Input]:
    """The graph inputs that are not initializers, with their declared dims."""
    inits = {i.name for i in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not tt.HasField("shape"):
            out.append(_Input(vi.name, tt.elem_type, None))
            continue
        dims: list[int | str | None] = []
        for d in tt.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(d.dim_value)
            else:
                dims.append(d.dim_param or None)
        out.append(_Input(vi.name, tt.elem_type, dims))
    return out


# ---- --input -----------------------------------------------------------------------------------
def parse_inputs(model: onnx.ModelProto, texts: Sequence[str]) -> dict[str, list[int]]:
    """`--input NAME:DIMS[:DTYPE]` texts -> {name: dims}, checked against `model`."""
    from .load.inputs import parse_input

    by_name = {i.name: i for i in real_inputs(model)}
    given: dict[str, list[int]] = {}
    for text in texts:
        spec = parse_input(text)
        if spec.name in given:
            raise UsageError(f"--input '{spec.name}' given twice: give each input once")
        given[spec.name] = list(spec.dims)
        inp = by_name.get(spec.name)
        if inp is not None and text.count(":") == 2:
            want = _ONNX_DTYPE.get(str(spec.dtype).replace("torch.", ""))
            if want is not None and inp.elem_type and want != inp.elem_type:
                have = next((k for k, v in _ONNX_DTYPE.items() if v == inp.elem_type),
                            onnx.helper.tensor_dtype_to_string(inp.elem_type).replace("TensorProto.", "").lower())
                raise UsageError(f"--input '{text}': the model's input '{spec.name}' is {have}; "
                                 f"drop ':{text.split(':')[2]}' or write :{have}")
    check_given(model, given)
    return given


_ONNX_DTYPE = {
    "float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16,
    "float64": onnx.TensorProto.DOUBLE, "int64": onnx.TensorProto.INT64, "int32": onnx.TensorProto.INT32,
    "bool": onnx.TensorProto.BOOL,
}


def check_given(model: onnx.ModelProto, given: dict[str, Sequence[int]] | None) -> None:
    """UsageError when `given` names an input the model lacks, has the wrong rank, or contradicts
    a size the model fixes."""
    if not given:
        return
    inputs = {i.name: i for i in real_inputs(model)}
    names = ", ".join(inputs) or "none"
    for name, dims in given.items():
        inp = inputs.get(name)
        if inp is None:
            raise UsageError(f"--input '{name}': the model has no input '{name}' (its inputs: {names}); "
                             "use one of those names")
        if inp.dims is None:
            continue
        if len(dims) != len(inp.dims):
            raise UsageError(f"--input '{name}': the model's input '{name}' has rank {len(inp.dims)} "
                             f"({_show(inp.dims)}), --input gives {len(dims)} dims; give {len(inp.dims)} sizes")
        for axis, (d, want) in enumerate(zip(dims, inp.dims)):
            if isinstance(want, int) and d != want:
                raise UsageError(f"--input '{name}': axis {axis} is fixed to {want} in the model ({_show(inp.dims)}), "
                                 f"--input says {d}; give {want} there")


def _show(dims) -> str:
    return "x".join(str(d) if d is not None else "?" for d in dims)


# ---- discovery ---------------------------------------------------------------------------------
def _role(inp: _Input, axis: int) -> tuple[str, int]:
    """(role, index within the role) of dynamic dim `axis` of `inp`."""
    rank = len(inp.dims)
    is_float = inp.elem_type in FLOAT_TYPES
    if axis == 0 and rank >= 1:
        return "batch", 0
    if is_float and rank in (4, 5):
        channels_last = isinstance(inp.dims[-1], int) and inp.dims[-1] <= 4 and not isinstance(inp.dims[1], int)
        first = 1 if channels_last else 2
        if first <= axis < first + rank - 2:
            return "spatial", axis - first
        return "feature", 0
    if axis == 1:
        return "sequence", 0
    return "feature", 0


def _shapes_for(inputs: list[_Input], given: dict[str, Sequence[int]], plan: dict[str, Any]) -> dict[str, list[int]]:
    fixed: dict[str, int] = {}  # dim_param -> size fixed by --input
    for inp in inputs:
        if inp.name in given and inp.dims is not None:
            for d, v in zip(inp.dims, given[inp.name]):
                if isinstance(d, str):
                    fixed.setdefault(d, int(v))
    named: dict[str, int] = {}  # dim_param -> size, the first role it was seen in
    shapes = {}
    for inp in inputs:
        if inp.name in given:
            shapes[inp.name] = [int(v) for v in given[inp.name]]
            continue
        if inp.dims is None:
            raise SizesError(f"input '{inp.name}' has no shape in the model: pass --input {inp.name}:DIMS")
        shape = []
        for axis, d in enumerate(inp.dims):
            if isinstance(d, int):
                shape.append(d)
                continue
            if isinstance(d, str) and d in fixed:
                shape.append(fixed[d])
                continue
            if isinstance(d, str) and d in named:
                shape.append(named[d])
                continue
            role, k = _role(inp, axis)
            v = plan[role][k] if role == "spatial" else plan[role]
            if role in ("sequence", "feature"):  # unlike the input's fixed sizes: a mixed-up axis shows
                v = _unlike(v, {x for x in inp.dims if isinstance(x, int)})
            if isinstance(d, str):
                named[d] = v
            shape.append(v)
        shapes[inp.name] = shape
    return shapes


def _unlike(v: int, taken: set[int]) -> int:
    for c in (v, 2 * v, 3 * v, max(v // 2, 1), v + 1):
        if c not in taken:
            return c
    return v


def feeds_for(model: onnx.ModelProto, shapes: dict[str, Sequence[int]], seed: int = 0) -> dict[str, np.ndarray]:
    """Random, non-zero inputs of the model's dtypes at `shapes` (normal floats, ints and bools 0/1)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for inp in real_inputs(model):
        dt = np_dtype(inp.elem_type)
        shape = list(shapes[inp.name])
        if dt is None:
            name = onnx.helper.tensor_dtype_to_string(inp.elem_type).replace("TensorProto.", "").lower()
            raise SizesError(f"input '{inp.name}': dtype {name} cannot be fed from numpy")
        if dt.kind == "f" or dt == BF16:
            feeds[inp.name] = rng.standard_normal(shape).astype(dt)
        elif dt.kind == "b":
            feeds[inp.name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            feeds[inp.name] = rng.integers(0, 2, size=shape).astype(dt)
    return feeds


def candidates(model: onnx.ModelProto, given: dict[str, Sequence[int]] | None = None) -> list[dict[str, list[int]]]:
    """The size sets `discover` tries, in order (no duplicates, none too large)."""
    inputs = real_inputs(model)
    given = dict(given or {})
    out: list[dict[str, list[int]]] = []
    for plan in _PLANS:
        shapes = _shapes_for(inputs, given, plan)
        if shapes in out:
            continue
        if sum(int(np.prod(s, dtype=np.int64)) for s in shapes.values()) > _MAX_ELEMENTS and out:
            continue
        out.append(shapes)
    return out


def find(model: onnx.ModelProto, given: dict[str, Sequence[int]] | None = None, seed: int = 0,
         external_folder: str | None = None) -> Found:
    """Sizes the model runs at, with the random feeds used and the model's outputs (see module doc).
    `external_folder`: where `model`'s external-data locations are relative to."""
    check_given(model, given)
    inputs = real_inputs(model)
    tries = candidates(model, given)
    dynamic = any(i.dims is None or not all(isinstance(d, int) for d in i.dims)
                  for i in inputs if i.name not in (given or {}))
    try:
        sess = ortrun.session(model, external_folder)
    except Exception as e:  # noqa: BLE001
        raise SizesError(f"onnxruntime cannot load the model: {ort_error(e)}") from None
    errors = []
    for shapes in tries:
        feeds = feeds_for(model, shapes, seed)
        try:
            outputs = ortrun.run_session(sess, feeds)
        except Exception as e:  # noqa: BLE001 - onnxruntime raises several kinds
            errors.append((shapes, ort_error(e)))
            continue
        return Found(shapes, _how(given, dynamic, len(errors) + 1), feeds, outputs)
    shapes, why = errors[0]
    at = describe(shapes)
    if given:
        raise UsageError(f"the model does not run at the --input sizes ({at}; onnxruntime: {why}): "
                         "give sizes it takes" + (", or leave --input out to have them found" if dynamic else ""))
    if not dynamic:
        raise SizesError(f"onnxruntime cannot run the model at its fixed sizes ({at}): {why}")
    raise SizesError(f"onnxruntime ran the model at none of {len(errors)} size sets tried (first, {at}: {why}); "
                     "pass --input NAME:DIMS with sizes it takes")


_ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")
_ORT_SOURCE = re.compile(r"\S+\.(?:h|cc|cpp):\d+ .*?\)\s+(?:[^.]*? was false\.\s+)?")


def ort_error(e: BaseException, limit: int = 240) -> str:
    """onnxruntime's exception in one line, without its status prefix and source location."""
    text = " ".join(str(e).split())
    text = _ORT_SOURCE.sub("", _ORT_PREFIX.sub("", text))
    return (text or type(e).__name__)[:limit]


def discover(model: onnx.ModelProto, given: dict[str, Sequence[int]] | None = None) -> tuple[dict[str, list[int]], str]:
    """(shapes, how): sizes the model runs at in onnxruntime (see module doc)."""
    f = find(model, given)
    return f.shapes, f.how


def _how(given, dynamic: bool, tried: int) -> str:
    if not dynamic:
        return "--input" if given else "static dims"
    src = "--input, other dims discovered" if given else "discovered"
    return f"{src}: tried {tried} size set(s)"


def describe(shapes: dict[str, Sequence[int]]) -> str:
    """`x: 2x3x64x96, ids: 2x8` (for summaries)."""
    return ", ".join(f"{k}: {_show(v)}" for k, v in shapes.items())
