#!/usr/bin/env python3
"""Would fp32 sum / sum of squares per thread (one pass) be accurate enough for the LayerNorm
kernels? (issue 48, "LayerNorm statistics"). A float32 numpy model of the block kernel's order:
each thread holds 16 values (2 vectors of 8 half values), takes its moments either two-pass from its
registers (what the kernels do: mean, then squared deviations) or from its fp32 sum and sum of
squares (M2 = sumsq - sum^2 / n), then the threads' moments are merged pairwise with the equal-count
Chan merge in float32. Prints the relative error of rstd against float64, for rows with a large
common offset (|mean| >> std, as tests/test_kernels_emulated.py's fp32 LayerNorm case: mean 300,
std 1) and a small one.

    python tools/one_pass_stats.py
"""

from __future__ import annotations

import numpy as np

EPS = 1e-5


def thread_moments(x: np.ndarray, one_pass: bool) -> tuple[np.float32, np.ndarray, np.ndarray]:
    n = np.float32(x.shape[1])
    s = x.sum(axis=1, dtype=np.float32)
    mean = (s / n).astype(np.float32)
    if one_pass:
        m2 = ((x * x).sum(axis=1, dtype=np.float32) - s * s / n).astype(np.float32)
    else:
        d = (x - mean[:, None]).astype(np.float32)
        m2 = (d * d).sum(axis=1, dtype=np.float32)
    return n, mean, m2


def merge(n: np.float32, mean: np.ndarray, m2: np.ndarray) -> tuple[np.float32, np.float32]:
    """Butterfly of equal-count merges (mean = (a + b) / 2, M2 = M2a + M2b + d^2 n / 2), float32."""
    while len(mean) > 1:
        d = (mean[1::2] - mean[0::2]).astype(np.float32)
        mean = ((mean[0::2] + mean[1::2]) * np.float32(0.5)).astype(np.float32)
        m2 = (m2[0::2] + m2[1::2] + d * d * np.float32(0.5 * n)).astype(np.float32)
        n = np.float32(2 * n)
    return mean[0], m2[0]


def worst_rstd_error(hidden: int, offset: float, one_pass: bool, trials: int = 20, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    worst = 0.0
    for _ in range(trials):
        x = (rng.standard_normal(hidden) + offset).astype(np.float32)
        rstd_ref = 1 / np.sqrt(x.astype(np.float64).var() + EPS)
        n, m, m2 = thread_moments(x.reshape(-1, 16), one_pass)
        _, total = merge(n, m, m2)
        worst = max(worst, abs((1 / np.sqrt(np.float64(total) / hidden + EPS)) / rstd_ref - 1))
    return worst


def main() -> int:
    print("relative error of rstd against float64 (worst of 20 rows); the fp32 tests allow 1e-5")
    for hidden, offset in ((4096, 300.0), (8192, 300.0), (8192, 3.0), (2048, 0.0)):
        two = worst_rstd_error(hidden, offset, one_pass=False)
        one = worst_rstd_error(hidden, offset, one_pass=True)
        print(f"  H {hidden:5d}, mean {offset:5.0f}, std 1: two-pass per thread {two:.1e}, sum / sumsq per thread {one:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
