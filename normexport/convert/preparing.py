"""Stage 3, prepare: the torch-side steps before export (normexport.prepare.for_export: MoE /
attention implementations, BatchNorm folded, complex arithmetic lowered, norms swapped for trt),
each verified where it happens and reported."""

from __future__ import annotations

from ..export import checked_opset, to_exportable
from ..prepare.for_export import prepare_for_export
from .record import Record


def run(rec: Record) -> Record:
    target = rec.args.target
    checked_opset(target, rec.opset)  # refused before any preparation
    rec.exportable, rec.unswapped = prepare_for_export(to_exportable(rec.module, rec.inputs), rec.inputs,
                                                       target=target, report=rec.sections)
    return rec
