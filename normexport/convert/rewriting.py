"""Stage 5, rewrite: the ONNX rewrite passes on one exported file (canonical forms, the norm
fusions, BN folds; every fusion verified locally; normexport.rewriter). Run by the ladder's judge
on each file it exports."""

from __future__ import annotations

from .. import rewriter
from .record import Record


def run(rec: Record) -> Record:
    report = rewriter.RewriteReport()
    rec.model_ir = rewriter.rewrite_ir(rec.model_ir, target=rec.args.target, verify=True, report=report, off=rec.off)
    rec.rewrite = report.to_dict()
    return rec
