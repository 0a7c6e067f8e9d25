#!/usr/bin/env python3
"""One table from several tools/bench_kernels.py JSON files of the same shapes on the same GPU
(tools/gpu_compare.sh): each build's normexport time and share of copy bandwidth, and torch.compile /
eager from whichever file measured them.

    python tools/bench_compare.py new/X.json base/X.json prefetch/X.json

A build is named by its file's folder (new, base, prefetch). Decode shapes (latency) show
microseconds per call in the ms column's place and no share of copy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> int:
    builds: dict[str, dict] = {}
    torch_rows: dict[tuple, dict] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        name = Path(path).parent.name
        for r in data["results"]:
            key = (r.get("mode", "bulk"), r["op"], r["dtype"], r["tokens"], r["hidden"])
            if r["impl"] == "normexport":
                builds.setdefault(name, {})[key] = r
            else:
                torch_rows.setdefault(key, {})[r["impl"]] = r
    names = list(builds)
    keys = list(dict.fromkeys(k for b in builds.values() for k in b))
    head = f"{'op':<14} {'dtype':<8} {'shape':>17}" + "".join(f" {n[:10]:>10} ms  %cp" for n in names)
    head += f" {'compile':>9} {'eager':>9}" + "".join(f" {('x' + n)[:8]:>8}" for n in names)
    print(head)
    print("-" * len(head))
    for k in keys:
        mode, op, dtype, tokens, hidden = k
        shape = f"{tokens}x{hidden}" if mode == "bulk" else f"decode {tokens}x{hidden}"
        line = f"{op:<14} {dtype[:8]:<8} {shape:>17}"
        for n in names:
            r = builds[n].get(k)
            if not (r and r["ms"]):
                line += f" {'-':>13} {'-':>4}"
            elif mode == "bulk":
                line += f" {r['ms']:>13.4f} {r['pct_of_copy']:>4.0f}"
            else:
                line += f" {r['ms'] * 1e3:>11.2f}us {'-':>4}"
        comp = torch_rows.get(k, {}).get("torch.compile")
        eager = torch_rows.get(k, {}).get("torch eager")
        line += f" {comp['ms']:>9.4f}" if comp and comp["ms"] else f" {'-':>9}"
        line += f" {eager['ms']:>9.4f}" if eager and eager["ms"] else f" {'-':>9}"
        for n in names:  # torch.compile's time over this build's (> 1: faster than torch.compile)
            r = builds[n].get(k)
            line += f" {comp['ms'] / r['ms']:>8.2f}" if comp and comp["ms"] and r and r["ms"] else f" {'-':>8}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
