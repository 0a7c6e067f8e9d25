"""A component method cut at its children (pipeline/stepping.py) into files: each kind of each child's
call through the convert stages as any component (prepare, the exporter ladder, the rewrite, parity
against eager and float64), then the method composed of the files, run as load() runs it (the
library's method on the meta-device component), verified against eager and float64 at the recorded
call by the pipeline check's rule (2x eager's distance from float64)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.utils._pytree as pytree

from .. import convert as convert_stages
from ..capture import save
from ..errors import ExportError, UsageError, first_line
from ..load import pipeline as folder_pipeline
from ..load._util import quiet
from ..parity.tolerances import eager_limit_for, floor_for
from ..parity.verdict import abs_diff
from . import buffers, stepping
from .recording import Slot


def export_slot(args, src: Path, slot: Slot, tmp: Path, component, plan: stepping.Plan, dtype: str | None,
                kwargs: dict) -> dict | None:
    """The slot's manifest entry with a file per kind of child call (None: a file failed, said above);
    `kwargs`: the recorded call by the method's own parameter names."""
    start = time.perf_counter()
    folder = tmp / slot.name
    children = dict(component.named_children())
    by_child: dict[str, list] = {}
    for n, (k, call) in enumerate(plan.kinds.items()):
        kinds = by_child.setdefault(call.child, [])
        name = f"{call.child}.{len(kinds)}"
        print(f"  {slot.name}: {name}: {k[:160]}{'...' if len(k) > 160 else ''}")
        entry = _export_kind(args, src, slot, tmp, folder / name, children[call.child], call, plan, k)
        if entry is None:
            return None
        kinds.append(entry)
    shutil.copy2(src / slot.component / "config.json", folder / "config.json")
    buffers.write(component, folder)
    entry = {"component": slot.component, "method": slot.method, "dtype": dtype,
             "steps": by_child, "dynamic": plan.dynamic,
             "renames": dict(slot.renames), "arguments": list(slot.arguments)}
    verdict = verify(component, tmp, slot, entry, kwargs)
    entry["parity"] = verdict
    files = sum(len(v) for v in by_child.values())
    print(f"  {slot.name}: {slot.component}.{slot.method} composed of {files} files "
          f"({', '.join(f'{c}: {len(v)}' for c, v in by_child.items())}; the loop over {plan.loop_axis[0]} axis "
          f"{plan.loop_axis[1]} runs in python at load): vs float64 at the recorded call {verdict['max_abs_err']:.3g}, "
          f"eager {verdict['eager_err']:.3g}, limit {verdict['limit']:.3g}: "
          f"{'PASS' if verdict['passed'] else 'FAIL'} ({time.perf_counter() - start:.1f} s)")
    return entry if verdict["passed"] else None


def _export_kind(args, src: Path, slot: Slot, tmp: Path, out: Path, child, call: stepping.ChildCall,
                 plan: stepping.Plan, key: str) -> dict | None:
    out.mkdir(parents=True)
    calls = tmp / ".calls"
    calls.mkdir(exist_ok=True)
    file = calls / f"{slot.name}.{out.name}.pt"
    tensors = {stepping.input_name(n): t for n, t in call.tensors().items()}
    save((), tensors, file)
    module = stepping.StepCall(child, call)
    source = f"one kind of {slot.component}.{call.child}'s calls in {slot.component}.{slot.method}"
    loaded = folder_pipeline._component_model(module, file, source, "")
    dynamic = {stepping.input_name(n): axes for n, axes in plan.dynamic.get(call.child, {}).items()
               if stepping.input_name(n) in tensors}
    loaded.dynamic_axes = dynamic or None
    batch = {n: [0] for n, axes in dynamic.items() if 0 in axes}
    loaded.fewer_axes = [batch] if batch and batch != dynamic else []
    loaded.required_axes = {}
    ns = argparse.Namespace(**vars(args))
    ns.model, ns.output, ns.inputs, ns.module = str(src / slot.component), str(out) + os.sep, str(file), None
    ns.input, ns.dynamic, ns.task = [], [], None
    ns.report = str(out / "normexport_report.json")
    ns.shown_output = str(Path(args.output.rstrip("/" + os.sep)) / slot.name / out.name / "model.onnx")
    try:
        rec = convert_stages.convert(ns, loaded)
    except (UsageError, ExportError) as e:
        print(f"  {slot.name}: {out.name}: {first_line(e, 300)}")
        return None
    if rec.exit_code:
        return None
    missing = [n for n, axes in dynamic.items() if set(axes) - set((rec.kept or {}).get(n, []))]
    if missing:
        print(f"  {slot.name}: {out.name}: no exporter kept {', '.join(missing[:3])} dynamic as the other calls need: "
              "exported whole instead")
        return None
    report = json.loads((out / "normexport_report.json").read_text())
    return {"key": key, "file": f"{slot.name}/{out.name}/model.onnx",
            "inputs": {n: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                           "dynamic": list((rec.kept or {}).get(n, []))} for n, t in zip(rec.names, rec.inputs)},
            "outputs": list(rec.output_names or []), "structure": rec.output_structure,
            "after": stepping.after_values(call), "op_counts": report.get("op_counts", {}),
            "parity": _file_parity(report)}


def verify(component, tmp: Path, slot: Slot, entry: dict, kwargs: dict) -> dict:
    """The method composed of the files, run as load() runs it, against eager and float64 at the
    recorded call (rule 1 of the pipeline check: |files - float64| <= max(2 x |eager - float64|, floor))."""
    from .runtime import stepped_method

    runner = stepped_method(tmp, slot.name, entry, [type(component).__module__.split(".")[0], type(component).__name__])
    args = slot.args
    with torch.no_grad():
        got = _leaves(runner(slot.component, slot.method, dict(stepping._bind_method(runner.meta, slot.method, args,
                                                                                     kwargs))))
        eager = _leaves(getattr(component, slot.method)(*args, **kwargs))
        own = next((p.dtype for p in component.parameters() if p.is_floating_point()), torch.float32)
        with quiet():  # diffusers' note on casting with to()
            wide = component.to(torch.float64)  # and back: float32 / bfloat16 -> float64 -> the same values
        try:
            ref = _leaves(getattr(wide, slot.method)(*pytree.tree_map(_double, args), **pytree.tree_map(_double, kwargs)))
        finally:
            with quiet():
                component.to(own)
    worst = {"max_abs_err": 0.0, "eager_err": 0.0, "limit": 0.0, "passed": len(got) == len(ref) == len(eager)}
    for g, e, r in zip(got, eager, ref):
        g, e, r = (np.asarray(t.detach().double().numpy()) for t in (g, e, r))
        err, eager_err = float(abs_diff(g, r).max()), float(abs_diff(e, r).max())
        max_ref = float(np.abs(r[np.isfinite(r)]).max()) if np.isfinite(r).any() else 0.0
        limit = eager_limit_for(torch.float32, max_ref, eager_err)
        worst = {"max_abs_err": max(worst["max_abs_err"], err), "eager_err": max(worst["eager_err"], eager_err),
                 "limit": max(worst["limit"], limit), "floor": floor_for(torch.float32, max_ref),
                 "passed": worst["passed"] and err <= limit}
    return {"checked": True, **worst, "rule": "2x eager", "at": "the recorded call, the method composed of its files"}


def _double(v):
    return v.to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def _leaves(out) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out if not hasattr(out, "to_tuple") else out.to_tuple())
            if isinstance(t, torch.Tensor)]


def _file_parity(report: dict) -> dict:
    rows = [r for per in (report.get("results") or {}).get("ort", {}).values() for r in per]
    if not rows:
        return {"checked": False, "note": report.get("parity")}
    return {"checked": True, "passed": all(r.get("passed") for r in rows),
            "max_abs_err": max((r.get("max_abs_err") or 0.0) for r in rows), "rows": len(rows)}
