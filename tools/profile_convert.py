"""Where `normexport convert` spends its time (issue 31 item 3): the command run in-process with a
wall-clock timer around each phase's function (no cProfile: its overhead on torch.export and the
onnxscript matchers is several-fold), nested phases shown under their parent.

    python tools/profile_convert.py --json OUT.json -- convert FOLDER --target ort [...]

Each phase is "module:function"; its seconds are inclusive (a phase run inside another is counted in
both, listed indented under it); "other" is the command's wall time outside every top-level phase
(imports, the argument checks, the lines printed). phases_cpu_s: the CPU seconds (user + system) of
the process's threads spent while each phase ran (threads running beside a phase count in it too),
but for the forked weights writer's line: the child's own CPU seconds."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import threading
import time

#: the forked writer (Workdir.write_behind): its wall the wait for it (a thread), its CPU the child's own
CHILD_LABEL = "forked weights writer (wait; CPU: the child's)"
#: (label, module, attribute path) of the functions timed, roughly in the order they run
PHASES = [
    ("pipeline: recording (runs to the end)", "normexport.pipeline.exporting", "record"),
    ("pipeline: one component (_export_slot)", "normexport.pipeline.exporting", "_export_slot"),
    ("  pipeline: plan of a looped method (stepping.plan)", "normexport.pipeline.stepping", "plan"),
    ("  pipeline: one kind of a looped call (stepped_export._export_kind)", "normexport.pipeline.stepped_export", "_export_kind"),
    ("  pipeline: the composed method vs eager (stepped_export.verify)", "normexport.pipeline.stepped_export", "verify"),
    ("parity check (checking.judge)", "normexport.convert.checking", "judge"),
    ("load: folder, weights (from_pretrained)", "normexport.load", "load"),
    ("load: task / cache layout (llm.resolve)", "normexport.llm", "resolve"),
    ("load: inputs (call_for)", "normexport.load", "call_for"),
    ("load: the example call in eager (its outputs' names)", "normexport.convert.inputs", "run_eager"),
    ("prepare: exportable implementations (swaps + their checks)", "normexport.prepare.implementations", "exportable_implementations"),
    ("prepare: norm swaps (+ checks)", "normexport.prepare.swap", "prepare"),
    ("prepare: complex lowering", "normexport.prepare.complex", "lower_complex"),
    ("prepare: fold batchnorm", "normexport.prepare.fold_bn", "fold_batchnorm"),
    ("depth: shallow export, grow, optimize (Plan.export)", "normexport.exporter.depth", "Plan.export"),
    ("  depth: grow", "normexport.exporter.depth", "grow"),
    ("torch.onnx.export (whole)", "torch.onnx", "export"),
    ("torch.export (trace)", "torch.export", "export"),
    ("torch.export decompositions", "torch.onnx._internal.exporter._core", "_prepare_exported_program_for_export"),
    ("ONNX translation", "torch.onnx._internal.exporter._core", "_exported_program_to_onnx_program"),
    ("onnxscript optimize (in torch.onnx.export)", "torch.onnx._internal.exporter._onnx_program", "ONNXProgram.optimize"),
    ("export fixes", "normexport.export_fixes", "apply_all"),
    ("validate (checker + ort, small files)", "normexport.exporter.rungs", "_validate_ir"),
    ("rewrite + local verification", "normexport.rewriter.driver", "rewrite_ir"),
    ("rewrite: canonicalisation", "normexport.rewriter.canonical", "canonicalize"),
    ("rewrite: opset upgrade (bump, or onnx.version_converter)", "normexport.rewriter.driver", "upgrade_opset"),
    ("GroupQueryAttention fusion (+ mask, local, share-buffer checks)", "normexport.llm.attention", "fuse"),
    ("  fusion: onnxscript passes + GroupQueryAttention rule (_fused_copy)", "normexport.llm.attention", "_fused_copy"),
    ("  fusion: local check's eager steps ahead (while the file is written)", "normexport.llm.attention", "eager_ahead"),
    ("  fusion: local check (fused vs eager; decomposed where that fails)", "normexport.llm.attention", "compare"),
    ("    onnxruntime sessions (local + share-buffer checks)", "normexport.llm.verify", "session"),
    ("    onnxruntime runs (local check; share-buffer reference)", "normexport.llm.verify", "run_steps"),
    ("    eager steps (local check)", "normexport.llm.verify", "_eager_steps"),
    ("  fusion: share-buffer check", "normexport.llm.attention", "share_buffer_check"),
    ("  fusion: mask checks", "normexport.llm.gqa_rule", "check_mask"),
    ("files for the checks (workdir write)", "normexport.llm.files", "Workdir.write"),
    ("  waiting for the weights written ahead (Workdir._settle)", "normexport.llm.files", "Workdir._settle"),
    ("generation check", "normexport.parity.generate", "check_generation"),
    ("  generation: eager", "normexport.parity.generate", "_eager"),
    ("  generation: transformers generate", "normexport.parity.generate", "_library_generate"),
    ("  generation: float64 reference", "normexport.parity.generate", "_float64"),
    ("  generation: onnxruntime", "normexport.parity.generate", "_runtime"),
    ("serialise whole model (serde)", "onnx_ir.serde", "serialize_model"),
    ("write (io.save_ir)", "normexport.io", "save_ir"),
    (CHILD_LABEL, "normexport.llm.files", "_wait_child"),
    ("place checked file (Workdir.place)", "normexport.llm.files", "Workdir.place"),
    ("onnx checker by path", "normexport.io", "check_onnx_path"),
    ("deployable folder (deploy.write)", "normexport.llm.deploy", "write"),
    ("quantize int4 (the stage)", "normexport.quantize.int4", "run"),
    ("  int4: onnxruntime's MatMulNBitsQuantizer", "normexport.quantize.int4", "quantize"),
    ("  int4: load float file (onnx_ir, lazy)", "onnx_ir", "load"),
    ("  int4: weights check (every block vs float)", "normexport.quantize.weights", "check"),
    ("  int4: deserialize proto -> ir", "onnx_ir.serde", "deserialize_model"),
]

times: dict[str, float] = {}
cpu: dict[str, float] = {}  # CPU seconds of this process (all its threads; a forked child's: CHILD_LABEL)
calls: dict[str, int] = {}
_local = threading.local()  # each thread's own stack of phases (a writer thread's phase is never a parent)


def _stack() -> list[str]:
    st = getattr(_local, "stack", None)
    if st is None:
        st = _local.stack = []
    return st


top: dict[str, float] = {}


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def _wrap(label, fn):
    def timed(*a, **k):
        t = time.perf_counter()
        c, cc = _cpu(), _children_cpu()
        stack = _stack()
        stack.append(label)
        try:
            return fn(*a, **k)
        finally:
            stack.pop()
            dt = time.perf_counter() - t
            times[label] = times.get(label, 0.0) + dt
            cpu[label] = cpu.get(label, 0.0) + (_children_cpu() - cc if label == CHILD_LABEL else _cpu() - c)
            calls[label] = calls.get(label, 0) + 1
            if not stack and threading.current_thread() is threading.main_thread():
                top[label] = top.get(label, 0.0) + dt
    timed.__wrapped__ = fn
    return timed


def install() -> None:
    for label, modname, attr in PHASES:
        try:
            mod = importlib.import_module(modname)
        except Exception:  # noqa: BLE001 - a module this version lacks
            continue
        owner, name = mod, attr
        if "." in attr:
            cls, name = attr.split(".")
            owner = getattr(mod, cls, None)
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            continue
        w = _wrap(label, fn)
        setattr(owner, name, w)
        if owner is mod:  # `from module import fn` elsewhere: those names too
            for m in list(sys.modules.values()):
                d = getattr(m, "__dict__", None)
                if d is None:
                    continue
                for k, v in list(d.items()):
                    if v is fn:
                        d[k] = w


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write {phase: seconds} here")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    t0 = time.perf_counter()
    import normexport.cli  # noqa: F401 - the imports, timed as such
    import normexport.convert  # noqa: F401
    t_import = time.perf_counter() - t0
    install()
    t = time.perf_counter()
    rc = normexport.cli.main(cmd)
    total = time.perf_counter() - t
    phases = {label: round(times[label], 2) for label, _, _ in PHASES if label in times}
    out = {"command": cmd, "rc": rc, "total_s": round(total + t_import, 1), "imports_s": round(t_import, 1),
           "cpu_s": round(_cpu() + _children_cpu(), 1),
           "phases_s": phases, "phases_cpu_s": {label: round(cpu[label], 2) for label in phases}, "calls": {k: calls[k] for k in phases},
           "other_s": round(total - sum(top.values()), 1), "top_level_s": {k: round(v, 2) for k, v in top.items()}}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
