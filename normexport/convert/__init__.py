"""`normexport convert MODEL`: one pass of stages over one record (record.py), each a module that
takes the record and returns it, none calling back up:

    loading    where the file goes, the fusions turned off, the model loaded, a causal LM's task
    inputs     the call exported (normexport.load), run once in eager; the opset the dtype needs
    preparing  the torch-side steps (normexport.prepare.for_export)
    exporting  the exporter ladder (normexport.exporter.ladder), given its judge: each file it
               exports goes through rewriting (the ONNX rewrite passes) and checking.judge (parity)
    attention  a causal LM's attention as onnxruntime's GroupQueryAttention (--target ort)
    checking   the check shown, or run (greedy generation for a causal LM with its cache)
    writing    the report, the file (atomically, only when checked), a causal LM's deployable folder
    quantizing --quantize: the written file quantized (normexport.quantize), judged as quantized,
               put in its place only when it passes

prewrite.py is not a stage: the weights of a causal LM checked by path written ahead, one owner the
run opens around the stages from inputs on (rec.prewrite), started before the export from the eager
model's layout where predicted (llm.weight_plan), else by the rewrite stage, taken by
the attention stage, dropped for a file the ladder refused, closed when the run leaves it.
"""

from __future__ import annotations

import argparse

from ..export import TARGETS
from ..quantize import add_arguments as add_quantize_arguments
from ..rewriter.cli import add_switches
from . import attention, checking, exporting, inputs, loading, prewrite, preparing, quantizing, rewriting, writing
from .loading import default_output  # noqa: F401 - the default output path, for callers
from .record import Record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="x.pt2 | x.pt/x.pth (TorchScript, or pickle with --trust-pickle) | "
                   "package.module:callable | a save_pretrained folder (transformers, diffusers)")
    p.add_argument("-o", "--output", metavar="OUT.onnx", help="default: MODEL's stem + .onnx beside it; DIR/ (a "
                   "trailing slash): a folder holding model.onnx (a causal LM's: with genai_config.json, its config and "
                   "tokenizer files, for onnxruntime-genai and optimum; another transformers folder's: with its config, "
                   "tokenizer, processor and sentence-transformers files)")
    p.add_argument("--input", action="append", default=[], metavar="NAME:DIMS[:DTYPE]", help="e.g. x:2x16x64 (positional, forward order)")
    p.add_argument("--inputs", metavar="FILE", help="example inputs: a torch.save'd (args, kwargs) of one call, e.g. "
                   "recorded with `with normexport.capture(model, FILE): pipeline(...)` (loaded with weights_only=True)")
    p.add_argument("--dynamic", action="append", default=[], metavar="NAME:AXES", help="dynamic axes of input NAME, e.g. x:0,1")
    p.add_argument("--module", metavar="NAME", help="export only this submodule (e.g. model.layers.0), with the inputs "
                   "it receives in a forward of the whole model")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import an installed module first (registers the pytree types a .pt2 names)")
    p.add_argument("--target", choices=TARGETS, default="trt")
    p.add_argument("--task", choices=("text-generation-with-past", "text-generation"), default=None,
                   help="causal LMs (folder, factory, pickle): with the KV cache as inputs / outputs (default; "
                        "checked by greedy generation) or the plain input_ids -> logits graph (docs/design.md §10; the default "
                        "for a model whose cache is not a KV cache)")
    p.add_argument("--opset", type=int, default=None)
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None, help="cast the model and its float inputs")
    p.add_argument("--weights", metavar="FILE", help="state dict for a module:callable MODEL (loaded with weights_only=True)")
    p.add_argument("--trust-pickle", action="store_true", help="allow unpickling a pickled nn.Module (runs code from the file)")
    p.add_argument("--no-check", action="store_true", help="skip the onnxruntime parity check")
    p.add_argument("--report", metavar="FILE.json", help="write a JSON report")
    add_switches(p)  # --no-residual-fusion, --no-fuse MODULE (the rewriter's rule switches)
    add_quantize_arguments(p)  # --quantize int4|int8|fp8 and the int4 options (docs/design.md §15)


def run(args) -> int:
    return convert(args).exit_code


def convert(args, loaded=None) -> Record:
    """The stages over one record; `loaded`: a model already in memory (a normexport.load
    LoadedModel, e.g. one component of a pipeline folder), used in place of loading args.model.
    A pre-quantized folder (GPTQ / AWQ / compressed-tensors int4, docs/design.md §15) runs on its
    dequantized float folder, its packed weights kept for the int4 stage."""
    from ..quantize import prequantized

    source = prequantized.open_source(args) if loaded is None else None  # unsupported: one line, nothing written
    if source is None:
        return _convert(args, loaded)
    with source:  # (its temp float folder removed on leaving)
        return _convert(source.args, None, source)


def _convert(args, loaded=None, source=None) -> Record:
    from ..quantize import prequantized

    rec = Record(args=args, loaded=loaded, prequantized=source)
    rec.quant = quantizing.refuse_early(args)  # a --quantize the target cannot serve: one line, nothing loaded
    if source is not None:
        rec.quant = prequantized.options(source, rec.quant)
    rec = loading.run(rec)
    # the ladder's judge: each exported file rewritten, then (where convert checks it) its parity
    judge = lambda candidate: checking.judge(rewriting.run(candidate))  # noqa: E731
    with prewrite.Prewrite() as rec.prewrite:  # the weights written ahead: one owner, closed on leaving
        rec = preparing.run(inputs.run(rec))  # (inputs: the eager call's nn.Linear calls seen, for the plan)
        prewrite.plan(rec)  # a causal LM checked by path: its weights' write started from the eager model
        before = rec  # the record as the exporting stage finds it: each attempt works on a copy of its own
        rec = exporting.run(before.copy(), judge=judge)
        try:
            rec = attention.run(rec)
            if _grown_wrong(rec):  # the file grown from a shallow trace is not eager's: exported whole instead
                rec = exporting.run(_without_depth(rec, before), judge=judge)
                rec = attention.run(rec)
            before = None  # (the record as exporting found it: no longer needed; what it holds can be released)
            for stage in (checking.run, quantizing.refuse_unquantizable, writing.run, quantizing.run):
                rec = stage(rec)
        finally:
            if rec.bypath is not None:  # the temp folder of a file checked from files: never left behind
                rec.bypath.close()
    return rec


def _grown_wrong(rec: Record) -> bool:
    """The attention fusion's local check found the decomposed file (grown to full depth from a
    shallow trace, normexport.exporter.depth) unlike eager."""
    grown = (rec.sections.get("depth") or {}).get("grown")
    return bool(grown and rec.fused is not None and rec.fused.local.get("eager_failed"))


def _without_depth(failed: Record, before: Record) -> Record:
    """The failed attempt's files dropped; a copy of the record as the export stage found it (`before`),
    the shallow trace turned off (said on the terminal)."""
    print(f"  depth: the grown file FAILED against eager ({failed.fused.local.get('reason')}): exporting the whole "
          "decoder instead")
    if failed.bypath is not None:
        failed.bypath.close()
    failed.prewrite.close()  # (the failed file's weights written ahead)
    rec = before.copy()
    rec.off = {**rec.off, "depth": "the grown file failed against eager"}
    return rec
