"""Stage 6, check: the file against eager and the float64 reference (normexport.parity; docs/design.md §7),
or for a causal LM with its cache by greedy generation (normexport.parity.generate; docs/design.md §10).

`judge` is the ladder's judge (after the rewrite stage): the parity check of one candidate file,
quiet. `run` is the stage: it shows the judged result, or runs the check the ladder did not (the
generation check, which also verifies the attention fusion), or says why none runs here."""

from __future__ import annotations

import onnx_ir as ir

from .. import io, llm
from ..rewriter.driver import weight_bytes
from . import record
from .record import Record


def judge(rec: Record) -> Record:
    """The parity check of one file of the exporter ladder (docs/design.md §9: the first file that passes
    is kept); a file over PARITY_LIMIT is accepted unchecked (checked by path once written)."""
    if not rec.ladder_check or weight_bytes(rec.model_ir) > record.PARITY_LIMIT:
        return rec
    from ..parity import check

    rec.model = ir.serde.serialize_model(rec.model_ir)
    io.check_onnx(rec.model, workdir=rec.out.parent)
    rec.result = check(rec.model, rec.module, rec.inputs, dynamic_axes=rec.kept, command="convert",
                       plain_export=rec.plain_export(rec.loaded.output_names))
    rec.checked, rec.passed = True, rec.result.passed
    return rec


def run(rec: Record) -> Record:
    args = rec.args
    if args.no_check:
        rec.passed = True
        return rec
    if rec.bypath is not None:  # checked from files with the attention fusion (its tables shown there)
        return rec
    if rec.model is None:
        nbytes = weight_bytes(rec.model_ir)
        print(f"parity: not run here ({nbytes / 2**30:.2f} GiB of weights; convert checks whole models up to "
              f"{record.PARITY_LIMIT / 2**30:.0f} GiB); for the whole model run "
              f"`normexport check {rec.out.name} --reference {args.model}`")
        rec.parity_note = f"not run: {nbytes / 2**30:.2f} GiB of weights"
        rec.passed = True
        return rec
    if rec.task == llm.WITH_PAST:  # docs/design.md §10: verified by greedy generation
        return _generation(rec)
    if not rec.checked:
        rec = judge(rec)
    print(rec.result.table())
    return rec


def _generation(rec: Record) -> Record:
    from ..parity.generate import check_generation

    def generation(model):
        return check_generation(model, rec.module, command="convert", plain_export=rec.plain_export(rec.output_names))

    result = generation(rec.model)
    fused = rec.fused
    if fused is not None and fused.model is not None:  # the generation check is the fusion's verification
        from ..llm import attention

        if not result.passed:  # never silent: the failed check is shown, the decomposed file checked and kept
            print(result.table())
            fused.model, fused.reason = None, "the fused file FAILED the generation check (table above)"
            rec.model_ir, rec.model = rec.decomposed
            result = generation(rec.model)
        print(attention.line(fused, "generation check PASSED on the fused file" if fused.model else None))
    print(result.table())
    rec.result, rec.checked, rec.passed = result, True, result.passed
    return rec
