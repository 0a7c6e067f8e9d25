"""The commands' entry points for an exported pipeline folder: `convert PIPELINE_DIR -o OUT/`,
`check OUT --reference PIPELINE_DIR [--steps N]`, `build OUT/`; any other MODEL goes to the
single-model command as before."""

from __future__ import annotations

import argparse

from .manifest import is_exported_pipeline


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=4, metavar="N", help="an exported pipeline folder: denoising steps of "
                   "the end-to-end comparison (default 4)")


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
    return single(args)


def build(args) -> int:
    from ..trt import cli as build_cmd

    if is_exported_pipeline(args.model):
        from . import engines

        return engines.run(args)
    return build_cmd.run(args)
