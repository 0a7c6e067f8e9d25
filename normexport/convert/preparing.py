"""Stage 3, prepare: the torch-side steps before export (normexport.prepare.for_export: MoE /
attention implementations, BatchNorm folded, complex arithmetic lowered, norms swapped for trt),
each verified where it happens and reported (normexport.export.prepare_module: the API's step too)."""

from __future__ import annotations

from ..export import prepare_module
from .record import Record


def run(rec: Record) -> Record:
    rec.exportable, rec.unswapped = prepare_module(rec.module, rec.inputs, target=rec.args.target, opset=rec.opset,
                                                   report=rec.sections)
    return rec
