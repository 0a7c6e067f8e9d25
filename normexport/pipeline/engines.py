"""`normexport build OUT/`: one TensorRT engine per component of an exported pipeline folder
(OUT/<slot>/model.engine beside model.onnx), through the same builder as `normexport build
MODEL.onnx`, with optimisation profiles from the shapes the pipeline run recorded (manifest):
opt the recorded size, min / max half / twice it along each dynamic axis (the batch from 1).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UsageError
from . import manifest as manifest_mod


def profile(entry: dict) -> list[str]:
    """--shapes NAME:MIN/OPT/MAX for each input of a slot with dynamic axes."""
    out = []
    for name, i in entry["inputs"].items():
        axes, shape = i.get("dynamic") or [], i["shape"]
        if not axes or not shape:
            continue
        lo = [1 if a == 0 else max(1, d // 2) if a in axes else d for a, d in enumerate(shape)]
        hi = [2 * d if a in axes else d for a, d in enumerate(shape)]
        out.append(f"{name}:{'x'.join(map(str, lo))}/{'x'.join(map(str, shape))}/{'x'.join(map(str, hi))}")
    return out


def run(args) -> int:
    from ..trt import cli as build_cmd

    folder = Path(args.model)
    manifest = manifest_mod.read(folder)
    if args.output:
        raise UsageError(f"-o {args.output}: an exported pipeline folder's engines are written beside its files "
                         f"({folder}/<component>/model.engine): leave -o out")
    if args.shapes:
        raise UsageError("--shapes: the profiles of a pipeline folder's engines come from its recorded shapes; build "
                         "one component's file with `normexport build OUT/<component>/model.onnx --shapes ...`")
    failed = []
    for slot, entry in manifest["slots"].items():
        print(f"[{slot}]")
        for file in manifest_mod.files(entry):  # a method cut at its children: each step's file (stepping.py)
            ns = argparse.Namespace(**vars(args))
            ns.model, ns.output = str(folder / file["file"]), str((folder / file["file"]).with_suffix(".engine"))
            ns.shapes, ns.report = profile(file), None
            if build_cmd.run(ns):
                failed.append(slot)
                break
    if failed:
        print(f"build FAILED for {', '.join(failed)}")
        return 1
    print(f"built {sum(len(manifest_mod.files(e)) for e in manifest['slots'].values())} engines in {folder}")
    return 0
