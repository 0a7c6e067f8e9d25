"""tools/bench_kernels.py's goal verdicts (issue 30), on made-up timings: the share of copy
bandwidth (92 %, 85 % for rows of <= 128) and no slower than torch.compile, only for shapes with at
least 16 MiB of activations. The benchmark itself needs a GPU (tools/gpu_check.sh)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "tools" / "bench_kernels.py"
_spec = importlib.util.spec_from_file_location("bench_kernels", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _row(impl, hidden, ms, pct, tokens=16384, op="RMSNorm", esize=2):
    return {"op": op, "impl": impl, "dtype": "bfloat16", "tokens": tokens, "hidden": hidden, "ms": ms,
            "pct_of_copy": pct, "x_bytes": tokens * hidden * esize}


@pytest.mark.parametrize("hidden, pct, ours_ms, compile_ms, passed", [
    (4096, 93.0, 1.00, 1.10, True),    # over 92 %, faster than torch.compile
    (4096, 91.0, 1.00, 1.10, False),   # under 92 %
    (4096, 95.0, 1.00, 0.90, False),   # slower than torch.compile
    (128, 86.0, 1.00, 1.00, True),     # rows of 128: 85 % is the goal
    (128, 84.0, 1.00, 1.20, False),
])
def test_verdicts(hidden, pct, ours_ms, compile_ms, passed):
    tokens = (64 << 20) // (hidden * 2)  # 64 MiB of bf16 activations
    rows = [_row("normexport", hidden, ours_ms, pct, tokens), _row("torch.compile", hidden, compile_ms, 50.0, tokens),
            _row("torch eager", hidden, 3.0, 30.0, tokens)]
    (v,) = bench.goals(rows)
    assert v["passed"] is passed, v
    assert v["pct_goal"] == (85.0 if hidden <= 128 else 92.0)
    assert v["speedup_vs_compile"] == pytest.approx(compile_ms / ours_ms)


def test_small_shapes_have_no_goal():
    rows = [_row("normexport", 1024, 0.01, 40.0, tokens=1024), _row("torch.compile", 1024, 0.005, 40.0, tokens=1024)]
    assert bench.goals(rows) == []  # 2 MiB of activations: launch-bound, no bandwidth goal


def test_qk_shapes_are_millions_of_short_rows():
    for spec in bench.QK_SHAPES:
        rows, head = map(int, spec.split("x"))
        assert head in (64, 128) and rows >= 250_000 and rows * head * 2 >= bench.GOAL_MIN_BYTES


def test_a_missing_torch_compile_time_is_not_a_pass():
    tokens = (64 << 20) // (4096 * 2)
    (v,) = bench.goals([_row("normexport", 4096, 1.0, 99.0, tokens)])
    assert not v["passed"] and not v["compile_measured"]


def _decode(impl, ms, rows=1, hidden=4096, op="RMSNorm"):
    return {"mode": "decode", "op": op, "impl": impl, "dtype": "bfloat16", "tokens": rows, "hidden": hidden,
            "ms": ms, "pct_of_copy": None, "x_bytes": rows * hidden * 2}


@pytest.mark.parametrize("ours_us, compile_us, passed", [(3.0, 3.2, True), (3.0, 3.0, True), (3.3, 3.2, False)])
def test_decode_verdicts_are_latency_against_torch_compile(ours_us, compile_us, passed):
    rows = [_decode("normexport", ours_us / 1e3), _decode("torch.compile", compile_us / 1e3),
            # a bulk result of another shape must not be taken as this shape's torch.compile time
            _row("torch.compile", 4096, 100.0, 50.0, tokens=1)]
    (v,) = bench.goals(rows)
    assert v["mode"] == "decode" and v["passed"] is passed
    assert v["us"] == pytest.approx(ours_us) and v["compile_us"] == pytest.approx(compile_us)


def test_default_run_is_issue_48s_shape_set():
    """Every op x dtype x the eight widths users run, at >= 16 MiB of activations; the per-head rows; and
    decode at 1..64 rows for every op, dtype and width."""
    steps = bench.plan(bench.parse_args([]))
    bulk = {(op, s["dtype"], s["tokens"], s["hidden"]) for s in steps if s["mode"] == "bulk" for op in s["ops"]}
    widths = {1152, 1536, 2048, 2432, 3072, 4096, 5120, 8192}
    dtypes = {"bfloat16", "float16", "float32"}
    wide = {(op, d, h) for op, d, t, h in bulk if h > 128}
    assert wide == {(op, d, h) for op in bench.OPS for d in dtypes for h in widths}
    assert all(t * h * 2 >= bench.GOAL_MIN_BYTES for _, _, t, h in bulk)
    assert {(t, h) for _, _, t, h in bulk if h <= 128} == {(393216, 128), (262144, 128), (786432, 64)}
    decode = {(op, s["dtype"], s["hidden"], n) for s in steps if s["mode"] == "decode" for op in s["ops"]
              for n in s["rows"]}
    assert decode == {(op, d, h, n) for op in bench.OPS for d in dtypes for h in widths
                      for n in (1, 2, 4, 8, 16, 32, 64)}
    assert all(s["compiles"] > 0 for s in steps)  # torch.compile is part of the default run


# -- tools/kernel_table.py: the docs' tables are made from the committed results

_TABLE = Path(__file__).resolve().parents[1] / "tools" / "kernel_table.py"
_spec_t = importlib.util.spec_from_file_location("kernel_table", _TABLE)
table = importlib.util.module_from_spec(_spec_t)
_spec_t.loader.exec_module(table)


def test_table_marks_misses_and_does_not_round_them_away():
    tokens = (64 << 20) // (4096 * 2)
    rows = [_row("normexport", 4096, 1.0, 93.0, tokens), _row("torch.compile", 4096, 0.996, 50.0, tokens),
            _row("normexport", 8192, 1.0, 95.0, tokens // 2), _row("torch.compile", 8192, 1.2, 50.0, tokens // 2),
            _decode("normexport", 0.003, hidden=1152), _decode("torch.compile", 0.0031, hidden=1152),
            _decode("normexport", 0.004, hidden=8192), _decode("torch.compile", 0.0035, hidden=8192)]
    text = table.render({"meta": {"device": "GPU"}, "results": rows})
    assert "**93 % · 0.996x**" in text  # 0.996 would print as 1.00 at two decimals
    assert "| 95 % · 1.20x |" in text
    assert "**0.88x (H 8192)**" in text  # decode: the worst width of the row count
    assert "2 of 4 shapes meet the goals" in text


def test_docs_tables_are_the_committed_results():
    repo = Path(__file__).resolve().parents[1]
    for md in (repo / "docs" / "kernels.md", repo / "README.md"):
        text = md.read_text()
        assert table.regenerate(text) == text, f"{md.name}: run python tools/kernel_table.py --write {md}"
    assert table.BEGIN.search((repo / "docs" / "kernels.md").read_text())
