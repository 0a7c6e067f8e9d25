"""`normexport convert MODEL`: load, export with fused norm ops, check parity, write atomically."""

from __future__ import annotations

import argparse
from pathlib import Path

import onnx_ir as ir
import torch

from . import io, llm, load
from .rewriter import switches
from .rewriter.cli import add_switches
from .rewriter.driver import interface, weight_bytes
from .errors import ExportError, UsageError, first_line
from .export import TARGETS, convert_module, convert_module_ir, op_counts
from .load import call
from .prepare.implementations import exportable_implementations, summary_lines as implementation_lines
from .prepare.complex import summary_lines as complex_lines
from .prepare.swap import summary_lines as swap_lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="x.pt2 | x.pt/x.pth (TorchScript, or pickle with --trust-pickle) | "
                   "package.module:callable | a save_pretrained folder (transformers, diffusers)")
    p.add_argument("-o", "--output", metavar="OUT.onnx", help="default: MODEL's stem + .onnx beside it; DIR/ (a "
                   "trailing slash): a folder holding model.onnx (a causal LM's: with genai_config.json, its config and "
                   "tokenizer files, for onnxruntime-genai and optimum)")
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
                        "checked by greedy generation) or the plain input_ids -> logits graph (DESIGN §10; the default "
                        "for a model whose cache is not a KV cache)")
    p.add_argument("--opset", type=int, default=None)
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None, help="cast the model and its float inputs")
    p.add_argument("--weights", metavar="FILE", help="state dict for a module:callable MODEL (loaded with weights_only=True)")
    p.add_argument("--trust-pickle", action="store_true", help="allow unpickling a pickled nn.Module (runs code from the file)")
    p.add_argument("--no-check", action="store_true", help="skip the onnxruntime parity check")
    p.add_argument("--report", metavar="FILE.json", help="write a JSON report")
    add_switches(p)  # --no-residual-fusion, --no-fuse MODULE (the rewriter's rule switches)


def default_output(model: str, module: str | None = None) -> Path:
    if load.is_factory(model):
        mod, _, attr = model.partition(":")
        path = Path.cwd() / f"{mod.rsplit('.', 1)[-1]}_{attr}.onnx"
    else:
        path = Path(model).with_suffix(".onnx")
    return path.with_name(f"{path.stem}.{module}.onnx") if module else path


def run_eager(module, inputs: tuple):
    """Run the model once (its own output structure, for the output names); a model that rejects
    the inputs is a usage error, not a crash."""
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
                         "with --inputs FILE") from None


#: the first opset whose Conv / Gemm / MatMul / Pow ... accept bfloat16; `--dtype bfloat16` exports
#: at it unless --opset says otherwise
BF16_OPSET = 22


def run(args) -> int:
    from . import __version__
    from .parity import check

    from .llm import deploy

    # `-o DIR/`: the output is a folder, the file DIR/model.onnx (DESIGN §10's deployable folder)
    out = io.check_writable(deploy.output_path(args.output) or default_output(args.model, args.module))
    # the fusions turned off: the flags, and the deprecated NORMEXPORT_RESIDUAL_FUSION=0 (checked before loading)
    off = switches.resolve(switches.from_flags(getattr(args, "no_residual_fusion", False), getattr(args, "no_fuse", ())))
    if args.report:
        io.check_writable(args.report, "--report")
    loaded = load.load(args.model, trust_pickle=args.trust_pickle, weights=args.weights, imports=args.imports)
    task, loaded, input_args, why = llm.resolve(loaded, getattr(args, "task", None), args.module, args.input)
    if task is not None:  # DESIGN §10: the first line says which graph a causal LM exports (and why, if not the cache)
        print(f"task {task}" + (f" (default here: {why})" if why else
                                " (default for causal-LM folders, factories and pickles; --task text-generation for "
                                "input_ids -> logits)" if getattr(args, "task", None) is None and task == llm.WITH_PAST
                                else ""))
    job = load.call_for(loaded, args.model, input_args, args.dynamic, args.dtype, args.module,
                        inputs_file=getattr(args, "inputs", None))
    loaded = job.loaded  # a diffusers pipeline folder's: the component it exports (normexport.load.pipeline)
    if getattr(loaded, "headline", None):  # DESIGN §9: how a pipeline folder's inputs were made, said first
        print(loaded.headline)
    module, inputs, names, dynamic = job.module, job.inputs, job.names, job.dynamic
    switched: list = []  # DESIGN §9: transformers MoE experts / attention the exporters take, switched in place
    exportable_implementations(module, inputs, switched)  # (so eager, the float64 reference and the file agree)
    outputs = run_eager(module, inputs)
    output_names = loaded.output_names if loaded.output_names and not args.module else call.output_names(outputs)
    # an output named like an input (UNet's `sample` in and out) would make the graph invalid (SSA)
    output_names = [f"{n}_out" if n in names else n for n in output_names] if output_names else output_names

    opset = args.opset
    if opset is None and (args.dtype == "bfloat16" or _has_bf16(module, inputs)):
        opset = BF16_OPSET  # Conv, MatMul, Gemm, ... take bfloat16 from opset 22 on
    sections: dict = {"implementations": switched}
    checked: list = []  # (model_ir, proto, parity result, kept axes) of the files the exporter ladder made

    def accept(model_ir, kept):
        """DESIGN §9: the exporter ladder keeps the first file whose parity passes."""
        if weight_bytes(model_ir) > PARITY_LIMIT:
            return True  # checked by path once written; parity is not run here
        proto = ir.serde.serialize_model(model_ir)
        io.check_onnx(proto, workdir=out.parent)
        result = check(proto, module, inputs, dynamic_axes=kept, command="convert",
                       plain_export=lambda: convert_module(  # DESIGN §7: the plain export, built on demand
                           module, inputs, target="onnx", opset=opset, input_names=names,
                           output_names=loaded.output_names, dynamic_axes=kept,
                           fold_bn=False, swap_norms=False, rewrite=False))
        checked.append((model_ir, proto, result, kept))
        del checked[1:-1]  # the first file (shown when none passes) and the last
        return result.passed

    ladder_check = not args.no_check and task != llm.WITH_PAST
    try:
        model_ir = convert_module_ir(module, inputs, target=args.target, opset=opset, input_names=names,
                                     output_names=output_names, dynamic_axes=dynamic, report=sections,
                                     auto_dynamic=bool(args.module), accept=accept if ladder_check else None,
                                     rewrite_off=off)
        hit = next((c for c in checked if c[0] is model_ir), None)
        checked.clear()
        if task == llm.WITH_PAST:
            llm.name_dims(model_ir, module.layout.layers)
        nbytes = weight_bytes(model_ir)
        # small: one protobuf for the checker and the parity check; large: the onnx-ir model is
        # streamed to disk and checked there by path (DESIGN §8: never one protobuf)
        if hit is not None:
            model = hit[1]
        else:
            model = ir.serde.serialize_model(model_ir) if nbytes <= PARITY_LIMIT else None
            if model is not None:
                io.check_onnx(model, workdir=out.parent)
        # the axes the file keeps dynamic (--module: those torch.export kept; DESIGN §9: a lower rung)
        dynamic = onnx_dynamic_axes(model if model is not None else interface(model_ir))
    except (UsageError, ExportError):
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
        if "unsupported type: tensor(bfloat16)" in first and (opset or 0) < BF16_OPSET:
            raise UsageError(f"an ONNX op of the model has no bfloat16 form at opset {opset}: pass "
                             f"--opset {BF16_OPSET} or newer") from None
        raise ExportError(f"{type(e).__name__}: {first}") from None

    counts = op_counts(model if model is not None else model_ir)
    what = f"{args.model} --module {args.module}" if args.module else args.model
    ex = sections.get("exporter", {})
    print(f"exported {what} -> {out.name} (target {args.target}, {_rung_text(ex)}): " + _fused_summary(counts))
    for line in _exporter_lines(ex, names, inputs):
        print(line)
    for line in (implementation_lines(switched) + complex_lines(sections.get("prepare") or [])
                 + swap_lines(sections.get("prepare") or [])):
        print(line)
    for line in _rewrite_lines(sections.get("rewrite")):
        print(line)
    for note in getattr(loaded, "notes", ()):  # e.g. sizes the forward fixes (normexport.load)
        print(f"  note: {note}")
    fused = None  # issue 31: the attention as onnxruntime's GroupQueryAttention, where verified (normexport.llm.attention)
    if task == llm.WITH_PAST and args.target == "ort" and "attention" in off:
        print(f"  attention: decomposed ({off['attention']})")
    elif task == llm.WITH_PAST and args.target == "ort" and model is not None:
        from .llm import attention

        fused, decomposed = attention.for_convert(model_ir, module), (model_ir, model)
        if fused.model is not None:
            model_ir, model = fused.model, ir.serde.serialize_model(fused.model)
        if fused.model is None or args.no_check:
            print(attention.line(fused, "generation check not run (--no-check)" if args.no_check else None))
    elif task == llm.WITH_PAST and args.target == "ort":
        print(f"  attention: decomposed (GroupQueryAttention is fused only where convert runs the file: up to "
              f"{PARITY_LIMIT / 2**30:.0f} GiB of weights)")
    passed = True
    report: dict = {"normexport_version": __version__, "command": "convert"}
    if not args.no_check and model is None:
        print(f"parity: not run here ({nbytes / 2**30:.2f} GiB of weights; convert checks whole models up to "
              f"{PARITY_LIMIT / 2**30:.0f} GiB); for the whole model run "
              f"`normexport check {out.name} --reference {args.model}`")
        report["parity"] = f"not run: {nbytes / 2**30:.2f} GiB of weights"
    elif not args.no_check and task == llm.WITH_PAST:  # DESIGN §10: verified by greedy generation
        from .parity.generate import check_generation

        def generation(m):
            return check_generation(m, module, command="convert", plain_export=lambda: convert_module(
                module, inputs, target="onnx", opset=opset, input_names=names, output_names=output_names,
                dynamic_axes=dynamic, fold_bn=False, swap_norms=False, rewrite=False))

        result = generation(model)
        if fused is not None and fused.model is not None:  # the generation check is the fusion's verification
            if not result.passed:  # never silent: the failed check is shown, the decomposed file checked and kept
                print(result.table())
                fused.model, fused.reason = None, "the fused file FAILED the generation check (table above)"
                model_ir, model = decomposed
                result = generation(model)
            print(attention.line(fused, "generation check PASSED on the fused file" if fused.model else None))
        print(result.table())
        report = result.to_dict()
        passed = result.passed
    elif not args.no_check and hit is not None:  # checked on the exporter ladder
        result = hit[2]
        print(result.table())
        report = result.to_dict()
        passed = result.passed
    elif not args.no_check:
        result = check(model, module, inputs, dynamic_axes=dynamic, command="convert",
                       plain_export=lambda: convert_module(  # DESIGN §7: the plain export, built on demand
                           module, inputs, target="onnx", opset=opset, input_names=names,
                           output_names=loaded.output_names, dynamic_axes=dynamic,
                           fold_bn=False, swap_norms=False, rewrite=False))
        print(result.table())
        report = result.to_dict()
        passed = result.passed
    report.update({"model": args.model, "target": args.target, "output": str(out), "op_counts": counts,
                   "residual_fusion": switches.residual_fusion(off), "fusion_off": off,
                   **sections})
    if fused is not None:
        report.update({"attention": fused.to_dict(), "op_counts": op_counts(model)})
    if "inputs" not in report:
        report["inputs"] = [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                            for n, t in zip(names, inputs)]
    if not passed:
        if args.report:
            io.write_json(report, args.report, "--report")
        print(f"parity FAILED or not checkable here: {out} not written (--no-check writes it without the check)")
        return 1
    io.save_ir(model_ir, out, validate=None if model is not None else io.check_onnx_path)
    if args.report:
        try:
            io.write_json(report, args.report, "--report")
        except BaseException:  # no output file left behind when the command fails
            for p in (out, out.with_name(out.name + ".data")):
                p.unlink(missing_ok=True)
            raise
    print(f"wrote {out}")
    if task == llm.WITH_PAST:  # DESIGN §10: genai_config.json, the tokenizer and config files beside the file
        for line in deploy.write(out, model_ir, module, args.model, loaded.kind.removesuffix("-with-past")):
            print(line)
    return 0


def _rung_text(ex: dict) -> str:
    """The exporter ladder's rung that wrote the file (DESIGN §9), for the first output line."""
    rung = ex.get("rung", "dynamic")
    axes = ", ".join(f"{n}:{','.join(map(str, a))}" for n, a in (ex.get("static_axes") or {}).items())
    return {"dynamic": "dynamo exporter", "static axes": f"dynamo exporter, static axes {axes}",
            "static": "dynamo exporter, static shapes", "torchscript": "torchscript exporter",
            "torchscript static": "torchscript exporter, static shapes"}.get(rung, f"{ex.get('name')} exporter")


def _exporter_lines(ex: dict, names, inputs) -> list[str]:
    """Why the file came from a lower rung of the exporter ladder, and what it fixes (DESIGN §9)."""
    lines = []
    tried = ex.get("attempts") or []
    why = "; ".join(f"{a['rung']}: " + (a.get("error") or ("parity failed" if a.get("parity") else a.get("skipped", "")))
                    for a in tried)
    if ex.get("parity_failed"):
        lines.append(f"  no rung of the exporter ladder passed parity ({why}): the first file is shown")
    static = ex.get("static_axes") or {}
    if static:
        axes = ", ".join(f"{n}:{','.join(map(str, a))}" for n, a in static.items())
        shapes = ", ".join(f"{n}: {'x'.join(map(str, t.shape))}" for n, t in zip(names, inputs) if n in static)
        lines.append(f"  STATIC SHAPES: no exporter kept the dynamic axes {axes} ({why}): the file is fixed to "
                     f"{shapes}; export one file per size with --input")
    if ex.get("name") == "torchscript":
        lines.append(f"  the dynamo exporter failed ({ex.get('dynamo_error')}): used the TorchScript-based exporter "
                     f"(opset {ex.get('opset')}); the rewriter fused its norms")
    return lines


def _has_bf16(module, inputs) -> bool:
    """The model runs in bfloat16 (a folder stored so, a bf16 factory): its inputs or weights."""
    if any(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in inputs):
        return True
    try:
        return any(p.dtype == torch.bfloat16 for p in module.parameters())
    except Exception:  # noqa: BLE001 - a module without parameters()
        return False


def _rewrite_lines(rw: dict | None) -> list[str]:
    """What the rewriter did to the export, on the terminal: fusions and their local verification,
    and every fusion it could not verify (never silent; DESIGN §8)."""
    if not rw:
        return []
    applied = sum(r["applied"] for r in rw["rules"])
    local = rw.get("verification", {}).get("local", {})
    lines = []
    if local.get("checked"):
        lines.append(f"  rewriter: {applied} fusion(s), {local['passed']} of {local['checked']} verified locally against "
                     f"float64 ({local['distinct']} distinct subgraph(s) run"
                     + ("; bfloat16 widened to float32 for onnxruntime" if local.get("widened_bf16") else "") + ")")
    bad = [(x["node"], x["reason"]) for r in rw["rules"] for x in r["rejected"] if x["reason"].startswith("local verification")]
    if bad:
        lines.append(f"  NOT APPLIED: {len(bad)} fusion(s) failed local verification (first: {bad[0][0]}: "
                     f"{bad[0][1].removeprefix('local verification: ')})")
    off: dict[str, list[str]] = {}  # rule modules turned off (--no-residual-fusion, --no-fuse), by reason
    for name, status in rw.get("modules", {}).items():
        if status.startswith("off ("):
            off.setdefault(status.removeprefix("off "), []).append(name)
    lines.extend(f"  note: rewriter rules {', '.join(names)} off {why}" for why, names in off.items())
    return lines


#: convert's whole-model parity check (eager, the file in onnxruntime, the float64 reference and
#: perhaps the plain export, all resident) runs for models with at most this many bytes of weights
PARITY_LIMIT = 2 << 30


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


def _fused_summary(counts: dict[str, int]) -> str:
    """The first line's counts: the norm ops (RMSNorm and AdaLNZero always, the fused residual forms
    SkipRMSNorm / GatedAdaLNZero and the standard ones where there are any) and all nodes."""
    keys = ("normexport::RMSNorm", "normexport::SkipRMSNorm", "normexport::AdaLNZero", "normexport::GatedAdaLNZero",
            "LayerNormalization", "RMSNormalization", "BatchNormalization")
    always = ("normexport::RMSNorm", "normexport::AdaLNZero")
    return ", ".join(f"{counts.get(k, 0)} {k}" for k in keys if counts.get(k) or k in always) + f", {sum(counts.values())} nodes"
