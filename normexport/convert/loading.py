"""Stage 1, load: where the file goes and which fusions are off (both refused before loading when
wrong), the model loaded (normexport.load), and for a causal LM the graph it exports (--task)."""

from __future__ import annotations

from .. import io, llm, load
from ..rewriter import switches
from .record import Record


def default_output(model: str, module: str | None = None):
    from pathlib import Path

    if load.is_factory(model):
        mod, _, attr = model.partition(":")
        path = Path.cwd() / f"{mod.rsplit('.', 1)[-1]}_{attr}.onnx"
    else:
        path = Path(model).with_suffix(".onnx")
    return path.with_name(f"{path.stem}.{module}.onnx") if module else path


def run(rec: Record) -> Record:
    from ..llm import deploy

    args = rec.args
    # `-o DIR/`: the output is a folder, the file DIR/model.onnx (docs/design.md §10's deployable folder)
    rec.out = io.check_writable(deploy.output_path(args.output) or default_output(args.model, args.module))
    # the fusions turned off: the flags, and the deprecated NORMEXPORT_RESIDUAL_FUSION=0 (checked before loading)
    rec.off = switches.resolve(switches.from_flags(getattr(args, "no_residual_fusion", False),
                                                   getattr(args, "no_fuse", ())))
    if args.report:
        io.check_writable(args.report, "--report")
    # a folder's causal LM is exported with its KV cache by default, with inputs of its own: its plain
    # call is run in eager (load.probe) only where it is exported after all (llm.resolve says)
    cache_task = getattr(args, "task", None) != llm.PLAIN and not args.module
    loaded = rec.loaded if rec.loaded is not None else load.load(  # a model given in memory: as loaded
        args.model, trust_pickle=args.trust_pickle, weights=args.weights, imports=args.imports,
        probe_generating=not cache_task, user_inputs=bool(args.input or getattr(args, "inputs", None)))
    task, rec.loaded, rec.input_args, why = llm.resolve(loaded, getattr(args, "task", None), args.module, args.input)
    if rec.loaded.probe is not None:
        rec.loaded = rec.loaded.probe()
    rec.task = task
    if task is not None:  # docs/design.md §10: the first line says which graph a causal LM exports (and why, if not the cache)
        print(f"task {task}" + (f" (default here: {why})" if why else
                                " (default for causal-LM folders, factories and pickles; --task text-generation for "
                                "input_ids -> logits)" if getattr(args, "task", None) is None and task == llm.WITH_PAST
                                else ""))
    return rec
