"""Stage 7, write: the report (--report), the file written atomically (temp file, then rename;
external data past 2 GiB, checked by path) only when its check passed, and for a causal LM with
its cache the deployable folder's files beside it (genai_config.json, config and tokenizer files;
docs/design.md §10); with `-o DIR/`, any other transformers folder's config, tokenizer, processor and
sentence-transformers files (companions)."""

from __future__ import annotations

from .. import io, llm
from ..export import op_counts
from ..rewriter import switches
from .record import Record


def run(rec: Record) -> Record:
    from .. import __version__

    args, out = rec.args, rec.out
    report: dict = (rec.result.to_dict() if rec.result is not None
                    else {"normexport_version": __version__, "command": "convert"})
    if rec.parity_note:
        report["parity"] = rec.parity_note
    model = rec.model if rec.model is not None else rec.model_ir
    report.update({"model": args.model, "target": args.target, "output": str(out), "op_counts": op_counts(model),
                   "residual_fusion": switches.residual_fusion(rec.off), "fusion_off": rec.off, **rec.sections})
    if rec.rewrite is not None:
        report["rewrite"] = rec.rewrite
    if rec.fused is not None:
        report["attention"] = rec.fused.to_dict()
    if rec.packing is not None:
        report["packing"] = rec.packing.to_dict()
    if "inputs" not in report:
        report["inputs"] = [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                            for n, t in zip(rec.names, rec.inputs)]
    try:
        if not rec.passed:
            if args.report:
                io.write_json(report, args.report, "--report")
            print(f"parity FAILED or not checkable here: {out} not written (--no-check writes it without the check)")
            rec.exit_code = 1
            return rec
        if rec.bypath is not None:  # checked from files beside the output: the kept one takes its place by renames
            rec.bypath.place(validate=io.check_onnx_path)
        else:
            io.save_ir(rec.model_ir, out, validate=None if rec.model is not None else io.check_onnx_path)
    finally:
        if rec.bypath is not None:
            rec.bypath.close()
    if args.report:
        try:
            io.write_json(report, args.report, "--report")
        except BaseException:  # no output file left behind when the command fails
            for p in (out, out.with_name(out.name + ".data")):
                p.unlink(missing_ok=True)
            raise
    print(f"wrote {getattr(args, 'shown_output', None) or out}")  # a pipeline folder's: where it lands
    from ..llm import deploy

    if rec.task == llm.WITH_PAST:  # docs/design.md §10: genai_config.json, the tokenizer and config files beside the file
        for line in deploy.write(out, rec.model_ir, rec.module, args.model, rec.loaded.kind.removesuffix("-with-past")):
            print(line)
    elif deploy.names_folder(args.output) and rec.loaded.kind == "pretrained" and not args.module:
        from .. import companions  # config, tokenizer, processor and sentence-transformers files beside model.onnx

        for line in companions.write(out, args.model):
            print(line)
    return rec
