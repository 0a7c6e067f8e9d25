"""Stage 5b, attention (issue 31): for a causal LM with its cache and --target ort, the attention as
onnxruntime's GroupQueryAttention where it is verified (normexport.llm.attention: a masked run and
a local comparison here, the generation check of the check stage on the fused file; when that
fails the decomposed file is checked and kept). Says on the terminal why it is not fused."""

from __future__ import annotations

import onnx_ir as ir

from .. import llm
from . import record
from .record import Record


def run(rec: Record) -> Record:
    args = rec.args
    if rec.task != llm.WITH_PAST or args.target != "ort":
        return rec
    if "attention" in rec.off:
        print(f"  attention: decomposed ({rec.off['attention']})")
        return rec
    if rec.model is None:
        print(f"  attention: decomposed (GroupQueryAttention is fused only where convert runs the file: up to "
              f"{record.PARITY_LIMIT / 2**30:.0f} GiB of weights)")
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
