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
import sys
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
from ..parity.tolerances import eager_limit_for, tolerance_for
from ..parity.verdict import abs_diff
from . import buffers, stepping
from . import manifest as manifest_mod
from .recording import Slot


def export_slot(args, src: Path, slot: Slot, tmp: Path, component, plan: stepping.Plan, dtype: str | None,
                kwargs: dict) -> dict | None:
    """The slot's manifest entry with a file per kind of child call (None: a file failed, said above);
    `kwargs`: the recorded call by the method's own parameter names."""
    start = time.perf_counter()
    folder = tmp / slot.name
    children = dict(component.named_children())
    jobs, names = [], []
    for k, call in plan.kinds.items():
        name = f"{call.child}.{sum(1 for n in names if n.rsplit('.', 1)[0] == call.child)}"
        names.append(name)
        jobs.append(lambda k=k, call=call, name=name: _export_kind(args, src, slot, tmp, folder / name,
                                                                  children[call.child], call, plan, k))
    by_child: dict[str, list] = {}
    # the kinds are independent files: exported side by side in forked children where the machine has the cores
    for name, (text, entry) in zip(names, run_each(jobs, _workers(len(jobs)))):
        print(f"  {slot.name}: {name}: {entry['key'][:160] if entry else 'failed'}")
        sys.stdout.write(text)
        if entry is None:
            return None
        by_child.setdefault(name.rsplit(".", 1)[0], []).append(entry)
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
          f"eager {verdict['eager_err']:.3g}, limit {verdict['limit']:.3g}"
          + (f"; vs eager {verdict['vs_eager']:.3g}, tolerance {verdict['tolerance']:.3g}"
             if verdict.get("rule") == "tolerance vs eager" else "")
          + (f" ({verdict['note']})" if verdict.get("note") else "")
          + f": {'PASS' if verdict['passed'] else 'FAIL'} ({verdict.get('rule')}; {time.perf_counter() - start:.1f} s)")
    return entry if verdict["passed"] else None


def _workers(jobs: int) -> int:
    """Children at once: NORMEXPORT_JOBS where set (1: in this process), else one per core, at most `jobs`."""
    asked = os.environ.get("NORMEXPORT_JOBS", "")
    n = int(asked) if asked.isdigit() and int(asked) > 0 else len(os.sched_getaffinity(0))
    return max(1, min(n, jobs))


def run_each(jobs: list, workers: int) -> list[tuple[str, object]]:
    """(what it printed, what it returned) of each job (a callable without arguments), in job order:
    with one worker each runs here in turn (its lines printed as it goes, text ''); with more, each in a
    forked child, `workers` at a time, its stdout and stderr captured in a file and its result pickled
    back (a child that fails gives None and its error line in its text)."""
    import threading

    others = [t for t in threading.enumerate() if t is not threading.current_thread()
              and type(t).__name__ != "TMonitor"]  # tqdm's progress-bar monitor (a load's bars leave it) sleeps
    if workers <= 1 or others:
        # another thread (a test runner's, a writer's) may hold a lock the child would wait on forever: in turn
        return [("", job()) for job in jobs]
    import gc
    import pickle
    import tempfile

    sys.stdout.flush()
    sys.stderr.flush()
    # the parent's objects out of the children's collections (Python's advice for fork): a child's gc.collect()
    # would run their finalizers (an onnxruntime session's joins threads the child does not have: it hung)
    gc.freeze()
    try:
        out: list = [None] * len(jobs)
        running: dict[int, tuple[int, Path, Path]] = {}
        with tempfile.TemporaryDirectory(prefix="normexport-jobs-") as d:
            todo = list(range(len(jobs)))
            while todo or running:
                while todo and len(running) < workers:
                    i = todo.pop(0)
                    text, result = Path(d) / f"{i}.txt", Path(d) / f"{i}.pkl"
                    pid = os.fork()
                    if pid == 0:
                        _child(jobs[i], text, result)
                    running[pid] = (i, text, result)
                pid, _ = os.wait()
                if pid not in running:
                    continue
                i, text, result = running.pop(pid)
                value = pickle.loads(result.read_bytes()) if result.is_file() else None
                out[i] = (text.read_text(errors="replace") if text.is_file() else "", value)
    finally:
        gc.unfreeze()
    return out


def _child(job, text: Path, result: Path) -> None:
    """A forked child of run_each: its output to `text`, its result pickled to `result`; gone at once
    (os._exit: nothing of the parent's flushed or finalized twice)."""
    import pickle

    code = 1
    try:
        began = time.perf_counter()
        fd = os.open(text, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        torch.set_num_threads(1)
        value = job()
        print(f"  ({time.perf_counter() - began:.1f} s in a child process)")
        sys.stdout.flush()
        result.write_bytes(pickle.dumps(value))
        code = 0
    except BaseException as e:  # noqa: BLE001 - said in its text, the parent goes on
        try:
            print(f"  failed: {type(e).__name__}: {first_line(e, 300)}", flush=True)
        except BaseException:  # noqa: BLE001
            pass
    finally:
        os._exit(code)


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
            "parity": manifest_mod.parity_summary(report)}


def verify(component, tmp: Path, slot: Slot, entry: dict, kwargs: dict) -> dict:
    """The method composed of the files, run as load() runs it, against eager and float64 at the
    recorded call. Each file passed its own parity (docs/design.md §7, rules 1-2); what the composition
    adds is the loop at load (the kind picked, the lists written back), whose faults are of the
    signal's size: it passes by rule 1 (|files - float64| <= max(2 x |eager - float64|, floor)) or,
    where the runtime's kernels compound through the cache beyond that, by the dtype's tolerance
    against eager (|files - eager| <= rtol x max|ref| + atol), the rule named in the entry."""
    from .runtime import stepped_method

    runner = stepped_method(tmp, slot.name, entry, [type(component).__module__.split(".")[0], type(component).__name__])
    args = slot.args
    dtype = next((p.dtype for p in component.parameters() if p.is_floating_point()), torch.float32)
    with torch.no_grad():
        try:
            got = _leaves(runner(slot.component, slot.method, dict(stepping._bind_method(runner.meta, slot.method,
                                                                                         args, kwargs))))
        except RuntimeError as e:  # a kind of call no file takes (the loop at load went another way)
            return {"checked": True, "passed": False, "max_abs_err": float("nan"), "eager_err": float("nan"),
                    "limit": 0.0, "rule": "-", "note": first_line(e, 300),
                    "at": "the recorded call, the method composed of its files"}
        eager = _leaves(getattr(component, slot.method)(*args, **kwargs))
        with quiet():  # diffusers' note on casting with to()
            wide = component.to(torch.float64)  # and back: float32 / bfloat16 -> float64 -> the same values
        try:
            ref = _leaves(getattr(wide, slot.method)(*pytree.tree_map(_double, args), **pytree.tree_map(_double, kwargs)))
        finally:
            with quiet():
                component.to(dtype)
    rows = []
    for g, e, r in zip(got, eager, ref):
        g, e, r = (np.asarray(t.detach().double().numpy()) for t in (g, e, r))
        finite = np.isfinite(r)
        max_ref = float(np.abs(r[finite]).max()) if finite.any() else 0.0
        err, eager_err, vs_eager = (float(abs_diff(a, b).max()) for a, b in ((g, r), (e, r), (g, e)))
        limit, tol = eager_limit_for(dtype, max_ref, eager_err), tolerance_for(dtype, max_ref)
        rows.append({"max_abs_err": err, "eager_err": eager_err, "limit": limit, "vs_eager": vs_eager, "tolerance": tol,
                     "rule": "2x eager" if err <= limit else "tolerance vs eager",
                     "passed": err <= limit or vs_eager <= tol})
    worst = max(rows, key=lambda row: (not row["passed"], row["max_abs_err"] - row["limit"])) if rows else \
        {"max_abs_err": float("nan"), "eager_err": float("nan"), "limit": 0.0, "rule": "-", "passed": False}
    return {"checked": True, **worst, "passed": bool(rows) and len(got) == len(ref) == len(eager) and
            all(row["passed"] for row in rows), "at": "the recorded call, the method composed of its files"}


def _double(v):
    return v.to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def _leaves(out) -> list[torch.Tensor]:
    """The tensors of a method's output; an encode's distribution by its parameters (mean, logvar), as
    its file gives them (exporting.MethodCall)."""
    out = out.to_tuple() if hasattr(out, "to_tuple") else out
    leaves = []
    for leaf in pytree.tree_leaves(out):
        if isinstance(getattr(leaf, "parameters", None), torch.Tensor):
            leaf = leaf.parameters
        if isinstance(leaf, torch.Tensor):
            leaves.append(leaf)
    return leaves



def plain_twin(component, slot: str, entry: dict, args: tuple, kwargs: dict, out: Path) -> dict:
    """The plain-export twin of a cut method's slot for the pipeline check's rule 2 (pipeline/compare.py):
    the kinds of the check run's call, each exported by torch.onnx alone (no normexport stage), written
    under `out` / `slot` as convert lays them out; its entry."""
    from ..export import convert_module
    from ..io import save_onnx
    from ..load.call import CallAdapter, describe, output_names

    method = entry["method"]
    kwargs = {k: v for k, v in stepping._bind_method(component, method, args, kwargs).items()
              if not isinstance(v, torch.Generator) and k != "return_dict"}
    plan = stepping.plan(component, method, (), kwargs, [])
    if not isinstance(plan, stepping.Plan):
        raise RuntimeError(f"{slot}: the check run's {method} call is not a loop to cut ({plan})")
    children = dict(component.named_children())
    steps: dict[str, list] = {}
    for key, call in plan.kinds.items():
        tensors = {stepping.input_name(n): t for n, t in call.tensors().items()}
        module = stepping.StepCall(children[call.child], call)
        adapter = CallAdapter(module, (), tensors)
        with torch.no_grad():
            result = module(**tensors)
        names = output_names(result)
        dynamic = {stepping.input_name(n): a for n, a in plan.dynamic.get(call.child, {}).items()
                   if stepping.input_name(n) in tensors}
        with quiet():
            model = convert_module(adapter, adapter.example_inputs, target="onnx", input_names=adapter.input_names,
                                   output_names=names, dynamic_axes=dynamic or None, fold_bn=False, swap_norms=False,
                                   rewrite=False)
        kinds = steps.setdefault(call.child, [])
        file = f"{slot}/{call.child}.{len(kinds)}/model.onnx"
        (out / file).parent.mkdir(parents=True, exist_ok=True)
        save_onnx(model, out / file)
        kinds.append({"key": key, "file": file, "outputs": names, "structure": describe(result),
                      "inputs": {n: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                                     "dynamic": dynamic.get(n, [])} for n, t in tensors.items()},
                      "after": stepping.after_values(call)})
    return {**entry, "steps": steps, "dynamic": plan.dynamic}
