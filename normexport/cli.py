"""`normexport` command line (docs/design.md §4). Bad input: one line on stderr, exit 2, no traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from .errors import ExportError, ParityError, UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's usage dump becomes our one-line error
        raise UsageError(f"{message}: see `{self.prog} --help`")


def build_parser() -> argparse.ArgumentParser:
    from . import parity as check_cmd
    from . import convert as convert_cmd
    from . import demo as demo_cmd
    from .rewriter import cli as rewrite_cmd
    from .trt import cli as build_cmd
    from .pipeline import cli as pipeline_cmd

    routed = {"convert": pipeline_cmd.convert, "check": _check, "build": pipeline_cmd.build}

    parser = _Parser(prog="normexport", description="Export PyTorch models to ONNX / TensorRT with "
                     "normalization layers done right.")
    parser.add_argument("--version", action="version", version=f"normexport {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, mod, help_text in (
        ("convert", convert_cmd, "export a PyTorch model to ONNX, with fused norm ops, and check parity"),
        ("rewrite", rewrite_cmd, "fuse decomposed norms and fold BatchNorm in any ONNX file"),
        ("check", check_cmd, "compare ONNX / TensorRT outputs with the eager model"),
        ("build", build_cmd, "build a TensorRT engine from an ONNX file (with normexport's plugin when found)"),
        ("demo", demo_cmd, "convert and check the bundled reference models"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        p.set_defaults(run=mod.run)
        if name in ("convert", "check"):  # a save_pretrained folder whose config.json and weights disagree
            from .load import checkpoint_keys

            p.add_argument(checkpoint_keys.FLAG, action="store_true",
                           help="load a transformers / diffusers folder (or pipeline component) whose config.json "
                                "and checkpoint disagree: parameters the checkpoint lacks or holds in another shape "
                                "get random values, checkpoint tensors the model does not use are dropped (said on "
                                "stderr); without it such a folder is refused in one line")
        if name in routed:  # a diffusers pipeline folder in or out (normexport.pipeline)
            p.set_defaults(run=routed[name])
            if name == "check":
                pipeline_cmd.add_check_arguments(p)
                from .quantize import add_check_arguments as add_quantized_check_arguments

                add_quantized_check_arguments(p)  # --no-anchor (docs/design.md §15)
    return parser


def _check(args) -> int:
    """`check`: an exported pipeline folder (normexport.pipeline), else one file: a quantized file by
    the quantized verdict (normexport.quantize.checking), else parity's check, a file with a KV cache
    checked by generation (normexport.llm.checking; llm is above parity)."""
    from .llm import checking
    from .pipeline import cli as pipeline_cmd
    from .quantize import checking as quantized

    return pipeline_cmd.check(args, lambda a: quantized.run(a, checking.run))


def _version() -> str:
    from . import __version__

    return __version__


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is (run() installs the handler): the same unwinding as Ctrl-C."""


def run() -> None:
    """The command's entry point (`normexport`, `python -m normexport`): main(), then the exit
    handlers (atexit, weakref finalizers) and one collection (generators' and temp folders'
    cleanups), then the process ends without the interpreter freeing every object one by one:
    that teardown took 1.9 s after a 1.1B-parameter convert (this takes 0.6 s, 2-vCPU VM)."""
    import atexit
    import gc
    import signal

    def terminated(signum, frame):  # SIGTERM (a scheduler's kill, `timeout`): unwind like Ctrl-C, so the
        raise Terminated()  # temp folders and half-written files are removed by their finally blocks

    signal.signal(signal.SIGTERM, terminated)
    # the young generation collected every 10,000 net allocations, not 700: an export allocates millions of
    # short-lived objects (fx nodes, fake tensors, onnx-ir values) that refcounting frees anyway, and
    # each young collection walked them; the middle and the full collections follow it (every 10 of the
    # one before), as by default. A 1.1B LLaMA's convert, in the command's own process: collections
    # 1.4-1.6 s -> 0.7 s of CPU, 2-vCPU VM. (Not set for normexport used as a library.)
    gc.set_threshold(10_000, 10, 10)
    code = main()
    try:
        atexit._run_exitfuncs()
        gc.collect()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001 - a closed pipe: the usual exit reports it
        sys.exit(code)
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    # torch's own warnings (tracing, exporter internals) are not the user's business here:
    # problems with the user's input surface as one-line errors, parity as the table.
    warnings.filterwarnings("ignore", module=r"torch(\.|$)")
    # torch.export.load's unpickling of pytree specs warns from copyreg (torch 2.13: "`isinstance(treespec,
    # LeafSpec)` is deprecated"): torch's business, attributed to the stdlib.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"copyreg$")
    # onnxscript's constant folding logs "Evaluation failed: ..." where onnx's reference evaluator cannot
    # fold a node (a shape it cannot reshape at fold time): the node stays and runs in the file, nothing fails
    logging.getLogger("onnxscript.optimizer._constant_folding").setLevel(logging.ERROR)
    debug = os.environ.get("NORMEXPORT_DEBUG", "").strip() not in ("", "0")
    try:
        args = build_parser().parse_args(argv)
        from .load import checkpoint_keys

        with checkpoint_keys.allowing(getattr(args, "allow_random_weights", False)):
            code = args.run(args)
    except UsageError as e:
        print(f"normexport: error: {e}", file=sys.stderr)
        return 2
    except ParityError as e:
        print(f"normexport: parity failed: {e}", file=sys.stderr)
        return 1
    except ExportError as e:
        print(f"normexport: export failed: {e}", file=sys.stderr)
        return 1
    except Terminated:
        print("normexport: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("normexport: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug in normexport (or torch/onnx) rather than in the user's input
        if debug:
            raise
        first = (str(e).strip().splitlines() or [""])[0][:200]
        print(f"normexport: internal error: {type(e).__name__}{': ' + first if first else ''} "
              "(run with NORMEXPORT_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
