"""`normexport build MODEL.onnx [-o OUT.engine] [--plugin LIB.so | --no-plugin] [--shapes NAME:MIN/OPT/MAX]...
[--timing-cache FILE] [--report FILE.json]` (docs/design.md §4)."""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

from .. import io
from ..errors import UsageError
from . import builder, profiles, runtime

PLUGIN_NAME = "libnormexport_plugins.so"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.onnx", help="ONNX file (normexport's or any other)")
    p.add_argument("-o", "--output", metavar="OUT.engine", help="default: MODEL's stem + .engine beside it")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--plugin", metavar="LIB.so", help=f"normexport's TensorRT plugin library ({PLUGIN_NAME}); "
                   "default: $NORMEXPORT_PLUGIN_LIB or build/plugins/ of this checkout, when found")
    g.add_argument("--no-plugin", action="store_true", help="run the normexport ops as their ONNX function bodies")
    p.add_argument("--shapes", action="append", default=[], metavar="NAME:MIN/OPT/MAX",
                   help="optimisation profile of a dynamic input, e.g. x:1x1x64/2x16x64/8x128x64")
    p.add_argument("--timing-cache", metavar="FILE", help="read and update TensorRT's timing cache")
    p.add_argument("--report", metavar="FILE.json", help="write the build summary as JSON")


def find_plugin() -> Path | None:
    """$NORMEXPORT_PLUGIN_LIB, else build/plugins/libnormexport_plugins.so of this checkout (`make plugins`)."""
    env = os.environ.get("NORMEXPORT_PLUGIN_LIB")
    if env:
        return Path(env)
    local = Path(__file__).resolve().parents[2] / "build" / "plugins" / PLUGIN_NAME
    return local if local.is_file() else None


def check_plugin(path: Path) -> Path:
    """UsageError unless `path` is a shared library that exports TensorRT's getCreators."""
    if not path.is_file():
        raise UsageError(f"plugin library not found: '{path}': build it with `make plugins` or fix --plugin")
    try:
        lib = ctypes.CDLL(str(path.resolve()), mode=os.RTLD_LOCAL | os.RTLD_LAZY)
    except OSError as e:
        raise UsageError(f"plugin library '{path}' fails to load ({str(e).strip()[:200]}): rebuild it with `make plugins`") from None
    if not hasattr(lib, "getCreators"):
        raise UsageError(f"'{path}' is not a TensorRT plugin library (no getCreators): pass {PLUGIN_NAME}")
    return path.resolve()


def run(args) -> int:
    model_path = Path(args.model)
    model = io.load_onnx(model_path)
    out = io.check_writable(args.output or model_path.with_suffix(".engine"))
    if args.report:
        io.check_writable(args.report, "--report")
    given = profiles.parse_shapes(args.shapes)
    shapes, how = profiles.profiles_for(model, given)
    plugin = None
    if not args.no_plugin:
        plugin = args.plugin and Path(args.plugin) or find_plugin()
        plugin = check_plugin(plugin) if plugin else None
    try:
        t = runtime.load()
    except runtime.TensorRTUnavailable as e:
        raise UsageError(str(e)) from None

    print(f"building {model_path.name} with {t}; plugin: {plugin or 'none (function bodies)'}")
    for name, (lo, opt, hi) in shapes.items():
        print(f"  profile {name}: min {_dims(lo)}, opt {_dims(opt)}, max {_dims(hi)}")
    if shapes:
        print(f"  ({'--shapes' if set(shapes) <= set(given) else how})")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    spec = builder.BuildSpec(str(model_path), str(tmp), plugin=str(plugin) if plugin else None,
                             profiles=shapes, timing_cache=args.timing_cache, progress=True)
    start = time.monotonic()
    try:
        result = builder.build(spec)
        os.replace(tmp, out)
    except builder.BuildError as e:
        print(f"normexport: build failed: {' '.join(str(e).split())}", file=sys.stderr)  # one line
        return 1
    finally:
        tmp.unlink(missing_ok=True)  # gone after the rename; a failed build leaves nothing
    result.engine_path = str(out)
    seconds = time.monotonic() - start
    print(f"{result.tensorrt}: {result.layers} layers; normexport nodes: {result.normexport_nodes} "
          f"({len(result.plugin_layers)} plugin layers, {result.bodies} as function bodies); "
          f"engine {result.engine_bytes / 2**20:.2f} MiB; build {result.build_seconds:.1f} s (total {seconds:.1f} s)")
    if args.report:
        from .. import __version__

        report = {"normexport_version": __version__, "command": "build", "model": str(model_path),
                  "plugin": str(plugin) if plugin else None, "profiles_from": how, **result.to_dict(),
                  "inputs": [{"name": n, "min": list(s[0]), "opt": list(s[1]), "max": list(s[2])} for n, s in shapes.items()]}
        try:
            io.write_json(report, args.report, "--report")
        except BaseException:
            out.unlink(missing_ok=True)
            raise
    print(f"wrote {out}")
    return 0


def _dims(d) -> str:
    return "x".join(str(v) for v in d)
