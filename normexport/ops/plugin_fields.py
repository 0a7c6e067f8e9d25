"""The TensorRT plugins' names, version, namespace, input / output counts, signature and field
names/defaults, generated from the op specs (docs/design.md §2, §6) as one struct per op, so that one spec
per op drives the torch op, the ONNX schema and function, and the plugin (plugins/tensorrt/
normPlugin.h takes the struct as its template argument).

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


def _signature(spec: OpSpec) -> str:
    """'(X, skip, scale[, bias]) -> (Y, Sum)': the inputs (optional ones in brackets) and outputs."""
    required = [i.name for i in spec.inputs if not i.optional]
    optional = [i.name for i in spec.inputs if i.optional]
    outputs = [name for name, _ in spec.outputs]
    ins = ", ".join(required) + (f"[, {', '.join(optional)}]" if optional else "")
    outs = outputs[0] if len(outputs) == 1 else f"({', '.join(outputs)})"
    return f"({ins}) -> {outs}"


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
    specs = sorted(SPECS.values(), key=lambda s: s.name)
    # kHAS_<FIELD> for every field any op has, so that shared plugin code can ask (if constexpr)
    every_field = sorted({a.name for spec in specs for a in spec.attributes})
    for spec in specs:
        n_required = sum(not i.optional for i in spec.inputs)
        lines += [
            "",
            f"//! {spec.doc}",
            f"struct {_cpp_name(spec)}",
            "{",
            f'    static constexpr char const* kNAME{{"{spec.name}"}};',
            f'    static constexpr char const* kSIGNATURE{{"{_signature(spec)}"}};',
            f"    static constexpr int32_t kMIN_INPUTS{{{n_required}}};",
            f"    static constexpr int32_t kMAX_INPUTS{{{len(spec.inputs)}}};",
            f"    static constexpr int32_t kNB_OUTPUTS{{{len(spec.outputs)}}};",
        ]
        mine = {a.name for a in spec.attributes}
        for a in spec.attributes:
            ctype, lit = _literal(a.default)
            key = a.name.upper()
            lines += [
                f"    //! {a.doc}",
                f'    static constexpr char const* k{key}{{"{a.name}"}};',
                f"    static constexpr {ctype} k{key}_DEFAULT{{{lit}}};",
            ]
        lines += [f"    static constexpr bool kHAS_{name.upper()}{{{'true' if name in mine else 'false'}}};"
                  for name in every_field]
        lines.append("};")
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
