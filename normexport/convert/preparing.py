"""Stage 3, prepare: the torch-side steps before export (normexport.prepare.for_export: MoE /
attention implementations, BatchNorm folded, complex arithmetic lowered, norms swapped for trt),
each verified where it happens and reported."""

from __future__ import annotations

from ..errors import UsageError
from ..export import DEFAULT_OPSET, TARGETS, to_exportable
from .. import ops
from ..prepare.for_export import prepare_for_export
from .record import Record


def run(rec: Record) -> Record:
    target = rec.args.target
    if target not in TARGETS:
        raise UsageError(f"unknown target '{target}': use one of {', '.join(TARGETS)}")
    if (rec.opset or DEFAULT_OPSET) < ops.MIN_OPSET:
        raise UsageError(f"--opset {rec.opset} is too old for the torch.onnx exporter: use {ops.MIN_OPSET} or newer")
    rec.exportable, rec.unswapped = prepare_for_export(to_exportable(rec.module, rec.inputs), rec.inputs,
                                                       target=target, report=rec.sections)
    return rec
