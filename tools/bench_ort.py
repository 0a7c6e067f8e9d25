#!/usr/bin/env python
"""onnxruntime CPU latency of normexport's exports against torch.onnx's own, side by side.

Variants, for each model:
  (a) default   torch.onnx.export(dynamo=True), default opset
  (b) opset23   torch.onnx.export(dynamo=True, opset_version=23)
  (c) ne-ort    normexport convert_module(..., target="ort")
  (c+) ort-skip / (c-) ort-noskip   the same with the rule module rules/skip_rms_norm.py forced on /
                off (residual Add + RMSNormalization -> com.microsoft SkipSimplifiedLayerNormalization):
                the side-by-side measurement that decides whether target ort uses it; (c) is one of them
  (d) ne-trt    normexport convert_module(..., target="trt"), run by onnxruntime through the
                custom ops' function bodies
  (e) eager     PyTorch, torch.set_num_threads(2)

Models: the LLaMA and DiT reference blocks at a moderate size (hidden 512, seq 256, batch 1)
and the norm-heavy graph at benchmark size (normexport.models.norm_heavy.bench(): 4096 x 2048 fp32).

Method: onnxruntime CPU EP, intra_op_num_threads=2, inter_op 1, sequential, all graph
optimisations; thread spinning off (ORT's allow_spinning=0, OMP_WAIT_POLICY=PASSIVE for torch)
so that one variant's idle threads do not steal the 2 cores from the next. Runs are
interleaved: every round runs each variant once, in a rotating order, so drift (thermal,
neighbours) hits all variants alike; medians and p10-p90 per variant. The machine's memory
copy bandwidth is measured in the same run (numpy copy of a 64 MB buffer; read + write bytes
counted) and gives the norm graph's memory floor: (inputs + weights + outputs bytes) / bandwidth.

Writes benchmarks/results/ort_<YYYY-MM-DD>_<machine-slug>.{json,png,txt} (the .txt: everything it
printed) and prints a table with ratios vs (a) and (b), paired per-round ratios with bootstrap
95 % CIs, the paired ratio (c+) / (c-) per model and an A/A control ((c) against the one of
(c+) / (c-) that is the same graph). Per round it records the share of CPU time other processes
used (the 2 cores are shared) and reports the paired ratios over quiet rounds too. --profile adds
onnxruntime's per-op-type profile of (c) on the norm-heavy graph ("where does the time go"), and
of whichever of (c+) / (c-) is not the same graph as (c). The contrib-op section (skip with
--no-contrib-ops; shapes with --contrib-shapes) times onnxruntime's fused residual+norm ops
against the standard Add + norm pair they replace, alone (same interleaving, paired ratios).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads its OpenMP runtime

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from contextlib import redirect_stdout  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

THREADS = 2
VARIANTS = ("default", "opset23", "ne-ort", "ort-skip", "ort-noskip", "ne-trt", "eager")
LABELS = {
    "default": "(a) torch.onnx default",
    "opset23": "(b) torch.onnx opset 23",
    "ne-ort": "(c) normexport --target ort",
    "ort-skip": "(c+) --target ort with rules/skip_rms_norm forced on",
    "ort-noskip": "(c-) --target ort with rules/skip_rms_norm forced off",
    "ne-trt": "(d) normexport --target trt (ORT, function bodies)",
    "eager": "(e) eager PyTorch",
}


# ---- models ------------------------------------------------------------------------------------
def build_models(quick: bool) -> dict[str, torch.nn.Module]:
    import normexport.models.dit
    import normexport.models.llama
    import normexport.models.norm_heavy

    def factory(mod, **size):
        """bench() when the module has one, else tiny() at a larger config."""
        if hasattr(mod, "bench") and not quick:
            return mod.bench()
        return mod.tiny(**size)

    if quick:
        return {"llama": normexport.models.llama.tiny(), "dit": normexport.models.dit.tiny(), "norm_heavy": normexport.models.norm_heavy.tiny()}
    return {
        "llama": factory(normexport.models.llama, hidden=512, heads=8, kv_heads=4, head_dim=64, intermediate=1376, seq=256),
        "dit": factory(normexport.models.dit, hidden=512, heads=8, seq=256),
        "norm_heavy": factory(normexport.models.norm_heavy),
    }


def describe(name: str, m: torch.nn.Module, args: tuple) -> str:
    shapes = ", ".join(f"{n}={'x'.join(map(str, t.shape))}" for n, t in zip(m.input_names, args))
    n_params = sum(p.numel() for p in m.parameters())
    return f"{type(m).__name__} {shapes}, {n_params / 1e6:.2f}M params, {next(m.parameters()).dtype}".replace("torch.", "")


# ---- exports -----------------------------------------------------------------------------------
ABLATED = "skip_rms_norm"  # the rule module (c+) / (c-) force on / off for target ort


@contextlib.contextmanager
def rule_module_forced(name: str, on: bool, target: str = "ort"):
    """normexport's rewriter with rule module `name` enabled (placed after rms_norm) or disabled
    for `target`, whatever rules/__init__.py and the module's TARGETS say; restored on exit."""
    import normexport.rewriter as rw

    mod = importlib.import_module(f"normexport.rewriter.rules.{name}")
    saved = (rw.RULE_MODULES, mod.TARGETS)
    mods = [m for m in rw.RULE_MODULES if m != name]
    if on:
        mods.insert(mods.index("rms_norm") + 1 if "rms_norm" in mods else len(mods), name)
    rw.RULE_MODULES = tuple(mods)
    mod.TARGETS = frozenset(saved[1] | {target}) if on else frozenset(saved[1] - {target})
    try:
        yield
    finally:
        rw.RULE_MODULES, mod.TARGETS = saved


def ablated_in_product(target: str = "ort") -> bool:
    """Whether the shipped rewriter runs ABLATED for `target` (then (c) == (c+), else (c) == (c-))."""
    import normexport.rewriter as rw

    if ABLATED not in rw.RULE_MODULES:
        return False
    return target in importlib.import_module(f"normexport.rewriter.rules.{ABLATED}").TARGETS


def _quiet_export(fn):
    with warnings.catch_warnings(), redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        return fn()


def export_variant(variant: str, m: torch.nn.Module, args: tuple) -> onnx.ModelProto:
    names = list(m.input_names)
    if variant == "default":
        return _quiet_export(lambda: torch.onnx.export(m, args, dynamo=True, input_names=names, verbose=False).model_proto)
    if variant == "opset23":
        return _quiet_export(lambda: torch.onnx.export(m, args, dynamo=True, opset_version=23, input_names=names,
                                                       verbose=False).model_proto)
    from normexport.export import convert_module

    if variant in ("ort-skip", "ort-noskip"):
        with rule_module_forced(ABLATED, on=variant == "ort-skip"):
            return _quiet_export(lambda: convert_module(m, args, target="ort", input_names=names))
    target, opset = {"ne-ort": ("ort", None), "ne-trt": ("trt", None)}[variant]
    return _quiet_export(lambda: convert_module(m, args, target=target, opset=opset, input_names=names))


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in model.graph.node:
        key = f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def session_options(profile_prefix: str | None = None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return so


def make_runner(variant: str, m: torch.nn.Module, args: tuple):
    """(run() -> list of outputs, info dict); raises when the variant cannot be built."""
    if variant == "eager":
        def run():
            with torch.inference_mode():
                out = m(*args)
            return [out] if isinstance(out, torch.Tensor) else list(out)

        return run, {}
    t0 = time.perf_counter()
    model = export_variant(variant, m, args)
    export_s = time.perf_counter() - t0
    sess = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    feed = {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)}

    def run():
        return sess.run(None, feed)

    return run, {"export_s": round(export_s, 2), "opset": default_opset(model), "nodes": len(model.graph.node),
                 "op_counts": op_counts(model), "model": model}


# ---- measurements ------------------------------------------------------------------------------
def copy_bandwidth(mb: int = 64, reps: int = 30) -> dict:
    """numpy copy of a `mb` MB buffer: (read + write bytes) / time, GB/s; best and median."""
    n = mb * 1024 * 1024 // 4
    src = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    moved = 2 * src.nbytes
    # torch's copy_ with the benchmark's 2 threads, for comparison
    ts, td = torch.from_numpy(src), torch.from_numpy(dst)
    ttimes = []
    for _ in range(reps):
        t0 = time.perf_counter()
        td.copy_(ts)
        ttimes.append(time.perf_counter() - t0)
    return {
        "buffer_mb": mb, "bytes_counted": "read + write",
        "numpy_gbps_median": moved / float(np.median(times)) / 1e9,
        "numpy_gbps_best": moved / min(times) / 1e9,
        "torch_2threads_gbps_median": moved / float(np.median(ttimes)) / 1e9,
        "torch_2threads_gbps_best": moved / min(ttimes) / 1e9,
    }


def norm_floor(m: torch.nn.Module, args: tuple, out: torch.Tensor, bw: dict) -> dict:
    """Bytes the norm graph must move at least (read inputs and weights once, write the output)
    and the time that takes at the measured copy bandwidth."""
    in_b = sum(t.numel() * t.element_size() for t in args)
    w_b = sum(p.numel() * p.element_size() for p in m.parameters())
    out_b = out.numel() * out.element_size()
    total = in_b + w_b + out_b
    return {
        "bytes_inputs": in_b, "bytes_weights": w_b, "bytes_outputs": out_b, "bytes_total": total,
        "floor_ms_numpy_median_bw": total / (bw["numpy_gbps_median"] * 1e9) * 1e3,
        "floor_ms_numpy_best_bw": total / (bw["numpy_gbps_best"] * 1e9) * 1e3,
        "floor_ms_torch_2threads_best_bw": total / (bw["torch_2threads_gbps_best"] * 1e9) * 1e3,
    }


def stats(samples: list[float]) -> dict:
    a = np.asarray(samples) * 1e3
    p10, p25, p50, p75, p90 = np.percentile(a, [10, 25, 50, 75, 90])
    return {"median_ms": float(p50), "p10_ms": float(p10), "p90_ms": float(p90), "iqr_ms": float(p75 - p25),
            "min_ms": float(a.min()), "n": int(a.size)}


_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
QUIET = 0.08  # a round is "quiet" when other processes used < 8 % of the machine's CPU time around it
_WINDOW_S = 0.5  # /proc/stat counts in clock ticks: judge the CPU use over windows of rounds at least this long


def _cpu_snapshot() -> tuple[float, float, float] | None:
    """(all CPUs' total seconds, their busy seconds, this process's CPU seconds), Linux only."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:9]]
    except OSError:
        return None
    t = os.times()
    return sum(vals) / _CLK, (sum(vals) - vals[3] - vals[4]) / _CLK, t.user + t.system


def others_share(a, b) -> float | None:
    """Share of the machine's CPU time that other processes used between two snapshots."""
    if a is None or b is None or b[0] <= a[0]:
        return None
    return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / (b[0] - a[0]))


def time_interleaved(runners: dict, rounds: int, warmup: int, budget_s: float,
                     others: list | None = None) -> dict[str, list[float]]:
    """Per-variant latencies; `others`, when given, receives per round the share of CPU time other
    processes used in the window of consecutive rounds (>= _WINDOW_S) that holds it (the shared
    machine's noise: rounds above QUIET can be set aside)."""
    names = list(runners)
    for _ in range(warmup):
        for n in names:
            runners[n]()
    samples: dict[str, list[float]] = {n: [] for n in names}
    t_start = time.perf_counter()
    win_snap, win_t, pending = _cpu_snapshot(), t_start, 0

    def close_window():
        share = others_share(win_snap, _cpu_snapshot())
        others.extend([float("nan") if share is None else share] * pending)

    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]  # rotate who goes first
        for n in order:
            t0 = time.perf_counter()
            runners[n]()
            samples[n].append(time.perf_counter() - t0)
        pending += 1
        if others is not None and time.perf_counter() - win_t >= _WINDOW_S:
            close_window()
            win_snap, win_t, pending = _cpu_snapshot(), time.perf_counter(), 0
        if r >= 4 and time.perf_counter() - t_start > budget_s:
            break
    if others is not None and pending:
        close_window()
    return samples


def mean_share(others) -> float:
    a = np.asarray(others, dtype=float)
    a = a[~np.isnan(a)]
    return float(a.mean()) if a.size else float("nan")


def paired_summary(num, den, quiet=None) -> dict:
    """Per-round ratios num/den: median, p10/p90, bootstrap CI of the median; the same over quiet rounds."""
    p = np.asarray(num) / np.asarray(den)
    out = {"paired_median": float(np.median(p)), "paired_p10": float(np.percentile(p, 10)),
           "paired_p90": float(np.percentile(p, 90)), "paired_ci95": median_ci95(p), "n": int(p.size)}
    if quiet is not None:
        q = p[np.asarray(quiet, bool)[: p.size]]
        out["quiet_n"] = int(q.size)
        if q.size >= 10:
            out.update({"quiet_paired_median": float(np.median(q)), "quiet_paired_ci95": median_ci95(q)})
    return out


def max_rel_diff(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b.detach().numpy() if isinstance(b, torch.Tensor) else b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# ---- profile -----------------------------------------------------------------------------------
def profile_variant(m: torch.nn.Module, args: tuple, model: onnx.ModelProto, runs: int) -> dict:
    """onnxruntime's profiler on `model`: time per op type (and the top nodes), per run."""
    with tempfile.TemporaryDirectory() as d:
        sess = ort.InferenceSession(model.SerializeToString(), session_options(str(Path(d) / "ort_profile")),
                                    providers=["CPUExecutionProvider"])
        feed = {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)}
        for _ in range(3):
            sess.run(None, feed)
        t0 = time.perf_counter()
        for _ in range(runs):
            sess.run(None, feed)
        wall = (time.perf_counter() - t0) / runs
        events = json.loads(Path(sess.end_profiling()).read_text())
    runs_ev = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                     key=lambda e: e["ts"])[3:]  # drop the warm-up runs
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in runs_ev]
    by_type: dict[str, dict] = {}
    by_node: dict[str, dict] = {}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if not any(lo <= e["ts"] <= hi for lo, hi in windows):
            continue
        a = e.get("args", {})
        op = a.get("op_name", "?")
        node = e["name"][: -len("_kernel_time")]
        t = by_type.setdefault(op, {"us": 0.0, "nodes": set()})
        t["us"] += e["dur"]
        t["nodes"].add(node)
        moved = sum(int(a.get(k, 0) or 0) for k in ("activation_size", "parameter_size", "output_size"))
        n = by_node.setdefault(node, {"op_type": op, "us": 0.0, "output_bytes": int(a.get("output_size", 0) or 0),
                                      "bytes_moved": moved})
        n["us"] += e["dur"]
    n_runs = max(len(windows), 1)
    total = sum(v["us"] for v in by_type.values()) or 1.0
    per_type = sorted(({"op_type": k, "ms_per_run": v["us"] / n_runs / 1e3, "share": v["us"] / total,
                        "nodes": len(v["nodes"])} for k, v in by_type.items()), key=lambda r: -r["ms_per_run"])
    top_nodes = sorted(({"node": k, "op_type": v["op_type"], "ms_per_run": v["us"] / n_runs / 1e3,
                         "output_mb": v["output_bytes"] / 1e6,
                         "gbps": v["bytes_moved"] / (v["us"] / n_runs * 1e-6) / 1e9 if v["us"] else None}
                        for k, v in by_node.items()),
                       key=lambda r: -r["ms_per_run"])[:12]
    runs_ms = np.asarray([hi - lo for lo, hi in windows] or [0.0]) / 1e3
    return {"runs": runs, "wall_ms_per_run": wall * 1e3, "model_run_ms_median": float(np.median(runs_ms)),
            "kernel_ms_per_run": total / n_runs / 1e3, "per_op_type": per_type, "top_nodes": top_nodes,
            "graph_op_counts": op_counts(model)}


# ---- output -----------------------------------------------------------------------------------
def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    slug = re.sub(r"[^a-z0-9]+", "-", f"{cpu or platform.machine()} {cores}c".lower()).strip("-")
    return {"cpu": cpu, "cores": cores, "slug": slug, "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "onnxruntime": ort.__version__, "onnx": onnx.__version__}


def print_table(results: dict, floor: dict | None) -> str:
    lines = []
    head = (f"{'model':<11} {'variant':<10} {'median ms':>10} {'p10-p90 ms':>17} {'vs (a)':>7} {'vs (b)':>7} "
            f"{'paired (a)':>10} {'paired (b)':>10} {'nodes':>6}  {'max rel diff vs eager':>21}  note")
    lines.append(head)
    lines.append("-" * len(head))
    for model, r in results.items():
        for v in VARIANTS:
            x = r["variants"].get(v)
            if x is None:
                continue
            if "error" in x:
                lines.append(f"{model:<11} {v:<10} {'FAILED':>10}  {x['error'][:100]}")
                continue
            rel_a = f"{x['ratio_vs_default']:.2f}" if x.get("ratio_vs_default") else "-"
            rel_b = f"{x['ratio_vs_opset23']:.2f}" if x.get("ratio_vs_opset23") else "-"
            spread = f"{x['p10_ms']:.2f}-{x['p90_ms']:.2f}"
            diff = x.get("max_rel_diff_vs_eager")
            pa = x.get("paired_ratio_vs_default", {}).get("median")
            pb = x.get("paired_ratio_vs_opset23", {}).get("median")
            pa = "-" if pa is None else f"{pa:.2f}"
            pb = "-" if pb is None else f"{pb:.2f}"
            lines.append(f"{model:<11} {v:<10} {x['median_ms']:>10.2f} {spread:>17} {rel_a:>7} {rel_b:>7} {pa:>10} {pb:>10} "
                         f"{x.get('nodes', '-')!s:>6}  {'-' if diff is None else format(diff, '.1e'):>21}  "
                         f"{'opset ' + str(x['opset']) if 'opset' in x else ''}")
        if model == "norm_heavy" and floor:
            lines.append(f"{'':<11} {'floor':<10} {floor['floor_ms_numpy_best_bw']:>10.2f}   memory floor: "
                         f"{floor['bytes_total'] / 1e6:.0f} MB moved at the best numpy copy bandwidth (1 thread)")
            lines.append(f"{'':<11} {'floor-2t':<10} {floor['floor_ms_torch_2threads_best_bw']:>10.2f}   the same at "
                         f"the best 2-thread torch copy bandwidth")
    lines.append("")
    lines.append(f"{ABLATED} on / off: (c+) ort-skip vs (c-) ort-noskip, same run "
                 f"(the shipped --target ort is {'(c+)' if ablated_in_product() else '(c-)'})")
    for model, r in results.items():
        e = r.get("ablation")
        if e:
            lines.append(f"  {model:<11} ratio of medians {e['ratio_of_medians']:.3f}, paired median {e['paired_median']:.3f} "
                         f"(p10-p90 {e['paired_p10']:.3f}-{e['paired_p90']:.3f}, 95% CI of the median "
                         f"{e['paired_ci95'][0]:.3f}-{e['paired_ci95'][1]:.3f}, {e['n']} rounds; {_quiet_text(e)}), "
                         f"(c+) has {e['fused_nodes']} SkipSimplifiedLayerNormalization")
            a = e.get("control_same_graph")
            if a:
                lines.append(f"  {'':<11} A/A control {a['pair']} (the same graph twice): paired median {a['paired_median']:.3f} "
                             f"(95% CI {a['paired_ci95'][0]:.3f}-{a['paired_ci95'][1]:.3f})")
    text = "\n".join(lines)
    print(text)
    return text


def _quiet_text(e: dict) -> str:
    if "quiet_paired_median" not in e:
        return f"quiet rounds {e.get('quiet_n', 0)}: too few"
    return (f"quiet rounds {e['quiet_paired_median']:.3f}, CI95 {e['quiet_paired_ci95'][0]:.3f}-"
            f"{e['quiet_paired_ci95'][1]:.3f}, n {e['quiet_n']}")


def median_ci95(x, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap 95 % interval of the median of `x` (how far the paired median can be trusted)."""
    x = np.asarray(x)
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(x, size=(reps, x.size), replace=True), axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


# ---- onnxruntime's fused residual+norm contrib ops, alone --------------------------------------
def contrib_op_pairs(shape: tuple[int, ...], seed: int = 0) -> dict[str, onnx.ModelProto]:
    """Graphs over inputs x, r of `shape`: the standard Add + norm pair and onnxruntime's fused op."""
    from onnx import TensorProto, helper, numpy_helper

    hdim = shape[-1]
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array((rng.random(hdim) + 0.5).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.random(hdim).astype(np.float32), "b")
    ms = "com.microsoft"

    def mk(nodes, outs, inits, contrib=False):
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(shape)) for n in "xr"],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], inits)
        imports = [helper.make_opsetid("", 23)] + ([helper.make_opsetid(ms, 1)] if contrib else [])
        m = helper.make_model(g, opset_imports=imports)
        m.ir_version = 10
        return m

    add = helper.make_node("Add", ["x", "r"], ["s"])
    rms = helper.make_node("RMSNormalization", ["s", "w"], ["y"], epsilon=1e-6)
    ln = helper.make_node("LayerNormalization", ["s", "w", "b"], ["y"], epsilon=1e-6)
    return {
        "Add+RMSNormalization": mk([add, rms], ["y"], [w]),
        "SkipSimplifiedLayerNormalization": mk([helper.make_node("SkipSimplifiedLayerNormalization", ["x", "r", "w"], ["y"],
                                                                 domain=ms, epsilon=1e-6)], ["y"], [w], True),
        "Add+RMSNormalization, sum used": mk([add, rms], ["y", "s"], [w]),
        "SkipSimplifiedLayerNormalization, sum used": mk(
            [helper.make_node("SkipSimplifiedLayerNormalization", ["x", "r", "w"], ["y", "", "", "s"], domain=ms,
                              epsilon=1e-6)], ["y", "s"], [w], True),
        "Add+LayerNormalization": mk([add, ln], ["y"], [w, b]),
        "SkipLayerNormalization": mk([helper.make_node("SkipLayerNormalization", ["x", "r", "w", "b"], ["y"], domain=ms,
                                                       epsilon=1e-6)], ["y"], [w, b], True),
    }


CONTRIB_PAIRS = (("SkipSimplifiedLayerNormalization", "Add+RMSNormalization"),
                 ("SkipSimplifiedLayerNormalization, sum used", "Add+RMSNormalization, sum used"),
                 ("SkipLayerNormalization", "Add+LayerNormalization"))


def bench_contrib_ops(shapes, rounds: int, budget_s: float) -> dict:
    out = {}
    for shape in shapes:
        rng = np.random.default_rng(1)
        feed = {n: rng.standard_normal(shape, dtype=np.float32) for n in "xr"}
        runners, first = {}, {}
        for name, model in contrib_op_pairs(shape).items():
            sess = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
            runners[name] = (lambda s=sess: s.run(None, feed))
            first[name] = runners[name]()
        others: list = []
        samples = time_interleaved(runners, rounds, 3, budget_s, others)
        quiet = np.asarray(others) < QUIET
        key = "x".join(map(str, shape))
        res = {"graphs": {n: stats(t) for n, t in samples.items()}, "pairs": {},
               "others_cpu_share_mean": mean_share(others), "quiet_rounds": int(quiet.sum())}
        for fused, plain in CONTRIB_PAIRS:
            res["pairs"][f"{fused} / {plain}"] = {
                "ratio_of_medians": res["graphs"][fused]["median_ms"] / res["graphs"][plain]["median_ms"],
                **paired_summary(samples[fused], samples[plain], quiet),
                "max_abs_diff": float(np.abs(first[fused][0].astype(np.float64) - first[plain][0]).max())}
        out[key] = res
    return out


def print_contrib(res: dict) -> str:
    lines = ["onnxruntime contrib ops alone (x, r fp32 of the shape; one graph each, interleaved; ms medians):"]
    for shape, r in res.items():
        lines.append(f"  [{shape}]  (other processes used {100 * r['others_cpu_share_mean']:.0f} % of the CPU; "
                     f"{r['quiet_rounds']} quiet rounds)")
        lines.append("    " + ", ".join(f"{n} {g['median_ms']:.3f}" for n, g in r["graphs"].items()))
        for name, p in r["pairs"].items():
            lines.append(f"    {name:<70} paired {p['paired_median']:.3f} (p10-p90 {p['paired_p10']:.3f}-"
                         f"{p['paired_p90']:.3f}, CI95 {p['paired_ci95'][0]:.3f}-{p['paired_ci95'][1]:.3f}, n {p['n']}; "
                         f"{_quiet_text(p)}), medians {p['ratio_of_medians']:.3f}, max|diff| {p['max_abs_diff']:.1e}"
                         + ("  <- identical outputs: onnxruntime fused the plain pair into the same op itself"
                            if p["max_abs_diff"] == 0.0 else ""))
    text = "\n".join(lines)
    print(text)
    return text


def plot(results: dict, floor: dict | None, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.4), squeeze=False)
    colors = {"default": "#9e9e9e", "opset23": "#607d8b", "ne-ort": "#2e7d32", "ort-skip": "#1565c0",
              "ort-noskip": "#90caf9", "ne-trt": "#66bb6a", "eager": "#ef6c00"}
    for ax, (model, r) in zip(axes[0], results.items()):
        vs = [v for v in VARIANTS if v in r["variants"] and "error" not in r["variants"][v]]
        med = [r["variants"][v]["median_ms"] for v in vs]
        lo = [r["variants"][v]["median_ms"] - r["variants"][v]["p10_ms"] for v in vs]
        hi = [r["variants"][v]["p90_ms"] - r["variants"][v]["median_ms"] for v in vs]
        ax.bar(range(len(vs)), med, yerr=[lo, hi], capsize=3, color=[colors[v] for v in vs])
        for i, mval in enumerate(med):
            ax.text(i, mval + hi[i], f"{mval:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(vs)), vs, rotation=30, fontsize=8)
        ax.set_ylabel("ms (median, p10-p90)")
        ax.set_title(f"{model}\n{r['description']}", fontsize=8)
        if model == "norm_heavy" and floor:
            ax.axhline(floor["floor_ms_numpy_best_bw"], color="red", ls="--", lw=1, label="memory floor")
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def goals(results: dict) -> dict:
    out = {}
    checks = [("norm_heavy", "default", 0.8), ("norm_heavy", "opset23", 1.0), ("llama", "default", 1.0), ("dit", "default", 1.0)]
    for model, base, target in checks:
        x = results.get(model, {}).get("variants", {}).get("ne-ort", {})
        r = x.get(f"ratio_vs_{base}")
        pr = x.get(f"paired_ratio_vs_{base}", {}).get("median")
        d = x.get(f"paired_vs_{base}_detail", {})
        out[f"{model}: ne-ort / {base} <= {target}"] = {"ratio_of_medians": r, "paired_ratio_median": pr,
                                                        "paired_ci95": d.get("paired_ci95"),
                                                        "quiet_paired_median": d.get("quiet_paired_median"),
                                                        "quiet_n": d.get("quiet_n"),
                                                        "met": None if r is None else r <= target}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama,dit,norm_heavy", help="comma list of llama, dit, norm_heavy")
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds (each runs every variant once)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget", type=float, default=90.0, help="seconds of timed rounds per model at most")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--profile", action="store_true", help="onnxruntime profile of (c) on the norm-heavy graph")
    p.add_argument("--profile-runs", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="tiny models, for a smoke test")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of variants to build and time "
                   "(ratios need default / opset23; the on/off line needs ort-skip and ort-noskip)")
    p.add_argument("--no-contrib-ops", action="store_true", help="skip timing the contrib ops alone")
    p.add_argument("--contrib-rounds", type=int, default=200)
    p.add_argument("--contrib-shapes", default="4096x2048,1x256x512",
                   help="comma list of shapes (RxH or BxSxH) for the contrib-op section")
    p.add_argument("--name-suffix", default="", help="appended to the output file stem (e.g. -contrib-sweep)")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)

    sys.stdout = _TEE
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    info = machine_info()
    print(f"machine: {info['cpu']} ({info['cores']} cores), torch {info['torch']}, onnxruntime {info['onnxruntime']}")
    load_start = os.getloadavg()
    bw = copy_bandwidth()
    print(f"memory copy bandwidth (numpy, 64 MB, read+write): {bw['numpy_gbps_median']:.1f} GB/s median, "
          f"{bw['numpy_gbps_best']:.1f} GB/s best; torch 2 threads {bw['torch_2threads_gbps_best']:.1f} GB/s best")

    all_models = build_models(args.quick)
    wanted = [s.strip() for s in args.models.split(",") if s.strip()]
    results: dict = {}
    floor = None
    profile = None
    profile_other = None
    for name in wanted:
        if name not in all_models:
            print(f"unknown model {name}: skipped")
            continue
        m = all_models[name]
        ex = m.example_inputs(batch=1)
        ex = tuple(ex)
        desc = describe(name, m, ex)
        print(f"\n== {name}: {desc}")
        with torch.inference_mode():
            ref = m(*ex)
        runners, infos = {}, {}
        chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
        for v in VARIANTS:
            if v not in chosen:
                continue
            try:
                run, meta = make_runner(v, m, ex)
                out = run()
                meta["max_rel_diff_vs_eager"] = max_rel_diff(out[0], ref) if v != "eager" else 0.0
                runners[v], infos[v] = run, meta
                print(f"  built {v:<8} " + (f"(export {meta['export_s']} s, opset {meta['opset']}, {meta['nodes']} nodes: "
                                             + ", ".join(f"{k} {c}" for k, c in list(meta['op_counts'].items())[:8]) + ")"
                                             if v != "eager" else ""))
            except Exception as e:
                msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
                print(f"  FAILED {v}: {msg}")
                traceback.print_exc(limit=3, file=sys.stdout)
                infos[v] = {"error": msg}
        others: list = []
        samples = time_interleaved(runners, args.rounds, args.warmup, args.budget, others)
        quiet = np.asarray(others) < QUIET
        variants = {}
        for v in VARIANTS:
            if v not in infos:
                continue
            meta = {k: val for k, val in infos[v].items() if k != "model"}
            if v in samples:
                meta.update(stats(samples[v]))
            variants[v] = meta
        for v, x in variants.items():
            for base in ("default", "opset23"):
                if "median_ms" in x and "median_ms" in variants.get(base, {}):
                    x[f"ratio_vs_{base}"] = x["median_ms"] / variants[base]["median_ms"]
                    # per-round ratios (the two ran back to back): robust to drift and neighbours
                    paired = np.asarray(samples[v]) / np.asarray(samples[base])
                    x[f"paired_ratio_vs_{base}"] = {"median": float(np.median(paired)),
                                                    "p10": float(np.percentile(paired, 10)),
                                                    "p90": float(np.percentile(paired, 90))}
        results[name] = {"description": desc, "variants": variants,
                         "others_cpu_share": {"mean": mean_share(others),
                                              "quiet_rounds": int(quiet.sum()), "rounds": len(others),
                                              "note": f"share of all CPU time used by other processes per round; "
                                                      f"quiet: < {QUIET}"}}
        print(f"  timed {len(others)} rounds; other processes used {100 * mean_share(others):.0f} % of the CPU "
              f"on average; {int(quiet.sum())} quiet rounds (< {100 * QUIET:.0f} %)")
        for v, x in variants.items():
            if "median_ms" in x and "opset23" in samples and v != "opset23":
                x["paired_vs_opset23_detail"] = paired_summary(samples[v], samples["opset23"], quiet)
            if "median_ms" in x and "default" in samples and v != "default":
                x["paired_vs_default_detail"] = paired_summary(samples[v], samples["default"], quiet)
        on, off = "ort-skip", "ort-noskip"
        if on in samples and off in samples:
            results[name]["ablation"] = {
                "module": ABLATED, "on": on, "off": off, "product_has_it": ablated_in_product(),
                "ratio_of_medians": variants[on]["median_ms"] / variants[off]["median_ms"],
                **paired_summary(samples[on], samples[off], quiet),
                "fused_nodes": variants[on].get("op_counts", {}).get("com.microsoft::SkipSimplifiedLayerNormalization", 0)}
            same = on if ablated_in_product() else off  # the same graph as (c): an A/A control of the pairing
            if "ne-ort" in samples:
                results[name]["ablation"]["control_same_graph"] = {
                    "pair": f"ne-ort / {same}", **paired_summary(samples["ne-ort"], samples[same], quiet)}
        if name == "norm_heavy":
            floor = norm_floor(m, ex, ref, bw)
            results[name]["memory_floor"] = floor
            if args.profile and "model" in infos.get("ne-ort", {}):
                profile = profile_variant(m, ex, infos["ne-ort"]["model"], args.profile_runs)
                other = off if ablated_in_product() else on
                if "model" in infos.get(other, {}):
                    profile_other = profile_variant(m, ex, infos[other]["model"], args.profile_runs)
                    profile_other["variant"] = other
        for v in list(infos):
            infos[v].pop("model", None)
        runners.clear()

    print()
    table = print_table(results, floor)
    g = goals(results)
    print("\ngoals (ratios of medians, same run):")
    for k, v in g.items():
        print(f"  {k}: {'n/a' if v['ratio_of_medians'] is None else format(v['ratio_of_medians'], '.2f')} "
              f"(paired {'n/a' if v['paired_ratio_median'] is None else format(v['paired_ratio_median'], '.2f')}"
              + (f", CI95 {v['paired_ci95'][0]:.2f}-{v['paired_ci95'][1]:.2f}" if v.get("paired_ci95") else "")
              + (f"; quiet rounds {v['quiet_paired_median']:.2f}, n {v['quiet_n']}" if v.get("quiet_paired_median") else "")
              + ") -> "
              f"{'n/a' if v['met'] is None else ('met' if v['met'] else 'NOT met')}")
    for label, prof in (("(c) ne-ort", profile), (f"{profile_other['variant'] if profile_other else ''}", profile_other)):
        if not prof:
            continue
        print(f"\nprofile of {label} on norm_heavy: {prof['model_run_ms_median']:.2f} ms per run "
              f"(kernels {prof['kernel_ms_per_run']:.2f} ms), per op type:")
        for r in prof["per_op_type"]:
            print(f"  {r['op_type']:<34} {r['ms_per_run']:8.2f} ms  {100 * r['share']:5.1f}%  ({r['nodes']} nodes)")
        print("  top nodes:")
        for r in prof["top_nodes"][:8]:
            gbps = "-" if r["gbps"] is None else f"{r['gbps']:.1f} GB/s"
            print(f"    {r['node'][:48]:<48} {r['op_type']:<32} {r['ms_per_run']:8.2f} ms  out {r['output_mb']:.1f} MB  {gbps}")
    contrib = None
    if not args.no_contrib_ops:
        shapes = [(64, 256), (1, 16, 256)] if args.quick else [
            tuple(int(d) for d in sh.split("x")) for sh in args.contrib_shapes.split(",") if sh.strip()]
        print()
        contrib = bench_contrib_ops(shapes, args.contrib_rounds, args.budget / 2)
        contrib_text = print_contrib(contrib)

    date = datetime.date.today().isoformat()
    report = {"tool": "tools/bench_ort.py", "date": date, "machine": info, "threads": THREADS,
              "method": {"rounds": args.rounds, "warmup": args.warmup, "budget_s": args.budget, "interleaved": True,
                         "variants_run": args.variants,
                         "ort": "CPUExecutionProvider, intra_op 2, inter_op 1, sequential, ORT_ENABLE_ALL, allow_spinning 0",
                         "eager": "torch.set_num_threads(2), inference_mode, OMP_WAIT_POLICY=" + os.environ.get("OMP_WAIT_POLICY", ""),
                         "spread": "p10-p90 and IQR of per-run latency", "quick": args.quick},
              "load_average": {"start": load_start, "end": os.getloadavg(),
                               "note": "1/5/15-min load averages; > 2 means other work shared the 2 cores"},
              "variants": LABELS, "memory_bandwidth": bw, "results": results, "goals": g, "table": table}
    if profile:
        report["profile_ne_ort_norm_heavy"] = profile
    if profile_other:
        report[f"profile_{profile_other['variant'].replace('-', '_')}_norm_heavy"] = profile_other
    if contrib:
        report["contrib_ops"] = contrib
        report["contrib_ops_table"] = contrib_text
    if not args.no_write:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = out_dir / f"ort_{date}_{info['slug']}{args.name_suffix}"
        tmp = stem.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
        os.replace(tmp, stem.with_suffix(".json"))
        wrote = [stem.with_suffix(".json"), stem.with_suffix(".txt")]
        if results:
            plot(results, floor, stem.with_suffix(".png"),
                 f"onnxruntime CPU ({THREADS} threads) vs eager, {info['cpu']} ({info['cores']} cores), {date}")
            wrote.insert(1, stem.with_suffix(".png"))
        print(f"\nwrote {', '.join(map(str, wrote))}")
        stem.with_suffix(".txt").write_text(_TEE.getvalue())  # everything printed above, this line included
    return 0


class _Tee(io.TextIOBase):
    """stdout that also keeps a copy (written as the .txt beside the JSON)."""

    def __init__(self, out):
        self._out, self._buf = out, io.StringIO()

    def write(self, text):
        self._buf.write(text)
        return self._out.write(text)

    def flush(self):
        self._out.flush()

    def getvalue(self) -> str:
        return self._buf.getvalue()


_TEE = _Tee(sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
