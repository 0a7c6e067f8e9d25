#!/usr/bin/env python
"""TensorRT engines of the bundled reference models: normexport nodes -> plugin layers, layers,
engine size and build time, with the function bodies and with libnormexport_plugins.so.

    python tools/trt_build_table.py [--plugin build/plugins/libnormexport_plugins.so] [--dtypes fp32,fp16,bf16]

Each model (normexport.models.<name>.tiny()) is converted with target trt in each dtype (bf16 with
opset 22, unchecked: onnxruntime has no bf16 CPU kernels for some ops) and built by
normexport.trt.build (the same child process as `normexport build`) with profiles derived from the
file's dynamic dims. Build times are TensorRT's builder call only (not parsing, not process start).
Prints a markdown table; with TensorRT for RTX this runs on a CPU-only machine.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from pathlib import Path

import onnx
import torch

MODELS = ["bert", "conv_bn", "dit", "llama", "norm_heavy"]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def convert(name: str, dtype: torch.dtype) -> onnx.ModelProto:
    import normexport

    block = importlib.import_module(f"normexport.models.{name}").tiny().to(dtype).eval()
    args = tuple(t.to(dtype) if t.is_floating_point() else t for t in block.example_inputs())
    return normexport.convert_module(block, args, target="trt", input_names=block.input_names,
                                     dynamic_axes=block.dynamic_axes, opset=22 if dtype == torch.bfloat16 else None,
                                     verify=dtype != torch.bfloat16)


def main(argv=None) -> int:
    from normexport import trt
    from normexport.trt import cli as build_cli

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plugin", help="libnormexport_plugins.so (default: as `normexport build` finds it)")
    ap.add_argument("--dtypes", default="fp32,fp16,bf16")
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args(argv)
    plugin = args.plugin or (str(build_cli.find_plugin()) if build_cli.find_plugin() else None)
    ok, what = trt.can_build()
    if not ok:
        print(what, file=sys.stderr)
        return 2
    print(f"{what}; plugin: {plugin or 'none'}; {os.cpu_count()} CPUs\n")
    print("| model | dtype | normexport nodes | bodies: layers / engine KiB / build s | plugin: plugin layers / layers / engine KiB / build s |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            for key in args.dtypes.split(","):
                model = convert(name, DTYPES[key])
                path = Path(tmp) / f"{name}_{key}.onnx"
                onnx.save(model, str(path))
                profiles, _ = trt.profiles.profiles_for(model, {})
                nodes = sum(n.domain == "normexport" for n in model.graph.node)
                cells = []
                for lib in (None, plugin) if plugin else (None,):
                    try:
                        r = trt.build(trt.BuildSpec(str(path), str(path.with_suffix(".engine")), plugin=lib, profiles=profiles))
                    except trt.BuildError as e:
                        cells.append(f"FAILED: {str(e)[:80]}")
                        continue
                    size = f"{r.engine_bytes / 1024:.0f}"
                    if lib is None:
                        cells.append(f"{r.layers} / {size} / {r.build_seconds:.2f}")
                    else:
                        cells.append(f"{len(r.plugin_layers)} / {r.layers} / {size} / {r.build_seconds:.2f}")
                cells += ["(no plugin)"] * (2 - len(cells))
                print(f"| {name} | {key} | {nodes} | {cells[0]} | {cells[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
