"""The import graph has no arrow up (issue 39): normexport's packages and top modules in layers,
bottom first; every import (lazy ones inside functions too, read with ast by
test_import_cycles.import_graph) goes from a module to one in a lower layer, never to its own layer
or above. A new module takes its place here (docs/design.md §1, "Layers")."""

from __future__ import annotations

import textwrap

from test_import_cycles import ROOT, _package, import_graph

LAYERS = [
    {"errors", "dtypes", "ops", "ir_utils", "export_fixes"},  # leaves: specs, dtypes, graph helpers
    {"capture", "jsonfile", "ortrun", "prepare", "validate"},  # onnxruntime sessions, torch-side preparation, file checks
    {"io"},  # reading / writing ONNX and JSON
    {"load"},  # models and example inputs from paths
    {"sizes"},  # sizes an ONNX model runs at
    {"rewriter", "trt"},  # ONNX rewrites; TensorRT builds
    {"exporter"},  # the exporter ladder (its judge rewrites)
    {"export"},  # the API's stage steps
    {"parity"},  # checks against eager / float64, runners
    {"llm", "demo", "testing"},  # features over parity
    {"quantize", "companions"},  # quantized output of convert (int4 MatMulNBits, int8 / fp8 Q/DQ) and its verdict;
    # the files a model folder's ONNX file needs beside it (config, tokenizer, processor)
    {"convert"},  # the convert stages
    {"pipeline"},  # diffusers pipeline folders (convert per component)
    {"cli"},
    {"__main__"},
]


def _layer_of(name: str, layers) -> int | None:
    parts = name.split(".")
    top = parts[1] if len(parts) > 1 else "normexport"
    return next((i for i, layer in enumerate(layers) if top in layer), None)


def arrows_up(root, layers, package="normexport") -> list[str]:
    bad = []
    for module, deps in sorted(import_graph(root).items()):
        a = _layer_of(module, layers)
        for dep in sorted(deps):
            b = _layer_of(dep, layers)
            if module.split(".")[:2] == dep.split(".")[:2] or dep == package:
                continue  # inside one package, or its __init__
            if a is None or b is None:
                bad.append(f"{module} -> {dep}: not in LAYERS")
            elif b >= a:
                bad.append(f"{module} (layer {a}) -> {dep} (layer {b})")
    return bad


def test_no_arrow_up():
    bad = arrows_up(ROOT, LAYERS)
    assert not bad, "imports up or sideways across layers:\n" + "\n".join(bad)


def test_a_planted_lazy_arrow_up_is_found(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "errors.py": "",
        "io.py": "from . import errors\n",
        "rewriter/__init__.py": textwrap.dedent("""
            def f():
                from ..convert import stages  # a stage reached from below
            """),
        "convert/__init__.py": "",
        "convert/stages.py": "from .. import io\n",
    })
    layers = [{"errors"}, {"io"}, {"rewriter"}, {"convert"}]
    bad = arrows_up(root, layers, package="pkg")
    assert bad == ["pkg.rewriter (layer 2) -> pkg.convert (layer 3)", "pkg.rewriter (layer 2) -> pkg.convert.stages (layer 3)"], bad
