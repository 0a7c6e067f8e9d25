#!/usr/bin/env python3
"""Markdown tables of one tools/bench_kernels.py run (its JSON), for docs/kernels.md and the README.

    python tools/kernel_table.py RESULTS.json                 # print the tables
    python tools/kernel_table.py --write docs/kernels.md      # regenerate every generated block

A generated block in a markdown file sits between
    <!-- kernel-table: benchmarks/results/.../X.json -->
    <!-- /kernel-table -->
and is replaced by the tables of that JSON (path relative to the repository root); the rest of
the file is left as it is. tests/test_bench_goals.py checks that every block is what this script
makes of its JSON, so the docs' numbers are the committed results'.

Tables (goals of tools/bench_kernels.py, recomputed from the results):
- bulk: one row per op x dtype x rows, one column per hidden size; a cell is the share of copy
  bandwidth and torch.compile's time over ours (> 1: faster), in bold where a goal is missed;
- per-head rows (hidden <= 128): the same as a list;
- decode: one row per op x dtype, one column per row count; a cell is the lowest speedup over
  torch.compile among the widths (latency, back-to-back launches), in bold below 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("bench_kernels.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

SHORT = bench.SHORT_DTYPE
OPS = bench.OPS
BEGIN = re.compile(r"<!-- kernel-table: (\S+) -->\n")
END = "<!-- /kernel-table -->"


def _order(values, ref):
    return sorted(values, key=lambda v: (ref.index(v) if v in ref else len(ref), v))


def _num(value: float, goal: float, digits: int) -> str:
    """`value` to `digits` decimals, one more where the rounding would hide which side of `goal` it is
    on (0.996 is not shown as 1.00)."""
    text = f"{value:.{digits}f}"
    while (float(text) >= goal) != (value >= goal) and digits < 4:
        digits += 1
        text = f"{value:.{digits}f}"
    return text


def _speedup(v: dict) -> str:
    return f"{_num(v['speedup_vs_compile'], 1.0, 2)}x" if v["compile_measured"] else "-"


def _bulk_cell(v: dict) -> str:
    pct = f"{_num(v['pct_of_copy'], v['pct_goal'], 0)} %" if v["pct_of_copy"] is not None else "-"
    vs = _speedup(v)
    cell = f"{pct} · {vs}"
    return cell if v["passed"] else f"**{cell}**"


def render(data: dict) -> str:
    """The markdown tables of one run."""
    meta = data.get("meta", {})
    verdicts = bench.goals(data["results"])
    dtypes = _order({v["dtype"] for v in verdicts}, list(SHORT))
    lines = [f"{meta.get('device', '?')}, torch {meta.get('torch', '?')}, CUDA {meta.get('cuda', '?')}; "
             f"{sum(v['passed'] for v in verdicts)} of {len(verdicts)} shapes meet the goals."]
    bulk = [v for v in verdicts if v["mode"] == "bulk" and v["hidden"] > 128]
    if bulk:
        widths = sorted({v["hidden"] for v in bulk})
        cells = {(v["op"], v["dtype"], v["tokens"], v["hidden"]): v for v in bulk}
        passed = sum(v["passed"] for v in bulk)
        lines += ["", f"Bulk ({passed} of {len(bulk)} meet both goals; cell: % of copy · torch.compile's time over "
                      "ours, bold: a goal missed):", "",
                  "| op | dtype | rows | " + " | ".join(f"H {h}" for h in widths) + " |",
                  "|---|---|---|" + "---|" * len(widths)]
        for op in _order({v["op"] for v in bulk}, list(OPS)):
            for dtype in dtypes:
                for tokens in sorted({v["tokens"] for v in bulk if (v["op"], v["dtype"]) == (op, dtype)}):
                    row = [_bulk_cell(cells[k]) if (k := (op, dtype, tokens, h)) in cells else "" for h in widths]
                    lines.append(f"| {op} | {SHORT[dtype]} | {tokens} | " + " | ".join(row) + " |")
    heads = [v for v in verdicts if v["mode"] == "bulk" and v["hidden"] <= 128]
    if heads:
        lines += ["", f"Per-head rows ({sum(v['passed'] for v in heads)} of {len(heads)}; goal "
                      f"{bench.GOAL_PCT_SHORT_ROWS:.0f} % of copy):", "",
                  "| op | dtype | rows x head_dim | % of copy · x compile |", "|---|---|---|---|"]
        for v in sorted(heads, key=lambda v: (OPS.index(v["op"]), dtypes.index(v["dtype"]), -v["hidden"],
                                              -v["tokens"])):
            lines.append(f"| {v['op']} | {SHORT[v['dtype']]} | {v['tokens']} x {v['hidden']} | {_bulk_cell(v)} |")
    decode = [v for v in verdicts if v["mode"] == "decode"]
    if decode:
        counts = sorted({v["tokens"] for v in decode})
        widths = sorted({v["hidden"] for v in decode})
        lines += ["", f"Decode ({sum(v['passed'] for v in decode)} of {len(decode)} at or below torch.compile's "
                      f"latency; widths {', '.join(map(str, widths))}; cell: the lowest torch.compile time over ours "
                      "among the widths, and its width; bold: below 1):", "",
                  "| op | dtype | " + " | ".join(f"{n} row{'s' if n > 1 else ''}" for n in counts) + " |",
                  "|---|---|" + "---|" * len(counts)]
        for op in _order({v["op"] for v in decode}, list(OPS)):
            for dtype in dtypes:
                row = []
                for n in counts:
                    group = [v for v in decode if (v["op"], v["dtype"], v["tokens"]) == (op, dtype, n)]
                    if not group:
                        row.append("")
                        continue
                    measured = [v for v in group if v["compile_measured"]]
                    if len(measured) < len(group):
                        row.append(f"**{len(group) - len(measured)} not measured**")
                        continue
                    worst = min(measured, key=lambda v: v["speedup_vs_compile"])
                    cell = f"{_speedup(worst)} (H {worst['hidden']})"
                    row.append(cell if worst["passed"] else f"**{cell}**")
                if any(row):
                    lines.append(f"| {op} | {SHORT[dtype]} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def regenerate(text: str, root: Path = REPO) -> str:
    """`text` with every generated block replaced by the tables of its JSON."""
    out, pos = [], 0
    for m in BEGIN.finditer(text):
        if m.start() < pos:
            continue
        end = text.find(END, m.end())
        if end < 0:
            raise ValueError(f"'{m.group(0).strip()}' has no '{END}' after it")
        data = json.loads((root / m.group(1)).read_text())
        out += [text[pos:m.end()], render(data)]
        pos = end
    return "".join(out) + text[pos:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", help="a tools/bench_kernels.py JSON: print its tables")
    ap.add_argument("--write", metavar="MARKDOWN", action="append", default=[],
                    help="regenerate the generated blocks of this file (repeatable)")
    args = ap.parse_args(argv)
    if not args.results and not args.write:
        ap.error("give a results JSON or --write FILE")
    try:
        if args.results:
            print(render(json.loads(Path(args.results).read_text())), end="")
        for md in map(Path, args.write):
            text = md.read_text()
            new = regenerate(text)
            if new != text:
                md.write_text(new)
            print(f"{md}: {len(BEGIN.findall(text))} generated block(s), {'rewritten' if new != text else 'unchanged'}")
    except (OSError, ValueError, KeyError) as exc:
        print(f"kernel_table: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
