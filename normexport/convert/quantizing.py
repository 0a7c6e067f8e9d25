"""Stage 8, quantize (--quantize; docs/design.md §15): the file the writing stage wrote is quantized
by onnxruntime's own tooling (normexport.quantize), judged as quantized against eager, and put in the
float file's place only when it passes; without --quantize the stage does nothing."""

from __future__ import annotations

from .. import quantize
from .record import Record


def refuse_early(args) -> dict | None:
    """--quantize's options, or the one-line refusal of a kind the target cannot serve (before loading)."""
    return quantize.refuse_early(args)


def refuse_unquantizable(rec: Record) -> Record:
    """Before the writing stage: a model --quantize cannot serve (no weight of the kind it
    quantizes) is refused in one line, nothing written."""
    if rec.quant is not None and rec.passed:
        quantize.refuse_unquantizable(rec)
    return rec


def run(rec: Record) -> Record:
    if rec.quant is None or rec.exit_code != 0:
        return rec
    return quantize.run(rec)
