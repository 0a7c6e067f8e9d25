"""The weights of a causal LM checked by path (convert --target ort, stage 5b) written ahead: when
the ladder's judge gets such a file, before the norm rewrite, its q / k / v and gate / up projections
are packed (normexport.llm.packing) and its weights start streaming into the data file of the
temp folder the attention stage checks it in (llm.files.Workdir.write_data_behind: a forked
process), while this process runs the norm rewrite and the fusion passes (Python: one core; the
write: the other). The attention stage takes the folder where the file it fuses is this one
(`take`); a file the judge refused drops its own (`drop`). The attention fusion's local check's eager
steps start there too (llm.verify.EagerForked, another forked process: `Ahead.eager`), from the file
before the rewrite: its interface, hence their feeds, are the fused file's.

One owner: the run opens `with Prewrite() as ahead` (rec.prewrite, shared by every copy of the
record) and the stages ask it (`start`, `take`, `drop`); it closes whatever it started when the run
leaves it (success, error) or drops a failed attempt's before a retry (`close`). A stage run
without one (rec.prewrite None) writes nothing ahead.

Nothing is checked differently: the files the checks load are written from the final graphs, their
weights the same bytes (shared with the data file; a tensor a later pass made is appended to it)."""

from __future__ import annotations

import contextlib
import dataclasses

from .. import llm
from . import record
from .record import Record


@dataclasses.dataclass
class Ahead:
    """The folder whose data file is being written from `model` (packed in place: `groups`)."""

    workdir: object  # normexport.llm.files.Workdir
    model: object  # the onnx-ir model, packed
    groups: list
    #: the attention fusion's local check's eager steps, started from this file (llm.verify.EagerForked), or None
    eager: object = None

    def close(self) -> None:
        if self.eager is not None:
            self.eager.stop()
        self.workdir.close()


class Prewrite:
    """The one owner of the folders written ahead in one run: at most one open at a time (the file
    the ladder's judge has now), each closed by `close` (the run leaving, a retry) or `drop` (its
    file refused), also after the attention stage took it (Workdir.close: twice is harmless)."""

    def __init__(self) -> None:
        self._ahead: Ahead | None = None  # the folder of the file judged last (taken or not)
        self.calls = None  # the eager call's nn.Linear calls (llm.weight_plan.observe), where planned
        self._planned = None  # the folder whose data file is written from the plan, until a file takes it

    @contextlib.contextmanager
    def observing(self, rec: Record):
        """Around the eager call (convert.inputs): its nn.Linear calls recorded where the weights will be
        written ahead (`wanted_early`), for `plan`."""
        if not wanted_early(rec):
            yield
            return
        from ..llm import weight_plan

        with weight_plan.observe(rec.module) as calls:
            yield
        self.calls = calls

    def plan(self, rec: Record) -> None:
        """Before the export: the tensors the file will hold, predicted from the eager model and the
        calls `observing` saw (llm.weight_plan), start being written into the data file of the
        folder the attention stage will check in; `start` takes it for the file where they match."""
        calls, self.calls = self.calls, None  # (recorded only where `wanted_early`)
        if calls is None or not calls.order:
            return
        from ..llm import weight_plan
        from ..llm.files import Workdir

        entries = weight_plan.predict(rec.module, calls)
        if entries:
            self._planned = Workdir(rec.out)
            self._planned.write_planned(entries)

    def __enter__(self) -> "Prewrite":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, rec: Record) -> None:
        """Where `wanted`: rec.model_ir packed in place, its weights' write started."""
        if not wanted(rec):
            return
        from ..llm import packing
        from ..llm.files import Workdir

        planned, self._planned = self._planned, None
        self.close()  # (one folder at a time: the file judged before was refused or replaced)
        groups = packing.pack_siblings(rec.model_ir)
        if planned is not None:  # written since before the export: taken where its tensors are this file's
            why = planned.adopt(rec.model_ir)
            if why is None:
                self._ahead = Ahead(planned, rec.model_ir, groups)
            else:
                planned.close()
                print(f"  weights: the write started before the export is not this file's ({why}): written from "
                      "the file")
        if self._ahead is None:
            self._ahead = Ahead(Workdir(rec.out), rec.model_ir, groups)
            self._ahead.workdir.write_data_behind(rec.model_ir)
        if not self._ahead.workdir.writing_in_thread:  # (no fork beside a writing thread: a lock it holds
            self._ahead.eager = _eager_ahead(rec)  # would stay held in the child)

    def rewritten(self, before, after) -> None:
        """A pass returned `after` for `before` (the same graph and weights, edited in place)."""
        if self._ahead is not None and self._ahead.model is before:
            self._ahead.model = after

    def take(self, model_ir) -> Ahead | None:
        """The folder written ahead for `model_ir` (the file the attention stage fuses now), else None
        (one written for another file, or not for all of its tensors, is closed)."""
        ahead = self._ahead
        if ahead is not None and (ahead.model is not model_ir or not ahead.workdir.covers(model_ir)):
            self.close()  # (a pass rebuilt the weights' tensors: they would be written twice)
            return None
        return ahead

    def drop(self, model_ir) -> None:
        """The folder written ahead for `model_ir` closed (the judge refused that file)."""
        if self._ahead is not None and self._ahead.model is model_ir:
            self.close()

    def close(self) -> None:
        """The folder written ahead closed (its writer stopped), and one written from the plan not taken yet."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.close()
        planned, self._planned = self._planned, None
        if planned is not None:
            planned.close()


def _eager_ahead(rec: Record):
    """The attention fusion's local check's eager steps (llm.verify.EagerForked, a forked process) started
    now, from the exported file: the norm rewrite and the packing keep its interface, so its feeds are
    the fused file's (the fusion takes them where `serves` says so). On a 1.1B LLaMA they run beside the
    rewrite and the weights' write instead of after the fusion passes: convert 18.9 -> 17.7 s, 6
    alternating runs each, 2-vCPU VM. None where the fusion would not run them (a reference that is
    not float32)."""
    from ..llm import attention
    from ..llm.verify import EagerForked

    if attention._float32(rec.module) is None:
        return None
    return EagerForked(rec.model_ir, rec.module)


def wanted(rec: Record) -> bool:
    """The file will be fused and checked from files by the attention stage (its own conditions)."""
    from ..rewriter.driver import weight_bytes

    args = rec.args
    return (rec.task == llm.WITH_PAST and args.target == "ort" and "attention" not in rec.off
            and weight_bytes(rec.model_ir) > record.PARITY_LIMIT and fits_by_path(rec.model_ir))


def wanted_early(rec: Record) -> bool:
    """`wanted`, told before the export from the eager model's parameters (their bytes are the file's)."""
    import torch

    args = rec.args
    if rec.task != llm.WITH_PAST or args.target != "ort" or "attention" in rec.off or rec.module is None:
        return False
    try:
        params = {id(p): p for p in rec.module.parameters()}.values()
    except Exception:  # noqa: BLE001 - a module without parameters()
        return False
    size = sum(p.numel() * p.element_size() for p in params)
    return size > record.PARITY_LIMIT and _fits(size, any(p.dtype == torch.bfloat16 for p in params))


def fits_by_path(model_ir) -> bool:
    """A file over PARITY_LIMIT runs from files when its weights fit beside the eager model: their
    bytes in onnxruntime (bfloat16 widened to float32 there: twice) within BYPATH_MEMORY_SHARE of
    the memory available now."""
    import onnx_ir as ir

    from ..rewriter.driver import weight_bytes

    return _fits(weight_bytes(model_ir), any(v.const_value is not None and v.const_value.dtype == ir.DataType.BFLOAT16
                                             for v in model_ir.graph.initializers.values()))


def _fits(size: int, widened: bool) -> bool:
    """`size` bytes of weights (twice that where bfloat16 is widened) within BYPATH_MEMORY_SHARE of the
    memory available now."""
    free = record.available_memory()
    return free is not None and size * (2 if widened else 1) <= record.BYPATH_MEMORY_SHARE * free


def start(rec: Record) -> None:
    """Where the run has an owner (rec.prewrite): rec.model_ir's weights written ahead where `wanted`."""
    if rec.prewrite is not None:
        rec.prewrite.start(rec)


def observing(rec: Record):
    """Around the eager call: what `Prewrite.plan` needs recorded, where the run has an owner."""
    return rec.prewrite.observing(rec) if rec.prewrite is not None else contextlib.nullcontext()


def plan(rec: Record) -> None:
    """Before the export, where the run has an owner: the weights' write started from the plan."""
    if rec.prewrite is not None:
        rec.prewrite.plan(rec)


def take(rec: Record) -> Ahead | None:
    """The folder written ahead for rec.model_ir, else None."""
    return rec.prewrite.take(rec.model_ir) if rec.prewrite is not None else None
