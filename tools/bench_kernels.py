#!/usr/bin/env python3
"""Benchmark the normexport CUDA kernels against PyTorch eager and torch.compile.

RMSNorm, LayerNorm (weight + bias), AdaLNZero ([B,H] modulation, B = tokens / seq) and the fused
residual ops SkipRMSNorm (x + skip, then RMSNorm; writes y and the sum) and GatedAdaLNZero
(x + gate * update, then AdaLNZero; writes y and the sum) over tokens x hidden x dtype. The fused
ops are compared with torch eager / torch.compile of the same *unfused* math (the add, then the
norm, both results returned), which is what a model runs without them.

Two modes (issue 48's shape set is the default):
- bulk: --tokens rows (16384) x every width of HIDDEN_SUITE (the hidden sizes of current DiTs and
  LLMs), and the per-head q/k norm rows (--qk). Bandwidth counts one read of every input tensor and
  one write of every output; it is also given as a percentage of a device-to-device copy (torch
  copy_ of an x-sized buffer) measured in the same run. CUDA events, warm-up, median of --iters
  launches, each from a cold L2.
- decode: 1..64 rows (--decode-rows) x every width, as latency: --graph-launches back-to-back
  launches captured in one CUDA graph (ours, eager and torch.compile alike), the median over
  --graph-replays replays divided by the launches (L2 warm, as in a decode loop). The AdaLN kinds take
  one modulation row per row (batch = rows, seq 1). torch.compile as a user gets it by default
  (dynamic=None: static for the first row count, then dynamic rows); --decode-static compiles each
  row count on its own.

Writes benchmarks/results/<date>_<device-slug>.{json,png} (the JSON after every shape, so that a run
cut short keeps what it measured), prints a table and the goal verdicts. tools/kernel_table.py turns
the JSON into the docs' tables.

    python tools/bench_kernels.py [--lib build/plugins/libnormexport_kernels.so] [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DTYPE_CODE = {"float32": 0, "float16": 1, "bfloat16": 2}
OPS = ("RMSNorm", "LayerNorm", "AdaLNZero", "SkipRMSNorm", "GatedAdaLNZero")
#: per-head q/k norms of current DiTs and LLMs ([tokens x heads, head_dim]): Flux / SD3.5 at 1024^2
#: (4096 image + 512 text tokens... here 16384 tokens x 24 heads, rows of 128), Qwen3 / Gemma 3 prefill
#: (8192 tokens x 32 heads x 128), rows of 64 (16384 x 48 heads); the shapes where published kernels
#: differ by 7x (issue 30)
QK_SHAPES = ("393216x128", "262144x128", "786432x64")
QK_OPS = ("RMSNorm", "LayerNorm")
#: hidden sizes users run (issue 48): DiT-XL / PixArt 1152, SD3-medium 1536, LLaMA 3.2-1B 2048, SD3.5-large
#: 2432, Flux / HunyuanVideo / Qwen-Image / LLaMA 3.2-3B 3072, LLaMA 8B 4096, Wan-14B 5120, LLaMA 70B 8192
HIDDEN_SUITE = (1152, 1536, 2048, 2432, 3072, 4096, 5120, 8192)
#: decode: rows per call (batch of single tokens)
DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)
#: goals (issue 30), for shapes with at least GOAL_MIN_BYTES of activations (x): normexport at least
#: this share of the copy bandwidth measured in the same run, and no slower than torch.compile
GOAL_MIN_BYTES = 16 << 20
GOAL_PCT = 92.0
GOAL_PCT_SHORT_ROWS = 85.0  # rows of 128 (and shorter)


def _key(r: dict) -> tuple:
    return (r.get("mode", "bulk"), r["op"], r["dtype"], r["tokens"], r["hidden"])


def goals(results: list[dict]) -> list[dict]:
    """One verdict per normexport result. Bulk shapes with >= GOAL_MIN_BYTES of activations: the
    share of copy bandwidth against GOAL_PCT (GOAL_PCT_SHORT_ROWS for rows of <= 128), and the time
    against torch.compile of the same math (the unfused add + norm for the fused ops) on the same
    shape. Decode shapes: latency no higher than torch.compile's. A shape whose torch.compile time is
    missing fails (nothing to compare with: the goal is not shown met)."""
    compiled = {_key(c): c for c in results if c["impl"] == "torch.compile"}
    out = []
    for r in results:
        mode = r.get("mode", "bulk")
        if r["impl"] != "normexport" or (mode == "bulk" and r.get("x_bytes", 0) < GOAL_MIN_BYTES):
            continue
        comp = compiled.get(_key(r))
        vs = (comp["ms"] / r["ms"]) if comp and comp["ms"] and r["ms"] else None  # > 1: faster than torch.compile
        v = {"mode": mode, "op": r["op"], "dtype": r["dtype"], "tokens": r["tokens"], "hidden": r["hidden"],
             "speedup_vs_compile": vs, "compile_measured": vs is not None}
        if mode == "bulk":
            need = GOAL_PCT_SHORT_ROWS if r["hidden"] <= 128 else GOAL_PCT
            pct_ok = r["pct_of_copy"] is not None and r["pct_of_copy"] >= need
            v.update(pct_of_copy=r["pct_of_copy"], pct_goal=need, passed=pct_ok and vs is not None and vs >= 1.0)
        else:
            v.update(us=r["ms"] * 1e3 if r["ms"] else None, compile_us=comp["ms"] * 1e3 if vs else None,
                     passed=vs is not None and vs >= 1.0)
        out.append(v)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", default=os.environ.get("NORMEXPORT_KERNELS_LIB"),
                   help="libnormexport_kernels.so (default: build/plugins/, built with CMake if missing)")
    p.add_argument("--tokens", type=int, nargs="*", default=[16384], help="bulk rows (none: no bulk shapes)")
    p.add_argument("--hidden", type=int, nargs="+", default=list(HIDDEN_SUITE))
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"], choices=list(DTYPE_CODE))
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence for AdaLNZero ([B,H] modulation)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    p.add_argument("--qk", nargs="*", default=list(QK_SHAPES), metavar="ROWSxHEAD_DIM",
                   help="per-head q/k norm shapes, run for RMSNorm and LayerNorm: millions of short rows "
                        "(default: %(default)s; none: --qk with no value)")
    p.add_argument("--decode-rows", type=int, nargs="*", default=list(DECODE_ROWS),
                   help="decode row counts, timed as latency (default: %(default)s; none: --decode-rows with no value)")
    p.add_argument("--decode-hidden", type=int, nargs="+", default=None, help="decode widths (default: --hidden)")
    p.add_argument("--decode-dtypes", nargs="+", default=None, choices=list(DTYPE_CODE), help="default: --dtypes")
    p.add_argument("--decode-static", action="store_true",
                   help="compile each decode row count on its own (default: torch.compile's automatic dynamic rows)")
    p.add_argument("--graph-launches", type=int, default=20, help="decode: launches captured per CUDA graph")
    p.add_argument("--graph-replays", type=int, default=30, help="decode: timed replays (median)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--ours-only", action="store_true",
                   help="time only the normexport kernels (and the copy): a variant build beside a full run")
    p.add_argument("--quick", action="store_true", help="fewer iterations, no torch.compile")
    p.add_argument("--plan", action="store_true", help="print the shapes and compilations a run would take; no GPU")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    return p.parse_args(argv)


def ensure_lib(path: str | None) -> Path:
    if path:
        return Path(path)
    build = REPO / "build" / "plugins"
    lib = build / "libnormexport_kernels.so"
    if not lib.exists():
        print(f"building kernels into {build} ...", flush=True)
        subprocess.run(["cmake", "-S", str(REPO / "plugins"), "-B", str(build)], check=True)
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)], check=True)
    return lib


def load_lib(path: Path):
    so = ctypes.CDLL(str(path))
    i64, p, f32, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    so.normexport_rms_norm.argtypes = [p, p, p, i64, i64, c_int, f32, p]
    so.normexport_adaln_zero.argtypes = [p, p, p, p, p, p, i64, i64, i64, c_int, c_int, f32, p]
    so.normexport_layer_norm.argtypes = [p, p, p, p, i64, i64, c_int, f32, p]
    so.normexport_skip_rms_norm.argtypes = [p, p, p, p, p, p, i64, i64, c_int, f32, p]
    so.normexport_gated_adaln_zero.argtypes = [p, p, p, p, p, p, p, p, p, i64, i64, i64, c_int, c_int, f32, p]
    for fn in (so.normexport_rms_norm, so.normexport_adaln_zero, so.normexport_layer_norm, so.normexport_skip_rms_norm,
               so.normexport_gated_adaln_zero):
        fn.restype = c_int
    return so


#: short dtype names for labels (the plot once cut "float16" and "float32" both to "floa")
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def time_fn(torch, fn, iters: int, warmup: int, flush) -> float:
    """Median milliseconds of one call from a cold L2: before each timed call the GPU zeroes
    `flush` (larger than L2), and the CUDA events are queued behind that, so neither the host's
    launch overhead nor cache hits from the previous call are counted (as triton's do_bench)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return _timed_median(torch, iters, fn, before=flush.zero_)


def _timed_median(torch, n: int, fn, before=None) -> float:
    """Median milliseconds of `fn` over n calls, each between two CUDA events (after `before`, untimed)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        if before is not None:
            before()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def time_graph(torch, fn, launches: int, replays: int) -> float:
    """Milliseconds per call of `fn` run back to back: `launches` calls captured in one CUDA graph
    (after a warm-up on a side stream, which also compiles and autotunes a torch.compile'd fn), the
    median over `replays` timed replays divided by `launches`. No host launch overhead, L2 warm:
    the latency of a norm inside a decode step."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    ms = _timed_median(torch, replays, graph.replay)
    del graph
    return ms / launches


EPS = 1e-6


def torch_math(F) -> dict:
    """The same math in torch (the fused ops unfused: the add, then the norm, both returned)."""

    def rms(x, w):
        return F.rms_norm(x, (x.shape[-1],), w, EPS)

    def ln(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b, EPS)

    def adaln(x, shift, scale):
        y = F.layer_norm(x, (x.shape[-1],), None, None, EPS)
        return y * (1 + scale[:, None]) + shift[:, None]

    def skip(x, res, w):
        h = x + res
        return F.rms_norm(h, (h.shape[-1],), w, EPS), h

    def gated(x, upd, gate, shift, scale):
        h = x + gate[:, None] * upd
        y = F.layer_norm(h, (h.shape[-1],), None, None, EPS)
        return y * (1 + scale[:, None]) + shift[:, None], h

    return {"RMSNorm": rms, "LayerNorm": ln, "AdaLNZero": adaln, "SkipRMSNorm": skip, "GatedAdaLNZero": gated}


def allocate(torch, batch: int, seq: int, hidden: int, dtype) -> dict:
    """Inputs and outputs of every op for x [batch, seq, hidden] ([batch, hidden] modulation)."""
    dev = torch.device("cuda")
    x = torch.randn(batch, seq, hidden, device=dev, dtype=dtype)
    return {"x": x, "y": torch.empty_like(x), "sum": torch.empty_like(x), "res": torch.randn_like(x),
            "w": torch.rand(hidden, device=dev, dtype=dtype) + 0.5,
            "b": torch.randn(hidden, device=dev, dtype=dtype) * 0.1,
            "shift": torch.randn(batch, hidden, device=dev, dtype=dtype) * 0.1,
            "scale": torch.randn(batch, hidden, device=dev, dtype=dtype) * 0.1,
            "gate": torch.randn(batch, hidden, device=dev, dtype=dtype) * 0.5}


def leading(t: dict, batch: int) -> dict:
    """The first `batch` rows of every per-row tensor (contiguous views), the [H] parameters whole."""
    return {k: (v if k in ("w", "b") else v[:batch]) for k, v in t.items()}


def cases(torch, lib, t: dict, code: int, ops) -> dict:
    """op -> (bytes moved, our call, torch args) for the tensors `t` (x [batch, seq, hidden])."""
    batch, seq, hidden = t["x"].shape
    rows, n, bh = batch * seq, t["x"].numel(), batch * hidden
    esize = t["x"].element_size()
    ptr = {k: v.data_ptr() for k, v in t.items()}

    def call(fn, what, *args):
        def run():  # the current stream at call time: a CUDA graph's capture stream too
            rc = fn(*args, torch.cuda.current_stream().cuda_stream)
            if rc != 0:
                raise RuntimeError(f"{what} returned cudaError {rc}")
        return run

    table = {
        "RMSNorm": ((2 * n + hidden) * esize,
                    call(lib.normexport_rms_norm, "normexport_rms_norm", ptr["x"], ptr["w"], ptr["y"], rows, hidden,
                         code, EPS), (t["x"], t["w"])),
        "LayerNorm": ((2 * n + 2 * hidden) * esize,
                      call(lib.normexport_layer_norm, "normexport_layer_norm", ptr["x"], ptr["w"], ptr["b"], ptr["y"],
                           rows, hidden, code, EPS), (t["x"], t["w"], t["b"])),
        "AdaLNZero": ((2 * n + 2 * bh) * esize,
                      call(lib.normexport_adaln_zero, "normexport_adaln_zero", ptr["x"], ptr["shift"], ptr["scale"],
                           None, None, ptr["y"], batch, seq, hidden, 0, code, EPS), (t["x"], t["shift"], t["scale"])),
        # fused: read x and the skip / update, write y and the sum
        "SkipRMSNorm": ((4 * n + hidden) * esize,
                        call(lib.normexport_skip_rms_norm, "normexport_skip_rms_norm", ptr["x"], ptr["res"], None,
                             ptr["w"], ptr["y"], ptr["sum"], rows, hidden, code, EPS), (t["x"], t["res"], t["w"])),
        "GatedAdaLNZero": ((4 * n + 3 * bh) * esize,
                           call(lib.normexport_gated_adaln_zero, "normexport_gated_adaln_zero", ptr["x"], ptr["res"],
                                ptr["gate"], ptr["shift"], ptr["scale"], None, None, ptr["y"], ptr["sum"], batch, seq,
                                hidden, 0, code, EPS), (t["x"], t["res"], t["gate"], t["shift"], t["scale"])),
    }
    return {op: table[op] for op in ops}


def implementations(ours, eager, compiled, targs, ours_only: bool) -> dict:
    """impl name -> call: ours, torch eager (unless ours_only), torch.compile (when compiled)."""
    impls = {"normexport": ours}
    if not ours_only:
        impls["torch eager"] = lambda: eager(*targs)
    if compiled is not None:
        impls["torch.compile"] = lambda: compiled(*targs)
    return impls


def fresh_compiled(torch, math: dict) -> dict:
    """torch.compile of every op's math, after a dynamo reset: past dynamo's recompile limit (8) it
    would quietly run eager code under the torch.compile label."""
    torch._dynamo.reset()
    return {op: torch.compile(fn) for op, fn in math.items()}


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def plan(args) -> list[dict]:
    """What a run measures, in order: bulk shapes (dtype x --tokens x --hidden with every op, then the
    per-head rows with RMSNorm / LayerNorm) and decode groups (dtype x width, every row count), each
    with the torch.compile compilations it costs (the slow part of a run)."""
    if args.quick:
        args.iters, args.warmup, args.no_compile = 20, 5, True
    if args.ours_only:
        args.no_compile = True
    steps = []
    for dtype in args.dtypes:
        grid = [(t, h, list(args.ops)) for t in args.tokens for h in args.hidden]
        grid += [(int(r), int(h), [o for o in args.ops if o in QK_OPS]) for r, h in (q.split("x") for q in args.qk)]
        for tokens, hidden, ops in grid:
            seq = min(args.seq, tokens)
            if not ops or tokens % seq:
                if ops:
                    print(f"skip tokens={tokens}: not a multiple of --seq {seq}", file=sys.stderr)
                continue
            steps.append({"mode": "bulk", "dtype": dtype, "tokens": tokens, "hidden": hidden, "ops": ops,
                          "batch": tokens // seq, "seq": seq, "compiles": 0 if args.no_compile else len(ops)})
    rows = sorted(set(args.decode_rows))
    for dtype in (args.decode_dtypes or args.dtypes) if rows else []:
        for hidden in args.decode_hidden or args.hidden:
            # default torch.compile: the first row count static, the next one recompiles with dynamic rows
            per_op = len(rows) if args.decode_static else min(len(rows), 2)
            steps.append({"mode": "decode", "dtype": dtype, "hidden": hidden, "rows": rows, "ops": list(args.ops),
                          "compiles": 0 if args.no_compile else per_op * len(args.ops)})
    return steps


def describe(steps: list[dict]) -> str:
    bulk = sum(len(s["ops"]) for s in steps if s["mode"] == "bulk")
    decode = sum(len(s["ops"]) * len(s["rows"]) for s in steps if s["mode"] == "decode")
    return (f"plan: {bulk} bulk shapes (op x dtype x rows x hidden), {decode} decode shapes, "
            f"{sum(s['compiles'] for s in steps)} torch.compile compilations")


def main(argv=None) -> int:
    args = parse_args(argv)
    steps = plan(args)
    print(describe(steps), flush=True)
    if args.plan:
        for st in steps:
            shape = f"{st['tokens']} x {st['hidden']}" if st["mode"] == "bulk" else f"rows {st['rows']} x {st['hidden']}"
            print(f"  {st['mode']:<6} {SHORT_DTYPE[st['dtype']]} {shape}: {', '.join(st['ops'])}")
        return 0
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("bench_kernels: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU (torch.cuda.is_available() is False); nothing to measure", file=sys.stderr)
        return 2

    lib = load_lib(ensure_lib(args.lib))
    name = torch.cuda.get_device_name(0)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    math = torch_math(F)
    results: list[dict] = []
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{dt.date.today().isoformat()}_{slug}"
    meta = {
        "device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "iters": args.iters, "warmup": args.warmup, "eps": EPS, "seq": args.seq,
        "graph_launches": args.graph_launches, "graph_replays": args.graph_replays,
        "decode_compile": "static per row count" if args.decode_static else "torch.compile default (dynamic=None)",
        "timing": "bulk: CUDA events around each call, queued behind a write of a buffer 4x the L2 size (cold L2, "
                  "no host launch overhead); median. decode: back-to-back launches in one CUDA graph, median replay "
                  "time / launches (L2 warm)",
        "bytes_model": "read x + write y + read params (RMSNorm: scale [H]; LayerNorm: weight, bias [H]; AdaLNZero: "
                       "shift, scale [B,H]); fused ops also read the skip / update and write the sum (GatedAdaLNZero: "
                       "gate [B,H] too)",
    }
    started = time.monotonic()

    def save():
        write_json(stem.with_suffix(".json"), {"meta": meta, "results": results, "goals": goals(results)})

    def record(mode, op, impl, dtype_name, rows, hidden, batch, seq, ms, nbytes, esize, copy_gbs=None):
        gbs = nbytes / ms / 1e6 if ms else None
        results.append({
            "mode": mode, "op": op, "impl": impl, "dtype": dtype_name, "tokens": rows, "hidden": hidden,
            "batch": batch, "seq": seq, "ms": ms, "bytes": nbytes, "gb_per_s": gbs, "copy_gb_per_s": copy_gbs,
            "pct_of_copy": (100 * gbs / copy_gbs) if gbs and copy_gbs else None, "x_bytes": rows * hidden * esize,
        })

    def timed(what, fn):
        try:
            return fn()
        except Exception as exc:  # torch.compile may be unavailable (no triton)
            print(f"  {what} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return None

    # -- bulk: bandwidth from a cold L2
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or (64 << 20)
    flush = torch.empty(max(4 * l2_bytes, 256 << 20), dtype=torch.int8, device="cuda")
    for st in (st for st in steps if st["mode"] == "bulk"):
        dtype_name, tokens, hidden, shape_ops, batch, seq = (st[k] for k in ("dtype", "tokens", "hidden", "ops", "batch",
                                                                              "seq"))
        dtype = getattr(torch, dtype_name)
        code = DTYPE_CODE[dtype_name]
        t = allocate(torch, batch, seq, hidden, dtype)
        esize = t["x"].element_size()
        compiled = {} if args.no_compile else fresh_compiled(torch, math)
        copy_ms = time_fn(torch, lambda: t["y"].copy_(t["x"]), args.iters, args.warmup, flush)
        copy_gbs = 2 * t["x"].numel() * esize / copy_ms / 1e6
        for op, (nbytes, ours, targs) in cases(torch, lib, t, code, shape_ops).items():
            for impl, fn in implementations(ours, math[op], compiled.get(op), targs, args.ours_only).items():
                ms = timed(f"{op} {impl}", lambda: time_fn(torch, fn, args.iters, args.warmup, flush))
                record("bulk", op, impl, dtype_name, tokens, hidden, batch, seq, ms, nbytes, esize, copy_gbs)
        del t
        torch.cuda.empty_cache()
        save()
        print(f"[{time.monotonic() - started:6.1f} s] bulk {SHORT_DTYPE[dtype_name]} {tokens} x {hidden} done",
              flush=True)
    del flush
    torch.cuda.empty_cache()

    # -- decode: latency of back-to-back launches (batch = rows, seq 1: a modulation row per row)
    for st in (st for st in steps if st["mode"] == "decode"):
        dtype_name, hidden, rows_list = st["dtype"], st["hidden"], st["rows"]
        dtype = getattr(torch, dtype_name)
        code = DTYPE_CODE[dtype_name]
        full = allocate(torch, max(rows_list), 1, hidden, dtype)
        esize = full["x"].element_size()
        compiled = {}
        for rows in rows_list:
            if not args.no_compile and (args.decode_static or not compiled):
                compiled = fresh_compiled(torch, math)
            t = leading(full, rows)
            for op, (nbytes, ours, targs) in cases(torch, lib, t, code, args.ops).items():
                for impl, fn in implementations(ours, math[op], compiled.get(op), targs, args.ours_only).items():
                    ms = timed(f"decode {op} {impl}",
                               lambda: time_graph(torch, fn, args.graph_launches, args.graph_replays))
                    record("decode", op, impl, dtype_name, rows, hidden, rows, 1, ms, nbytes, esize)
        del full, t
        torch.cuda.empty_cache()
        save()
        print(f"[{time.monotonic() - started:6.1f} s] decode {SHORT_DTYPE[dtype_name]} rows {rows_list} x {hidden} "
              "done", flush=True)

    print_report(results, name, args.iters)
    save()
    try:
        plot([r for r in results if r["mode"] == "bulk"], name, stem.with_suffix(".png"))
    except Exception as exc:  # matplotlib missing: JSON is still written
        print(f"plot skipped: {exc}", file=sys.stderr)
    print(f"\nwrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')} "
          f"({time.monotonic() - started:.0f} s)")
    return 0


def _table(title: str, header: str, lines: list[str]) -> None:
    if lines:
        print(f"\n{title}\n{header}\n{'-' * len(header)}")
        print("\n".join(lines))


def print_report(results: list[dict], device: str, iters: int) -> None:
    def num(v, fmt):
        return format(v, fmt) if v else "-"

    _table(f"{device}  (bulk: copy bandwidth measured per shape; median of {iters} calls, each from a cold L2)",
           f"{'op':<14} {'dtype':<9} {'tokens':>7} {'hidden':>6} {'impl':<14} {'ms':>8} {'GB/s':>8} {'%copy':>6}",
           [f"{r['op']:<14} {r['dtype']:<9} {r['tokens']:>7} {r['hidden']:>6} {r['impl']:<14} {num(r['ms'], '.4f'):>8} "
            f"{num(r['gb_per_s'], '.0f'):>8} {num(r['pct_of_copy'], '.0f'):>6}"
            for r in results if r.get("mode", "bulk") == "bulk"])
    _table(f"{device}  (decode: microseconds per call, back-to-back in a CUDA graph)",
           f"{'op':<14} {'dtype':<9} {'rows':>5} {'hidden':>6} {'impl':<14} {'us':>8}",
           [f"{r['op']:<14} {r['dtype']:<9} {r['tokens']:>5} {r['hidden']:>6} {r['impl']:<14} "
            f"{num(r['ms'] and r['ms'] * 1e3, '.2f'):>8}" for r in results if r.get("mode") == "decode"])
    verdicts = goals(results)
    if not verdicts:
        return
    print(f"\ngoals: bulk (x >= {GOAL_MIN_BYTES >> 20} MiB) >= {GOAL_PCT:.0f} % of copy ({GOAL_PCT_SHORT_ROWS:.0f} % "
          "for rows <= 128) and no slower than torch.compile; decode: latency <= torch.compile's")
    for v in verdicts:
        vs = f"{v['speedup_vs_compile']:.2f}x torch.compile" if v["compile_measured"] else "torch.compile not measured"
        mark = "PASS" if v["passed"] else "MISS"
        if v["mode"] == "bulk":
            pct = f"{v['pct_of_copy']:.0f}" if v["pct_of_copy"] is not None else "-"
            print(f"  {mark}  {v['op']:<14} {v['dtype']:<9} {v['tokens']:>7} x {v['hidden']:<6} "
                  f"{pct:>4} % of copy (goal {v['pct_goal']:.0f}), {vs}")
        else:
            us = f"{v['us']:.2f}" if v["us"] else "-"
            print(f"  {mark}  {v['op']:<14} {v['dtype']:<9} decode {v['tokens']:>3} x {v['hidden']:<6} {us:>7} us, {vs}")
    for mode in ("bulk", "decode"):
        vs = [v for v in verdicts if v["mode"] == mode]
        if vs:
            print(f"  {mode}: {sum(v['passed'] for v in vs)} of {len(vs)} shapes meet the goals")


def plot(results, device: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in results})
    impls = list(dict.fromkeys(r["impl"] for r in results))
    fig, axes = plt.subplots(len(ops), 1, figsize=(14, 4.5 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        rows = [r for r in results if r["op"] == op]
        configs = list(dict.fromkeys((r["dtype"], r["tokens"], r["hidden"]) for r in rows))
        width = 0.8 / max(len(impls), 1)
        for k, impl in enumerate(impls):
            vals = []
            for cfg in configs:
                hit = [r for r in rows if (r["dtype"], r["tokens"], r["hidden"]) == cfg and r["impl"] == impl]
                vals.append((hit[0]["pct_of_copy"] or 0) if hit else 0)
            ax.bar([i + k * width for i in range(len(configs))], vals, width, label=impl)
        ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(configs))])
        ax.set_xticklabels([f"{SHORT_DTYPE.get(d, d)}\n{t}x{h}" for d, t, h in configs], fontsize=7)
        ax.axhline(100, color="grey", lw=0.8, ls="--")
        ax.set_ylabel("% of copy bandwidth")
        ax.set_title(f"{op} on {device}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
