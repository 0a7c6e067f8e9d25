#!/usr/bin/env python3
"""Nsight Compute of the normexport kernels next to torch.compile's (Triton) kernel for the same
shape (issue 48): registers, occupancy, DRAM throughput, stall reasons, one table.

    python tools/ncu_kernels.py --lib build/plugins/libnormexport_kernels.so --out-dir DIR [SHAPE ...]

SHAPE is OP:DTYPE:ROWSxHIDDEN (default: the shapes that missed their goals on the H200, 2026-11-27,
and the narrowest width). For each shape, one `ncu` process profiles this script in --target mode:
the kernels are compiled and warmed up first, then one call of ours and one of torch.compile's run
between cudaProfilerStart / Stop (`--profile-from-start off`), so only those are profiled. ncu
collects the SpeedOfLight, Occupancy, LaunchStats, WarpStateStats and MemoryWorkloadAnalysis
sections; the raw metrics go to DIR/ncu_<shape>.csv and the summary to DIR/ncu_summary.md (and the
terminal). Metrics a version of ncu does not report are shown as "-".

Needs a GPU, ncu and torch with triton; written without either at hand (no GPU lent to the session
that wrote it), so its first run is also its test.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_SHAPES = (
    "AdaLNZero:bfloat16:16384x8192", "LayerNorm:bfloat16:16384x8192", "GatedAdaLNZero:bfloat16:16384x8192",
    "RMSNorm:bfloat16:16384x8192", "LayerNorm:bfloat16:393216x128", "AdaLNZero:bfloat16:16384x1152",
    "RMSNorm:bfloat16:16384x1152",
)
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis")
#: (column, raw metric name)
COLUMNS = (
    ("us", "gpu__time_duration.sum"),
    ("DRAM %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("achieved occ %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("theoretical occ %", "sm__maximum_warps_per_active_cycle_pct"),
    ("regs", "launch__registers_per_thread"),
    ("block", "launch__block_size"),
    ("grid", "launch__grid_size"),
    ("dyn smem", "launch__shared_mem_per_block_dynamic"),
)
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")


def parse_shape(spec: str) -> tuple[str, str, int, int]:
    op, dtype, dims = spec.split(":")
    rows, hidden = (int(v) for v in dims.split("x"))
    return op, dtype, rows, hidden


def target(spec: str, lib_path: str) -> int:
    """Run inside ncu: compile and warm up, then one call each between cudaProfilerStart / Stop."""
    import torch
    import torch.nn.functional as F

    import bench_kernels as bench

    op, dtype_name, rows, hidden = parse_shape(spec)
    lib = bench.load_lib(Path(lib_path))
    seq = min(256, rows) if rows % min(256, rows) == 0 else 1
    t = bench.allocate(torch, rows // seq, seq, hidden, getattr(torch, dtype_name))
    nbytes, ours, targs = bench.cases(torch, lib, t, bench.DTYPE_CODE[dtype_name], [op])[op]
    compiled = torch.compile(bench.torch_math(F)[op])
    for _ in range(3):
        ours()
        compiled(*targs)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    ours()
    compiled(*targs)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


def read_raw_csv(text: str) -> list[dict]:
    """ncu --csv --page raw: a header row of metric names, a row of units, then one row per kernel
    (lines before the header, ncu's ==PROF== messages, are skipped)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, body = rows[0], rows[2:]
    return [dict(zip(header, r)) for r in body if len(r) == len(header)]


def _num(v: str | None) -> float | None:
    try:
        return float(str(v).replace(",", ""))
    except (TypeError, ValueError):
        return None


def summarize(spec: str, kernels: list[dict]) -> list[str]:
    out = []
    for k in kernels:
        name = k.get("Kernel Name", "?")
        impl = "normexport" if "norm_" in name and "triton" not in name else "torch.compile" if "triton" in name else "?"
        cells = []
        for col, metric in COLUMNS:
            v = _num(k.get(metric))
            if v is not None and col == "us":
                unit = k.get("__units__", {}).get(metric, "")
                v = v / 1e3 if unit in ("nsecond", "ns") else v * 1e3 if unit in ("msecond", "ms") else v
            cells.append("-" if v is None else f"{v:.1f}" if col in ("us", "DRAM %") or "occ" in col else f"{v:.0f}")
        stalls = sorted(((m.group(1), _num(v)) for key, v in k.items() if isinstance(v, str) and (m := STALL.match(key))
                         and _num(v)), key=lambda kv: -kv[1])
        top = ", ".join(f"{r} {v:.1f}" for r, v in stalls[:3]) or "-"
        short = re.sub(r"\(.*", "", name)[:60]
        out.append(f"| {spec} | {impl} | `{short}` | " + " | ".join(cells) + f" | {top} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="*", default=list(DEFAULT_SHAPES))
    ap.add_argument("--lib", default=os.environ.get("NORMEXPORT_KERNELS_LIB"))
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "/tmp/normexport_ncu"))
    ap.add_argument("--ncu", default=os.environ.get("NCU", "ncu"))
    ap.add_argument("--target", metavar="SHAPE", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.lib:
        ap.error("--lib (or $NORMEXPORT_KERNELS_LIB) is required")
    if args.target:
        return target(args.target, args.lib)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = ["| shape | impl | kernel | " + " | ".join(c for c, _ in COLUMNS) + " | top stalls (cycles per issue) |",
             "|---|---|---|" + "---|" * len(COLUMNS) + "---|"]
    status = 0
    for spec in args.shapes:
        parse_shape(spec)
        cmd = [args.ncu, "--profile-from-start", "off", "--target-processes", "all", "--csv", "--page", "raw"]
        for s in SECTIONS:
            cmd += ["--section", s]
        cmd += [sys.executable, str(Path(__file__).resolve()), "--target", spec, "--lib", args.lib]
        run = subprocess.run(cmd, capture_output=True, text=True)
        slug = re.sub(r"[^A-Za-z0-9]+", "_", spec)
        (out / f"ncu_{slug}.csv").write_text(run.stdout)
        if run.returncode != 0:
            print(f"{spec}: ncu exit {run.returncode}: {run.stderr.strip()[-500:]}", file=sys.stderr)
            status = 1
            continue
        try:
            kernels = read_raw_csv(run.stdout)
            lines = run.stdout.splitlines()
            start = next(i for i, ln in enumerate(lines) if ln.startswith('"ID"'))
            header, units = list(csv.reader(io.StringIO("\n".join(lines[start:start + 2]))))
            for k in kernels:
                k["__units__"] = dict(zip(header, units))
            rows = summarize(spec, kernels)
        except Exception as exc:  # noqa: BLE001 - keep the raw CSV and go on with the next shape
            print(f"{spec}: could not read ncu's CSV ({type(exc).__name__}: {exc}); raw output in "
                  f"{out / f'ncu_{slug}.csv'}", file=sys.stderr)
            status = 1
            continue
        if not rows:
            print(f"{spec}: ncu profiled no kernel (stderr: {run.stderr.strip()[-300:]})", file=sys.stderr)
            status = 1
        table += rows
        print("\n".join(rows), flush=True)
    (out / "ncu_summary.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    print(f"wrote {out / 'ncu_summary.md'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
