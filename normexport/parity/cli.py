"""The `normexport check` command: arguments and handler."""

from __future__ import annotations

import argparse
import math
import os

from ..errors import UsageError
from ._util import _dims, _graph_inputs
from .choose import choose
from .driver import check
from .runners import _ModelSource

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("onnx_model", metavar="MODEL.onnx", help="the ONNX file to check")
    p.add_argument("--reference", required=True, metavar="MODEL",
                   help="the eager model: x.pt2 | x.pt/x.pth | package.module:callable | a save_pretrained folder")
    p.add_argument("--input", action="append", default=[], metavar="NAME:DIMS[:DTYPE]",
                   help="e.g. x:2x16x64, by ONNX input name (the others get sizes the file runs at) or one per ONNX input "
                        "in order; default: the reference's example inputs, else sizes the ONNX file runs at")
    p.add_argument("--inputs", metavar="FILE", help="check at this call of the reference: a torch.save'd (args, kwargs), "
                   "e.g. recorded with normexport.capture (loaded with weights_only=True)")
    p.add_argument("--dynamic", action="append", default=[], metavar="NAME:AXES",
                   help="dynamic axes of input NAME, e.g. x:0,1; default: the symbolic dims of the ONNX inputs")
    p.add_argument("--backend", choices=("ort", "ort-cuda", "trt", "all"), default="ort")
    p.add_argument("--plugin", metavar="LIB.so", help="TensorRT plugin library (libnormexport_plugins.so)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="run the eager reference and the inputs in this dtype (the float64 reference stays float64); "
                        "default: the dtype of the ONNX model's first floating input")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (x max|ref|); default per dtype, docs/design.md §7")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance; default per dtype, docs/design.md §7")
    p.add_argument("--extra-shapes", type=int, default=2, metavar="N", help="extra shapes to check along dynamic axes (default 2)")
    p.add_argument("--json", metavar="FILE", help="write the JSON report")
    p.add_argument("--tokens", type=int, default=16, metavar="N",
                   help="a file with a KV cache (past_key_values.* inputs): greedy tokens to generate (default 16); "
                        "--input input_ids:BxS sets the prompt's batch and length (default 1x8)")
    p.add_argument("--weights", metavar="FILE", help="state dict for a module:callable reference (weights_only=True)")
    p.add_argument("--trust-pickle", action="store_true", help="allow unpickling a pickled nn.Module reference")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import an installed module before loading the reference (pytree types of a .pt2)")


def _onnx_dynamic(graph_inputs) -> dict[str, list[int]]:
    out = {}
    for vi in graph_inputs:
        axes = [a for a, d in enumerate(_dims(vi)) if isinstance(d, str) or d is None]
        if axes:
            out[vi.name] = axes
    return out


def run(args, *, with_past=None) -> int:
    """The `check` command on `args`. `with_past(args, source)`: the check of a file with a KV cache
    (a check by generation, normexport.llm.checking.run_generation: the llm layer sits above this
    one and passes it in; `normexport check` does, through normexport.llm.checking.run)."""
    from ..load import load as load_reference
    from ..load.inputs import parse_dynamic, parse_input

    for v, flag in ((args.rtol, "--rtol"), (args.atol, "--atol")):
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise UsageError(f"{flag} must be a non-negative number, got {v}")
    if args.extra_shapes < 0:
        raise UsageError(f"--extra-shapes must be >= 0, got {args.extra_shapes}")
    if args.json:
        from ..io import check_writable

        check_writable(args.json)
    if args.plugin and not os.path.isfile(args.plugin):
        raise UsageError(f"plugin library not found: '{args.plugin}': check the --plugin path")
    source = _ModelSource(args.onnx_model)  # UsageError for a missing / corrupt file, before loading torch models
    from .generate import is_with_past

    if is_with_past(source.proto):  # docs/design.md §10: checked by greedy generation
        if with_past is None:
            source.close()
            raise UsageError(f"'{args.onnx_model}' takes a KV cache: its check by generation is "
                             "normexport.llm.checking.run (what `normexport check` runs)")
        return with_past(args, source)
    graph_inputs = _graph_inputs(source.proto)
    onnx_names = [i.name for i in graph_inputs]
    dynamic_given = [parse_dynamic(d) for d in args.dynamic]
    for text in args.input:
        parse_input(text)  # malformed --input: one line before loading the reference
    loaded = load_reference(args.reference, trust_pickle=args.trust_pickle, weights=args.weights,
                            imports=getattr(args, "imports", ()))
    reference = loaded.module
    from ..load.pipeline import KIND as PIPELINE

    # docs/design.md §9: the recorded call (and --input over its parameters); a pipeline folder's denoiser is
    # called as one run of the pipeline calls it (normexport.load.pipeline)
    if getattr(args, "inputs", None) or loaded.kind == PIPELINE:
        from ..load import call_for
        from .choose import Chosen

        job = call_for(loaded, args.reference, list(args.input), [], None, None, inputs_file=args.inputs)
        reference = job.module
        how = f"--inputs {args.inputs}" if args.inputs else getattr(job.loaded, "source", "")
        chosen = Chosen(tuple(job.inputs), list(job.names), how)
    else:
        chosen = choose(source.proto, list(args.input), loaded.example_inputs, loaded.input_names, args.reference,
                        args.onnx_model)
    inputs, given_names = chosen.inputs, chosen.names
    if len(inputs) != len(onnx_names):
        raise UsageError(f"'{args.onnx_model}' has {len(onnx_names)} input(s) ({', '.join(onnx_names)}) but "
                         f"{len(inputs)} were given: give one --input per ONNX input, in order")

    def onnx_name(name: str) -> str:
        if name in onnx_names:
            return name
        if name in given_names:
            return onnx_names[given_names.index(name)]
        raise UsageError(f"--dynamic names unknown input '{name}': the ONNX inputs are {', '.join(onnx_names)}")

    if dynamic_given:
        dynamic: dict[str, list[int]] = {}
        for name, axes in dynamic_given:
            dynamic.setdefault(onnx_name(name), []).extend(axes)
    else:
        dynamic = _onnx_dynamic(graph_inputs)

    dtype = getattr(args, "dtype", None)
    if callable(getattr(reference, "modules", None)):  # docs/design.md §9: the implementations convert exported (MoE experts:
        from ..prepare.implementations import exportable_implementations, summary_lines  # grouped_mm has no fp64)

        switched: list = []
        exportable_implementations(reference, tuple(inputs), switched)
        for line in summary_lines(switched):
            print(line)
    report = check(source.path, reference, tuple(inputs), backends=(args.backend,), dynamic_axes=dynamic,
                   extra_shapes=args.extra_shapes, rtol=args.rtol, atol=args.atol, plugin=args.plugin, dtype=dtype,
                   command="check", plain_export=True)
    report.sizes = chosen.how
    if dtype:
        report.dtype_source = "--dtype"
    print(report.table())
    if args.json:
        report.write_json(args.json)
        print(f"wrote {args.json}")
    return 0 if report.passed else 1
