"""`normexport rewrite IN.onnx [-o OUT.onnx] [--target trt|ort|onnx] [--input NAME:DIMS[:DTYPE]]...
[--no-verify] [--report FILE.json] [--no-residual-fusion] [--no-fuse MODULE]...`

Registered by normexport/cli.py (`from normexport.rewriter import cli as rewrite_cli`). Bad input
raises normexport.errors.UsageError (the main CLI prints it on one line and exits 2).
"""

from __future__ import annotations

import argparse
import os

from normexport.errors import UsageError

from . import RULE_MODULES, TARGETS, rewrite_file, switches

HELP = "fuse decomposed LayerNorm / RMSNorm / AdaLN in an ONNX file (every rewrite verified)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", metavar="IN.onnx", help="ONNX model to rewrite (external data is loaded)")
    parser.add_argument("-o", "--output", metavar="OUT.onnx", default=None,
                        help="output path (default: IN's stem + .<target>.onnx beside IN)")
    parser.add_argument("--target", choices=TARGETS, default="trt",
                        help="trt: normexport custom ops; ort: fastest in onnxruntime; onnx: standard ops only")
    parser.add_argument("--input", dest="inputs", action="append", default=[], metavar="NAME:DIMS[:DTYPE]",
                        help="verify at these sizes, e.g. x:1x3x640x640 (default: sizes the model runs at, "
                             "found by trying its fixed dims, then common sizes)")
    parser.add_argument("--no-verify", action="store_true",
                        help="keep rewrites without checking them in onnxruntime on random inputs")
    parser.add_argument("--report", metavar="FILE.json", default=None, help="write the rewrite report as JSON")
    add_switches(parser)


def add_switches(parser: argparse.ArgumentParser) -> None:
    """The rule switches convert and rewrite share (switches.py; recorded in the report)."""
    parser.add_argument("--no-residual-fusion", action="store_true",
                        help="keep the residual Add apart from the norm after it (no SkipRMSNorm / GatedAdaLNZero "
                             "for --target trt; replaces NORMEXPORT_RESIDUAL_FUSION=0)")
    parser.add_argument("--no-fuse", action="append", default=[], metavar="MODULE",
                        help="turn a fusion off (repeatable, or a comma list): a rewriter rule module (" + ", ".join(RULE_MODULES)
                        + "), attention (convert --target ort of an LLM: GroupQueryAttention, exact for unpadded "
                        "batches only) or depth (convert of an LLM: trace the whole decoder, not 3 blocks grown)")


def default_output(in_path: str, target: str) -> str:
    folder, name = os.path.split(os.path.abspath(in_path))
    stem = name[:-5] if name.lower().endswith(".onnx") else name
    return os.path.join(folder, f"{stem}.{target}.onnx")


def run(args: argparse.Namespace) -> int:
    in_path = args.input
    out_path = args.output or default_output(in_path, args.target)
    if os.path.abspath(out_path) == os.path.abspath(in_path):
        raise UsageError(f"{out_path}: output would overwrite the input; pass a different -o")
    if os.path.isdir(out_path):
        raise UsageError(f"{out_path}: is a folder; pass a file path with -o")
    off = switches.from_flags(getattr(args, "no_residual_fusion", False), getattr(args, "no_fuse", ()), "rewrite")
    report = rewrite_file(in_path, out_path, target=args.target, verify=not args.no_verify,
                          report_path=args.report, inputs=getattr(args, "inputs", None) or None, off=off)
    print(report.summary())
    if report.nothing_verifiable:
        print(f"nothing applied: every fusion that matched failed local verification; {out_path} not written")
        return 1
    print(f"wrote {out_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (python -m normexport.rewriter.cli) for when the main CLI is absent."""
    parser = argparse.ArgumentParser(prog="normexport rewrite", description=HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UsageError as e:
        import sys

        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
