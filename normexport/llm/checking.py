"""`normexport check` of a file with a KV cache (docs/design.md §10): checked by greedy generation
(normexport.parity.generate) against the causal LM it was converted from. The check command
itself is normexport.parity's (`parity.cli.run`); this layer, above it, passes it the check by
generation (`run`), so that normexport.parity imports nothing of normexport.llm."""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError


def run(args) -> int:
    """The `check` command: normexport.parity's, a file with a KV cache checked by `run_generation`."""
    from ..parity import cli as check_cmd

    return check_cmd.run(args, with_past=run_generation)


def reference_lm(args):
    """The causal LM `--reference` names, as the file's cache semantics run it (CacheLM / ProgramLM),
    or a one-line refusal."""
    from ..load import load as load_reference
    from .cache import CacheLM, NoKVCache
    from .program import ProgramLM
    from .task import causal_lm

    loaded = load_reference(args.reference, trust_pickle=args.trust_pickle, weights=args.weights,
                            imports=getattr(args, "imports", ()))
    model = causal_lm(loaded)
    if model is not None:
        return CacheLM(model)
    if loaded.kind == "exported-program":  # a .pt2 that takes a KV cache (llm.program)
        try:
            return ProgramLM(loaded, label=f"the program of {Path(args.reference).name}")
        except NoKVCache as e:
            raise UsageError(f"'{args.onnx_model}' takes a KV cache but the program '{args.reference}' cannot be "
                             f"fed one: {e.reason}") from None
    raise UsageError(f"'{args.onnx_model}' takes a KV cache but '{args.reference}' is not a transformers "
                     "causal-LM folder, factory or pickle, nor a .pt2 taking a KV cache: pass the model it was "
                     "converted from")


def run_generation(args, source) -> int:
    """`check` of a file with a KV cache: greedy generation step by step (parity/generate.py). The
    reference is loaded inside the check and released before onnxruntime loads the file."""
    from ..load.inputs import parse_input
    from ..parity.generate import DEFAULT_BATCH, DEFAULT_PROMPT, check_generation

    if args.tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {args.tokens}")
    if args.backend not in ("ort", "ort-cuda"):
        raise UsageError(f"'{args.onnx_model}' takes a KV cache: its generation check runs in onnxruntime "
                         f"(--backend ort or ort-cuda), not {args.backend}")
    batch, length = DEFAULT_BATCH, DEFAULT_PROMPT
    for text in args.input:
        spec = parse_input(text)
        if spec.name != "input_ids" or len(spec.dims) != 2 or min(spec.dims) < 1:
            raise UsageError(f"--input {text}: a file with a KV cache takes --input input_ids:BxS (the prompt) only")
        batch, length = spec.dims
    if args.dtype:
        raise UsageError("--dtype: a file with a KV cache is checked in the dtype of its cache inputs; leave --dtype out")

    try:
        report = check_generation(source.proto if source.path is None else source.path, lambda: reference_lm(args),
                                  tokens=args.tokens,
                                  batch=batch, prompt_length=length, rtol=args.rtol, atol=args.atol,
                                  backend=args.backend, command="check", plain_export=True)
    finally:
        source.close()
    print(report.table())
    if args.json:
        report.write_json(args.json)
        print(f"wrote {args.json}")
    return 0 if report.passed else 1
