"""The inputs `normexport check` runs at, and where their sizes came from (docs/design.md §4):

1. `--input NAME:DIMS[:DTYPE]` naming ONNX inputs: checked against the file (name, rank, fixed
   sizes, normexport.sizes.check_given); inputs it leaves out get sizes the file runs at
   (normexport.sizes.find). Only when some ONNX input name cannot be written in `--input`
   (`onnx::Conv_0`) are other names taken in order, one per ONNX input.
2. else the reference's example inputs (a .pt2's, a factory's `example_inputs()`);
3. else sizes the ONNX file accepts: its fixed dims, then common sizes tried in onnxruntime
   (normexport.sizes: batch 2 / 1, sequence 8 / 16 / ..., images in multiples of 32).

The values are random and non-zero (normexport.load.inputs.make_inputs). A floating input is made in
float32 unless `--input` names its dtype, so that check() judges in the ONNX file's dtype as for
the example inputs (driver.py). `how` is the text of the `verified at` line, as `rewrite` prints
it: "--input", "--input, other dims discovered: tried N size set(s)", "example inputs of MODEL",
"static dims" or "discovered: tried N size set(s)".
"""

from __future__ import annotations

import dataclasses

import onnx
import torch

from .. import sizes
from ..errors import UsageError
from ..load.inputs import _NAME, InputSpec, make_inputs, parse_input
from ._util import _ONNX_TO_TORCH


@dataclasses.dataclass
class Chosen:
    inputs: tuple[torch.Tensor, ...]  # in the order of the ONNX inputs
    names: list[str]  # the names they were given under (ONNX names, or the --input / reference names)
    how: str  # where the sizes came from


def choose(model: onnx.ModelProto, texts: list[str], example: tuple | None, example_names: list[str] | None,
           reference: str, label: str) -> Chosen:
    """The inputs to check `model` (the file `label`) at; see the module docstring."""
    onnx_inputs = sizes.real_inputs(model)
    onnx_names = [i.name for i in onnx_inputs]
    if texts:
        specs = [parse_input(t) for t in texts]
        if all(s.name in onnx_names for s in specs):
            return _by_name(model, texts, specs, onnx_inputs, label)
        if len(specs) != len(onnx_names) or all(_NAME.match(n) for n in onnx_names):
            unknown = next(s for s in specs if s.name not in onnx_names)
            sizes.check_given(model, {unknown.name: list(unknown.dims)})  # "the model has no input ..."
        return Chosen(make_inputs(specs), [s.name for s in specs], "--input")  # in order
    if example is not None:
        if len(example) != len(onnx_names):
            raise UsageError(f"'{label}' has {len(onnx_names)} input(s) ({', '.join(onnx_names)}) but the example "
                             f"inputs of '{reference}' are {len(example)}: give one --input per ONNX input")
        return Chosen(tuple(example), list(example_names or []), f"example inputs of {reference}")
    try:
        found = sizes.find(_with_data(model, label))
    except sizes.SizesError as e:
        raise UsageError(f"cannot choose input sizes for '{label}' ({e})") from None
    specs = [InputSpec(i.name, tuple(found.shapes[i.name]), _tensor_dtype(i)) for i in onnx_inputs]
    return Chosen(make_inputs(specs), onnx_names, found.how)


def _by_name(model, texts, specs, onnx_inputs, label) -> Chosen:
    given: dict[str, list[int]] = {}
    for s in specs:
        if s.name in given:
            raise UsageError(f"--input '{s.name}' given twice: give each input once")
        given[s.name] = list(s.dims)
    sizes.check_given(model, given)
    how = "--input"
    shapes = dict(given)
    if len(given) < len(onnx_inputs):  # the others: sizes the file runs at with the given ones
        try:
            found = sizes.find(_with_data(model, label), given)
        except sizes.SizesError as e:
            raise UsageError(f"cannot choose sizes for the inputs --input leaves out ({e})") from None
        shapes, how = found.shapes, found.how
    explicit = {s.name: s.dtype for s, text in zip(specs, texts) if text.count(":") == 2}
    out = [InputSpec(i.name, tuple(shapes[i.name]), explicit.get(i.name, _tensor_dtype(i))) for i in onnx_inputs]
    return Chosen(make_inputs(out), [i.name for i in onnx_inputs], how)


def _with_data(model: onnx.ModelProto, label: str) -> onnx.ModelProto:
    """`model` with its external data loaded (check reads the file without it) for onnxruntime."""
    external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    return onnx.load(label) if external else model


def _tensor_dtype(inp: sizes._Input) -> torch.dtype:
    """float32 for a floating ONNX input (check() casts to the file's dtype), else its own dtype."""
    dtype = _ONNX_TO_TORCH.get(inp.elem_type, torch.float32)
    return torch.float32 if dtype.is_floating_point else dtype
