"""Stage 4, the export ladder (normexport.export.run_ladder, the API's too): each exported file goes
to the judge this stage is given (convert: the rewrite stage, then the check stage's parity
judgement) as a record of its own; the first one accepted goes on. Then the file is made one
protobuf where it fits (ONNX checker), the axes it keeps dynamic read, and what was done said on
the terminal."""

from __future__ import annotations

import dataclasses
from typing import Callable

import onnx_ir as ir

from .. import io, llm
from ..errors import ExportError, UsageError
from ..export import op_counts, run_ladder
from ..load.model import LoadedModel
from ..rewriter.driver import interface, weight_bytes
from . import record, summary
from .record import Record


def run(rec: Record, judge: Callable[[Record], Record]) -> Record:
    args = rec.args

    def on_file(model_ir, kept):  # a candidate record per exported file; the judge says whether it is kept
        cand = dataclasses.replace(rec, model_ir=model_ir, kept=kept, rewrite=None, model=None, result=None,
                                   checked=False, passed=True)
        cand = judge(cand)
        if not cand.passed and cand.prewrite is not None:  # its weights written ahead not needed (convert.prewrite)
            cand.prewrite.drop(cand.model_ir)
        return cand.passed, cand

    plan = None
    if rec.task == llm.WITH_PAST and "depth" not in rec.off:  # identical blocks: traced 2 deep, grown (exporter.depth)
        from ..llm import shallow

        plan = shallow.plan(rec.exportable, rec.inputs, rec.names, rec.output_names, rec.dynamic)
    try:
        rec = run_ladder(rec.exportable, rec.unswapped, rec.inputs, target=args.target, opset=rec.opset,
                         names=rec.names, output_names=rec.output_names, dynamic_axes=rec.dynamic,
                         auto_dynamic=bool(args.module), judge=on_file, report=rec.sections, plan=plan,
                         fewer=rec.loaded.fewer_axes if isinstance(rec.loaded, LoadedModel) else None,
                         required=rec.loaded.required_axes if isinstance(rec.loaded, LoadedModel) else None)
        if rec.task == llm.WITH_PAST:
            llm.name_dims(rec.model_ir, rec.module.layout.layers)
            rec.model = None  # renamed dims: serialised again below
        # small: one protobuf for the checker and the parity check; large: the onnx-ir model is
        # streamed to disk and checked there by path (docs/design.md §8: never one protobuf)
        if rec.model is None and weight_bytes(rec.model_ir) <= record.PARITY_LIMIT:
            rec.model = ir.serde.serialize_model(rec.model_ir)
            io.check_onnx(rec.model, workdir=rec.out.parent)
        # the axes the file keeps dynamic (--module: those torch.export kept; docs/design.md §9: a lower rung)
        rec.kept = onnx_dynamic_axes(rec.model if rec.model is not None else interface(rec.model_ir))
    except (UsageError, ExportError):
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
        if "unsupported type: tensor(bfloat16)" in first and (rec.opset or 0) < record.BF16_OPSET:
            raise UsageError(f"an ONNX op of the model has no bfloat16 form at opset {rec.opset}: pass "
                             f"--opset {record.BF16_OPSET} or newer") from None
        raise ExportError(f"{type(e).__name__}: {first}") from None
    for line in summary.lines(rec, op_counts(rec.model if rec.model is not None else rec.model_ir)):
        print(line)
    return rec


def onnx_dynamic_axes(model) -> dict[str, list[int]]:
    """{input name: [axes with a symbolic dim]} of an ONNX model's graph inputs."""
    inits = {t.name for t in model.graph.initializer}
    axes = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dims = [i for i, d in enumerate(vi.type.tensor_type.shape.dim) if d.HasField("dim_param") or not d.HasField("dim_value")]
        if dims:
            axes[vi.name] = dims
    return axes
