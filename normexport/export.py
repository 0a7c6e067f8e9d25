"""nn.Module -> ONNX: BN folding and norm swaps in torch, the dynamo exporter with our
translation table, function bodies for the custom ops, then the ONNX rewrite passes."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import onnx
import torch

from . import ops
from .errors import UsageError

TARGETS = ("trt", "ort", "onnx")
#: TensorRT 10 and most runtimes take opset 20. For target ort the rewriter raises the opset to 23
#: where it fuses RMSNorm into the standard RMSNormalization, which onnxruntime runs faster than
#: the decomposed form (tools/bench_ort.py, benchmarks/results/ort_*); the rest of the graph keeps
#: the opset-20 export.
DEFAULT_OPSET = 20


def dynamic_shapes_for(args: tuple, names: list[str], dynamic_axes: dict[str, list[int]] | None):
    """torch.export dynamic_shapes (one dict per positional input) from {name: [axes]}."""
    if not dynamic_axes:
        return None
    unknown = sorted(set(dynamic_axes) - set(names))
    if unknown:
        raise UsageError(f"--dynamic names unknown input(s) {unknown}: inputs are {names}")
    shapes = []
    for name, arg in zip(names, args):
        axes = dynamic_axes.get(name, [])
        bad = [a for a in axes if a >= arg.dim()]
        if bad:
            raise UsageError(f"--dynamic {name}:{','.join(map(str, axes))} names axis {bad[0]} but '{name}' has rank {arg.dim()}")
        shapes.append({a: torch.export.Dim.DYNAMIC for a in axes} or None)
    return tuple(shapes)


def to_exportable(module, args: tuple):
    """TorchScript modules cannot be traced by torch.export: convert them to an ExportedProgram
    first (torch's own TorchScript converter) and export its module."""
    if isinstance(module, torch.jit.ScriptModule):
        from torch._export.converter import TS2EPConverter

        return TS2EPConverter(module, args, {}).convert().module()
    return module


def convert_module(module, args: tuple, *, target: str = "trt", opset: int | None = None,
                   input_names: list[str] | None = None, output_names: list[str] | None = None,
                   dynamic_axes: dict[str, list[int]] | None = None,
                   report: dict | None = None, fold_bn: bool = True, swap_norms: bool = True,
                   rewrite: bool = True, verify: bool = True) -> onnx.ModelProto:
    """Export `module` called with `args` to ONNX for `target` (DESIGN §3).

    `report`, when given, receives the sections "fold_batchnorm", "prepare" and "rewrite"."""
    if target not in TARGETS:
        raise UsageError(f"unknown target '{target}': use one of {', '.join(TARGETS)}")
    opset = opset or DEFAULT_OPSET
    if opset < ops.MIN_OPSET:
        raise UsageError(f"--opset {opset} is too old for the torch.onnx exporter: use {ops.MIN_OPSET} or newer")
    report = report if report is not None else {}
    module = to_exportable(module, args)
    if isinstance(module, torch.nn.Module) and not isinstance(module, torch.fx.GraphModule):
        if fold_bn:
            from .fold_bn import fold_batchnorm

            report["fold_batchnorm"] = []
            module = fold_batchnorm(module, report["fold_batchnorm"], example_inputs=args)
        if swap_norms and target == "trt":  # other targets keep standard ops (see rewrite)
            from .swap import prepare

            report["prepare"] = []
            module = prepare(module, report["prepare"])
    names = list(input_names) if input_names else [f"input_{i}" for i in range(len(args))]
    model = _torch_onnx_export(module, args, names, output_names, dynamic_axes, opset)
    ops.attach_functions(model)
    if target != "trt":  # a model that calls normexport ops itself
        model = inline_custom_ops(model)
    if rewrite:
        from . import rewriter

        rw_report = rewriter.RewriteReport()
        model = rewriter.rewrite(model, target=target, verify=verify, report=rw_report)
        report["rewrite"] = rw_report.to_dict()
    return model


def _torch_onnx_export(module, args, names, output_names, dynamic_axes, opset) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        program = torch.onnx.export(
            module, args, dynamo=True, opset_version=opset, input_names=names, output_names=output_names,
            dynamic_shapes=dynamic_shapes_for(args, names, dynamic_axes),
            custom_translation_table=ops.TRANSLATION_TABLE, optimize=True, verbose=False,
        )
    return program.model_proto


def inline_custom_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """Replace every normexport op by its function body (standard ONNX ops only)."""
    if not ops.custom_nodes(model):
        return model
    ids = [(ops.DOMAIN, f.name) for f in model.functions if f.domain == ops.DOMAIN]
    model = onnx.inliner.inline_selected_functions(model, ids, exclude=False)
    keep = [o for o in model.opset_import if o.domain != ops.DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    return model


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Node counts by `domain::op_type` (default domain without prefix)."""
    counts: dict[str, int] = {}
    for n in model.graph.node:
        key = f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
        counts[key] = counts.get(key, 0) + 1
    return counts


__all__: list[Any] = ["convert_module", "inline_custom_ops", "op_counts", "TARGETS"]
