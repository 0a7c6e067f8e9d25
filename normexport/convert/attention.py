"""Stage 5b, attention (issue 31): for a causal LM with its cache and --target ort, the attention as
onnxruntime's GroupQueryAttention where it is verified (normexport.llm.attention: a masked run and
a local comparison here, the generation check of the check stage on the fused file; when that
fails the decomposed file is checked and kept). Says on the terminal why it is not fused."""

from __future__ import annotations

import onnx_ir as ir

from .. import llm
from . import prewrite, record
from .record import Record


def run(rec: Record) -> Record:
    args = rec.args
    if rec.task == llm.WITH_PAST and rec.model is None and prewrite.fits_by_path(rec.model_ir):
        return _by_path(rec)
    if rec.task != llm.WITH_PAST or args.target != "ort":
        return rec
    if "attention" in rec.off:
        print(f"  attention: decomposed ({rec.off['attention']})")
        return rec
    if rec.model is None:
        print(f"  attention: decomposed (GroupQueryAttention is fused only where convert runs the file: its "
              f"weights at most {record.BYPATH_MEMORY_SHARE:.0%} of the memory available)")
        return rec
    from ..llm import attention

    rec.fused, rec.decomposed = attention.for_convert(rec.model_ir, rec.module), (rec.model_ir, rec.model)
    if rec.fused.model is not None:
        from ..llm import packing  # q / k / v and gate / up projections packed, checked against the fused file

        rec.packing = packing.for_convert(rec.fused.model)
        print(packing.line(rec.packing))
        if rec.packing.model is not None:
            rec.fused.model = rec.packing.model
        rec.model_ir, rec.model = rec.fused.model, ir.serde.serialize_model(rec.fused.model)
    if rec.fused.model is None or args.no_check:
        print(attention.line(rec.fused, "generation check not run (--no-check)" if args.no_check else None))
    return rec


def _by_path(rec: Record) -> Record:
    """A causal LM over PARITY_LIMIT (normexport.llm.bypath): the decomposed file written once into a
    temp folder beside the output, fused (--target ort) and checked by greedy generation from files
    there, one onnxruntime session at a time; the check is this stage's (its tables printed here);
    the write stage places the kept file by renames."""
    from ..llm import bypath

    args = rec.args
    fuse = args.target == "ort" and "attention" not in rec.off
    if args.target == "ort" and not fuse:
        print(f"  attention: decomposed ({rec.off['attention']})")
    model_ir = rec.model_ir
    ahead = prewrite.take(rec)  # packed, its weights being written since the judge (convert.prewrite)
    if fuse:  # q / k / v and gate / up packed before the decomposed file is written (its weights written once,
        from ..llm import packing  # packed): verified with the fusion by the local and generation checks

        if ahead is not None:  # (packed before the norm rewrite: the count it would have had unpacked now)
            groups = ahead.groups
            before = sum(1 for _ in model_ir.graph) + sum(len(g["matmuls"]) - 2 for g in groups)
        else:
            before = sum(1 for _ in model_ir.graph)
            model_ir = model_ir.clone()
            groups = packing.pack_siblings(model_ir)
        rec.packing = packing.Packing(model_ir, groups, nodes_before=before,
                                      nodes_after=sum(1 for _ in model_ir.graph),
                                      reason="checked with the attention fusion (file over the in-memory limit)")
        print(packing.line_by_path(rec.packing))
    checked = rec.bypath = bypath.fuse_and_check(model_ir, rec.module, rec.out, fuse=fuse, check=not args.no_check,
                                                 workdir=ahead.workdir if ahead is not None else None,
                                                 eager=ahead.eager if ahead is not None else None)
    if rec.packing is not None and checked.fusion is not None:
        rec.packing.packed_qkv = checked.fusion.packed_qkv
    rec.fused, rec.model_ir = checked.fusion, checked.model_ir
    rec.result, rec.checked, rec.passed = checked.generation, checked.generation is not None, checked.passed
    return rec
