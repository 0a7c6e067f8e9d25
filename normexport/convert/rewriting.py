"""Stage 5, rewrite: the ONNX rewrite passes on one exported file (canonical forms, the norm
fusions, BN folds; every fusion verified locally; normexport.rewriter). Run by the ladder's judge
on each file it exports."""

from __future__ import annotations

from .. import rewriter
from . import prewrite
from .record import Record


def run(rec: Record) -> Record:
    prewrite.start(rec)  # a causal LM checked by path: its weights written while the rewrite runs
    report = rewriter.RewriteReport()
    model_ir = rec.model_ir
    rec.model_ir = rewriter.rewrite_ir(model_ir, target=rec.args.target, verify=True, report=report, off=rec.off)
    if rec.prewrite is not None:  # (the rewrite edits the graph in place; its weights are the same tensors)
        rec.prewrite.rewritten(model_ir, rec.model_ir)
    rec.rewrite = report.to_dict()
    return rec
