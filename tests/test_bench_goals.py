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
