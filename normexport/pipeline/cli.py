"""The commands' entry points for an exported pipeline folder: `convert PIPELINE_DIR -o OUT/`,
`check OUT --reference PIPELINE_DIR [--steps N]`, `build OUT/`; any other MODEL goes to the
single-model command as before."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UsageError
from .manifest import NAME, is_exported_pipeline


#: check --steps when not given
STEPS = 4


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=STEPS, metavar="N", help="an exported pipeline folder: denoising steps "
                   f"of the end-to-end comparison (default {STEPS})")


def convert(args) -> int:
    from . import exporting
    from .. import convert as convert_cmd

    return exporting.run(args) if exporting.wants_folder(args) else convert_cmd.run(args)


def check(args, single) -> int:
    """`check OUT --reference DIR` for an exported pipeline folder; any other file goes to `single`
    (the command line passes llm.checking.run: parity's check, a KV-cache file by generation)."""
    if is_exported_pipeline(args.onnx_model):
        from . import compare

        return compare.run(args)
    reference = getattr(args, "reference", None)
    as_pipeline = getattr(args, "steps", STEPS) != STEPS or (reference and (Path(reference) / "model_index.json").is_file())
    if as_pipeline and not Path(args.onnx_model).is_file():  # what it is, never "a single file" when it is none
        what = "does not exist" if not Path(args.onnx_model).exists() else \
            f"is a folder without {NAME}, not an exported pipeline folder"
        raise UsageError(f"'{args.onnx_model}' {what}: `normexport convert PIPELINE_DIR -o {args.onnx_model}/` writes "
                         "it, only when every component passed (see that command's output)")
    if getattr(args, "steps", STEPS) != STEPS:
        raise UsageError(f"--steps {args.steps}: denoising steps are an exported pipeline folder's check; "
                         f"'{args.onnx_model}' is a single file: leave --steps out")
    return single(args)


def build(args) -> int:
    from ..trt import cli as build_cmd

    if is_exported_pipeline(args.model):
        from . import engines

        return engines.run(args)
    return build_cmd.run(args)
