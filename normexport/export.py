"""nn.Module -> ONNX, the API (normexport.convert_module): the torch-side preparation
(normexport.prepare.for_export), the exporter ladder (normexport.exporter) with the rewriter as
its judge, then the ONNX rewrite passes' file. These stages (prepare_module, run_ladder,
rewrite_model) are the ones `normexport convert` runs on its record (normexport/convert/)."""

from __future__ import annotations

from typing import Any

import onnx

from . import ops
from .errors import UsageError
from .exporter.ladder import LADDER, RUNG_TEXT  # noqa: F401 - the ladder's rungs, for callers and tests
from .exporter.rungs import (TORCHSCRIPT_OPSET, cause_summary, dynamic_shapes_for, file_dynamic_axes,  # noqa: F401
                             inline_custom_ops, keepable_axes, to_exportable)

TARGETS = ("trt", "ort", "onnx")
#: TensorRT 10 and most runtimes take opset 20. For target ort the rewriter raises the opset to 23
#: where it fuses RMSNorm into the standard RMSNormalization, which onnxruntime runs faster than
#: the decomposed form (tools/bench_ort.py, benchmarks/results/ort_*); the rest of the graph keeps
#: the opset-20 export.
DEFAULT_OPSET = 20


def checked_opset(target: str, opset: int | None) -> int:
    """The opset an export of `target` runs at (DEFAULT_OPSET where none is asked); an unknown
    target or an opset the torch.onnx exporter cannot write is a usage error naming the fix."""
    if target not in TARGETS:
        raise UsageError(f"unknown target '{target}': use one of {', '.join(TARGETS)}")
    opset = opset or DEFAULT_OPSET
    if opset < ops.MIN_OPSET:
        raise UsageError(f"--opset {opset} is too old for the torch.onnx exporter: use {ops.MIN_OPSET} or newer")
    return opset


def convert_module(module, args: tuple, **kwargs) -> onnx.ModelProto:
    """convert_module_ir as one ModelProto (for models that fit one protobuf; the CLI keeps the
    onnx-ir model and streams it to disk instead)."""
    import onnx_ir as ir

    return ir.serde.serialize_model(convert_module_ir(module, args, **kwargs))


def convert_module_ir(module, args: tuple, *, target: str = "trt", opset: int | None = None,
                      input_names: list[str] | None = None, output_names: list[str] | None = None,
                      dynamic_axes: dict[str, list[int]] | None = None,
                      report: dict | None = None, fold_bn: bool = True, swap_norms: bool = True,
                      rewrite: bool = True, verify: bool = True, auto_dynamic: bool = False, accept=None,
                      rewrite_off: dict[str, str] | None = None):
    """Export `module` called with `args` to ONNX for `target` (docs/design.md §3), as an onnx_ir model
    whose initializers are the module's own tensors (no copy of the weights; docs/design.md §8).

    The exporter ladder (docs/design.md §9, LADDER): torch.onnx's dynamo exporter with `dynamic_axes`;
    then with the axes it cannot keep made static (torch.export's Dim.AUTO: the file's symbolic
    dims say which stayed); then with static shapes; then the TorchScript-based exporter
    (dynamo=False, on the module before the norm swaps; the rewriter fuses what it left
    decomposed) with the axes, then static. A rung whose export raises, or whose file fails the
    ONNX checker or cannot run in onnxruntime, gives way to the next; given `accept(model,
    kept_axes)` (convert: the parity check), so does a file it refuses; the first file accepted is
    kept (when none is: the first file, with "parity_failed" in the report).

    `report`, when given, receives the sections "fold_batchnorm", "prepare", "exporter" ("name":
    "dynamo" | "torchscript", "rung", "static_axes" {input: [axes made static]}, "dynamo_error"
    when the first rung was not kept, "attempts") and "rewrite". `rewrite_off`: rule modules the
    command line turned off (rewriter/switches.py)."""
    report = report if report is not None else {}
    module, unswapped = prepare_module(module, args, target=target, opset=opset, report=report, fold_bn=fold_bn,
                                       swap_norms=swap_norms)

    def judge(model, kept):
        rw = None
        if rewrite:
            model, rw = rewrite_model(model, target=target, verify=verify, off=rewrite_off, call=dict(zip(names, args)))
        return (accept is None or accept(model, kept)), (model, rw)

    names = list(input_names) if input_names else [f"input_{i}" for i in range(len(args))]
    model, rw = run_ladder(module, unswapped, args, target=target, opset=opset, names=names,
                           output_names=output_names, dynamic_axes=dynamic_axes, auto_dynamic=auto_dynamic,
                           judge=judge, report=report)
    if rw is not None:
        report["rewrite"] = rw
    return model


# The stages every export runs, the API's (convert_module_ir) and `normexport convert`'s (its preparing,
# exporting and rewriting stages, normexport/convert/, are these on its record): prepare, the ladder,
# each file it exports rewritten by the ladder's judge (convert's judge also checks its parity).

def prepare_module(module, inputs: tuple, *, target: str, opset: int | None, report: dict, fold_bn: bool = True,
                   swap_norms: bool = True):
    """The target and opset refused before anything runs (checked_opset), then the torch-side steps
    (normexport.prepare.for_export) on `module` called with `inputs`, reported into `report`. Returns
    (the module the ladder exports, the same before the norm swaps: the TorchScript rungs trace that)."""
    from .prepare.for_export import prepare_for_export

    checked_opset(target, opset)
    return prepare_for_export(to_exportable(module, inputs), inputs, target=target, fold_bn=fold_bn,
                              swap_norms=swap_norms, report=report)


def run_ladder(module, unswapped, inputs: tuple, *, target: str, opset: int | None, names: list[str], output_names,
               dynamic_axes, auto_dynamic: bool, judge, report: dict, plan=None, fewer=None, required=None):
    """The exporter ladder (normexport.exporter.ladder, docs/design.md §9) on the prepared module at `opset`
    (None: DEFAULT_OPSET; TORCHSCRIPT_OPSET for the TorchScript rungs), each exported file handed to
    `judge(model, kept_axes) -> (accepted, value)`; returns the value of the file kept."""
    from .exporter import ladder

    return ladder.run(module, unswapped, inputs, names=names, output_names=output_names, dynamic_axes=dynamic_axes,
                      opset=checked_opset(target, opset), ts_opset=opset or TORCHSCRIPT_OPSET, target=target,
                      auto_dynamic=auto_dynamic, judge=judge, report=report, plan=plan, fewer=fewer or (),
                      required=required)


def rewrite_model(model, *, target: str, verify: bool = True, off: dict[str, str] | None = None,
                  call: dict | None = None):
    """The ONNX rewrite passes (normexport.rewriter) on one exported file: (the file, edited in place
    where it can be, its rewrite report as a dict). `call`: {input name: tensor} the file was exported
    from; the rewriter's local verification runs at those sizes (its probe of intermediate sizes
    holds every value at once: at sizes of its own choosing, 64 x 96 latents, a tiny SD UNet's probe
    peaked at 5 GB)."""
    from . import rewriter

    report = rewriter.RewriteReport()
    model = rewriter.rewrite_ir(model, target=target, verify=verify, report=report, off=off,
                                inputs=call_sizes(model, call))
    return model, report.to_dict()


def call_sizes(model, call: dict | None) -> dict[str, list[int]] | None:
    """{graph input: dims} of the call's tensors whose names and ranks the onnx_ir model's inputs
    have (an input the export renamed, split or dropped is left to normexport.sizes)."""
    if not call:
        return None
    sizes = {}
    for v in model.graph.inputs:
        t = call.get(v.name)
        if t is not None and hasattr(t, "shape") and v.shape is not None and len(v.shape) == len(t.shape):
            sizes[v.name] = [int(d) for d in t.shape]
    return sizes or None


def op_counts(model) -> dict[str, int]:
    """Node counts by `domain::op_type` (default domain without prefix), of an onnx.ModelProto or
    an onnx_ir model's main graph."""
    counts: dict[str, int] = {}
    for n in (model.graph.node if isinstance(model, onnx.ModelProto) else model.graph):
        key = f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
        counts[key] = counts.get(key, 0) + 1
    return counts


__all__: list[Any] = ["convert_module", "convert_module_ir", "inline_custom_ops", "op_counts", "TARGETS"]
