"""The TensorRT plugins' names, version, namespace and field names/defaults, generated from the
op specs (DESIGN §2, §6), so that one spec per op drives the torch op, the ONNX schema and
function, and the plugin.

    python -m normexport.ops.plugin_fields          # rewrite plugins/tensorrt/opSpecs.h
    python -m normexport.ops.plugin_fields --check  # exit 1 when the committed header is stale

tests/test_plugins_build.py fails when the committed header differs from render().
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import SPECS
from ._spec import DOMAIN, VERSION, OpSpec

HEADER = Path(__file__).resolve().parents[2] / "plugins" / "tensorrt" / "opSpecs.h"


def _cpp_name(spec: OpSpec) -> str:
    return spec.torch_op.split("::", 1)[1]  # normexport::rms_norm -> rms_norm


def _literal(value: float | int) -> tuple[str, str]:
    if isinstance(value, float):
        return "float", f"{value!r}F"
    return "int32_t", str(int(value))


def render() -> str:
    lines = [
        "// Generated from the op specs in normexport/ops/ by `python -m normexport.ops.plugin_fields`.",
        "// Do not edit: tests/test_plugins_build.py fails when this file and the specs disagree.",
        "#pragma once",
        "",
        "#include <cstdint>",
        "",
        "namespace normexport",
        "{",
        "namespace plugin",
        "{",
        "namespace spec",
        "{",
        "",
        f'constexpr char const* kNAMESPACE{{"{DOMAIN}"}};',
        f'constexpr char const* kVERSION{{"{VERSION}"}};',
    ]
    for spec in sorted(SPECS.values(), key=lambda s: s.name):
        n_required = sum(not i.optional for i in spec.inputs)
        lines += [
            "",
            f"//! {spec.doc}",
            f"namespace {_cpp_name(spec)}",
            "{",
            f'constexpr char const* kNAME{{"{spec.name}"}};',
            f"constexpr int32_t kMIN_INPUTS{{{n_required}}};",
            f"constexpr int32_t kMAX_INPUTS{{{len(spec.inputs)}}};",
        ]
        for a in spec.attributes:
            ctype, lit = _literal(a.default)
            key = a.name.upper()
            lines += [
                f"//! {a.doc}",
                f'constexpr char const* k{key}{{"{a.name}"}};',
                f"constexpr {ctype} k{key}_DEFAULT{{{lit}}};",
            ]
        lines.append(f"}} // namespace {_cpp_name(spec)}")
    lines += ["", "} // namespace spec", "} // namespace plugin", "} // namespace normexport", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m normexport.ops.plugin_fields", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the header differs from the specs")
    args = ap.parse_args(argv)
    text = render()
    current = HEADER.read_text() if HEADER.exists() else None
    if args.check:
        if current != text:
            print(f"{HEADER} is stale: run python -m normexport.ops.plugin_fields", file=sys.stderr)
            return 1
        return 0
    if current != text:
        tmp = HEADER.with_suffix(".h.tmp")
        tmp.write_text(text)
        tmp.replace(HEADER)
        print(f"wrote {HEADER}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
