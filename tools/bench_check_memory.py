"""`normexport check` of a real-size LLM file inside a memory cgroup (issue 47 item 2: "check of a
Llama-3-8B-shaped bf16 file: measure its peak and make it fit a cgroup of 0.5x the weights").

    python tools/bench_check_memory.py --preset llama3-8b --work /tmp/check8b --limits 0.5 [--json OUT]

1. the preset's random-weight bfloat16 folder (tools/bench_scale.make_folder: tensor by tensor, never the
   whole model in RAM), unless --work already holds it;
2. `normexport convert DIR -o conv.onnx --target ort` (its default task: the KV-cache graph; whole-model
   parity is skipped at this size and says so), outside any cgroup, unless conv.onnx exists;
3. `normexport check conv.onnx --reference DIR` in a cgroup-v1 memory group of each --limits x the weights
   (tools/bench_llm.timed: memory.limit_in_bytes; page cache is reclaimed under it, anonymous memory is
   not: no swap here, so anonymous memory over the limit is an OOM kill), and once without a limit
   (--no-unlimited leaves that out): exit code, wall and CPU seconds, peak RSS (time -v: mapped files
   included), peak anonymous memory (the cgroup's total_rss), the cgroup's peak usage, the last line.

Writes the rows as JSON (--json) with the machine and the date; the log of each run beside it in --work.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llm import timed  # noqa: E402
from bench_scale import PRESETS, make_folder  # noqa: E402


def _gib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**30


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--limits", default="0.5", help="comma-separated cgroup limits, x the weights (default 0.5)")
    ap.add_argument("--no-unlimited", action="store_true", help="no run without a limit")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per check run (default 3600)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    exe = str(Path(sys.executable).with_name("normexport"))
    folder, conv = args.work / "folder", args.work / "conv.onnx"
    rows = []
    if not (folder / "config.json").exists():
        print(f"writing the {args.preset} folder (bfloat16, random weights) to {folder}", flush=True)
        make_folder(args.preset, folder, dtype="bfloat16")
    weights = _gib(folder)
    print(f"{args.preset}: {weights:.2f} GiB of weights", flush=True)
    if not conv.exists():
        r = timed([exe, "convert", str(folder), "-o", str(conv), "--target", "ort"], log=args.work / "convert.log")
        rows.append({"step": "convert", **r})
        print("convert", r, flush=True)
        if r["rc"] != 0:
            return _write(args, weights, rows)
    limits = [float(x) for x in args.limits.split(",") if x.strip()]
    for limit in limits + ([] if args.no_unlimited else [None]):
        gib = round(limit * weights, 2) if limit else None
        name = f"check_{limit}x" if limit else "check_unlimited"
        cmd = ["timeout", str(int(args.timeout)), exe, "check", str(conv), "--reference", str(folder)]
        r = timed(cmd, log=args.work / f"{name}.log", memory_limit_gib=gib)
        rows.append({"step": name, "limit_x_weights": limit, **r})
        print(name, r, flush=True)
    return _write(args, weights, rows)


def _write(args, weights: float, rows: list) -> int:
    doc = {"date": datetime.date.today().isoformat(), "preset": args.preset, "weights_gib": round(weights, 3),
           "machine": {"node": platform.node(), "cores": os.cpu_count(), "cpu": _cpu()}, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if rows and all(r["rc"] == 0 for r in rows) else 1


def _cpu() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
