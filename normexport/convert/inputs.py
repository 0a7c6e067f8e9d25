"""Stage 2, inputs: the call the file is exported from (normexport.load: --input / --inputs, what
the folder and the library say, a diffusers pipeline run once, --module's capture), run once in
eager (its outputs name the file's outputs), and the opset the dtype needs."""

from __future__ import annotations

import torch

from .. import load
from ..errors import UsageError, first_line
from ..load import call
from ..prepare.implementations import exportable_implementations
from . import prewrite, record
from .record import Record


def run(rec: Record) -> Record:
    args = rec.args
    job = load.call_for(rec.loaded, args.model, rec.input_args, args.dynamic, args.dtype, args.module,
                        inputs_file=getattr(args, "inputs", None))
    rec.loaded = loaded = job.loaded  # a diffusers pipeline folder's: the component it exports (load.pipeline)
    if getattr(loaded, "headline", None):  # docs/design.md §9: how a pipeline folder's inputs were made, said first
        print(loaded.headline)
    rec.module, rec.inputs, rec.names, rec.dynamic = job.module, job.inputs, job.names, job.dynamic
    # docs/design.md §9: transformers MoE experts / attention the exporters take, switched in place (so eager,
    # the float64 reference and the file agree)
    exportable_implementations(rec.module, rec.inputs, rec.sections.setdefault("implementations", []))
    # a causal LM that rejects the KV-cache call (a cache class of its own, a layer kind the DynamicCache
    # does not hold) can still be exported without the cache
    other = (", or export it without the KV cache: --task text-generation" if str(loaded.kind).endswith("-with-past")
             else "")
    with prewrite.observing(rec):  # (the nn.Linear calls, where the weights' write starts before the export)
        outputs = run_eager(rec.module, rec.inputs, other)
    names = loaded.output_names if loaded.output_names and not args.module else call.output_names(outputs)
    rec.output_structure = call.describe(outputs)  # the eager output's shape (a pipeline's runtime rebuilds it)
    # an output named like an input (UNet's `sample` in and out) would make the graph invalid (SSA)
    rec.output_names = [f"{n}_out" if n in rec.names else n for n in names] if names else names
    rec.opset = args.opset
    if rec.opset is None and (args.dtype == "bfloat16" or _has_bf16(rec.module, rec.inputs)):
        rec.opset = record.BF16_OPSET  # Conv, MatMul, Gemm, ... take bfloat16 from opset 22 on
    return rec


def run_eager(module, inputs: tuple, other: str = ""):
    """Run the model once (its own output structure, for the output names); a model that rejects
    the inputs is a usage error, not a crash (`other`: another way out, added to the message)."""
    shapes = ", ".join(("x".join(map(str, t.shape)) or "scalar") if isinstance(t, torch.Tensor) else type(t).__name__
                       for t in inputs)
    try:
        with torch.no_grad():
            if isinstance(module, call.CallAdapter):
                return module.call_inner(*inputs)
            return module(*inputs)
    except Exception as e:
        first = first_line(e, 200)
        raise UsageError(f"the model rejected inputs of shape {shapes} ({first}): give inputs it takes with "
                         "--input NAME:DIMS[:DTYPE], or record a real call with normexport.capture and pass it "
                         f"with --inputs FILE{other}") from None


def _has_bf16(module, inputs) -> bool:
    """The model runs in bfloat16 (a folder stored so, a bf16 factory): its inputs or weights."""
    if any(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in inputs):
        return True
    try:
        return any(p.dtype == torch.bfloat16 for p in module.parameters())
    except Exception:  # noqa: BLE001 - a module without parameters()
        return False
