"""The weights of a causal LM checked by path (convert --target ort, stage 5b) written ahead: when
the ladder's judge gets such a file, before the norm rewrite, its q / k / v and gate / up projections
are packed (normexport.llm.packing) and its weights start streaming into the data file of the
temp folder the attention stage checks it in (llm.files.Workdir.write_data_behind: a forked
process), while this process runs the norm rewrite and the fusion passes (Python: one core; the
write: the other). The attention stage takes the folder where the file it fuses is this one
(`take`); anything else closes it (a file the judge refused, an error, a file exported again).

Nothing is checked differently: the files the checks load are written from the final graphs, their
weights the same bytes (shared with the data file; a tensor a later pass made is appended to it)."""

from __future__ import annotations

import dataclasses

from .. import llm
from . import record
from .record import Record


@dataclasses.dataclass
class Prewrite:
    """The folder whose data file is being written from `model` (packed in place: `groups`)."""

    workdir: object  # normexport.llm.files.Workdir
    model: object  # the onnx-ir model, packed
    groups: list

    def close(self) -> None:
        self.workdir.close()


def wanted(rec: Record) -> bool:
    """The file will be fused and checked from files by the attention stage (its own conditions)."""
    from ..rewriter.driver import weight_bytes

    args = rec.args
    return (rec.task == llm.WITH_PAST and args.target == "ort" and "attention" not in rec.off
            and weight_bytes(rec.model_ir) > record.PARITY_LIMIT and fits_by_path(rec.model_ir))


def fits_by_path(model_ir) -> bool:
    """A file over PARITY_LIMIT runs from files when its weights fit beside the eager model: their
    bytes in onnxruntime (bfloat16 widened to float32 there: twice) within BYPATH_MEMORY_SHARE of
    the memory available now."""
    import onnx_ir as ir

    from ..rewriter.driver import weight_bytes

    free = record.available_memory()
    widened = any(v.const_value is not None and v.const_value.dtype == ir.DataType.BFLOAT16
                  for v in model_ir.graph.initializers.values())
    return free is not None and weight_bytes(model_ir) * (2 if widened else 1) <= record.BYPATH_MEMORY_SHARE * free


def start(rec: Record) -> Record:
    """Where `wanted`: rec.model_ir packed in place, its weights' write started (rec.prewrite)."""
    if rec.prewrite is not None or not wanted(rec):
        return rec
    from ..llm import packing
    from ..llm.files import Workdir

    groups = packing.pack_siblings(rec.model_ir)
    wd = Workdir(rec.out)
    try:
        wd.write_data_behind(rec.model_ir)
    except BaseException:
        wd.close()
        raise
    rec.prewrite = Prewrite(wd, rec.model_ir, groups)
    return rec


def take(rec: Record) -> Prewrite | None:
    """The folder written ahead for the file the attention stage fuses now (rec.model_ir), else
    None (one written for another file is closed)."""
    pre, rec.prewrite = rec.prewrite, None
    if pre is not None and (pre.model is not rec.model_ir or not pre.workdir.covers(rec.model_ir)):
        pre.close()  # (a pass rebuilt the weights' tensors: they would be written twice)
        return None
    return pre


def close(rec: Record) -> None:
    if rec.prewrite is not None:
        rec.prewrite.close()
        rec.prewrite = None
