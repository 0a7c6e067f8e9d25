"""Numeric verification of a rewrite: run two models in onnxruntime (CPU) on the same random
inputs and compare every graph output within docs/design.md §7 tolerances (dtypes and tolerances:
normexport.dtypes; sessions: normexport.ortrun)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from normexport.dtypes import BF16, BF16_TOL, np_dtype  # noqa: F401  (re-exported: callers read them here)
from normexport.dtypes import TOL as _TOL
from normexport.ortrun import run, run_session, session  # noqa: F401  (re-exported)


@dataclasses.dataclass
class Comparison:
    output: str
    max_abs_err: float
    max_rel_err: float
    mean_abs_err: float
    tolerance: float
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ref_err_fp64"] = None  # the reference is the original graph, not an fp64 formula
        return d


def compare(ref: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> list[Comparison]:
    out = []
    for name, r in ref.items():
        if name not in got:
            out.append(Comparison(name, float("inf"), float("inf"), float("inf"), 0.0, False))
            continue
        g = got[name]
        if g.shape != r.shape or g.dtype != r.dtype:
            out.append(Comparison(name, float("inf"), float("inf"), float("inf"), 0.0, False))
            continue
        if r.dtype.kind not in "fc" and r.dtype != BF16:
            ok = bool(np.array_equal(r, g))
            e = 0.0 if ok else float("inf")
            out.append(Comparison(name, e, e, e, 0.0, ok))
            continue
        rel, ab = _TOL.get(r.dtype, BF16_TOL)
        r64, g64 = r.astype(np.float64), g.astype(np.float64)
        if r64.size == 0:
            out.append(Comparison(name, 0.0, 0.0, 0.0, 0.0, True))
            continue
        err = np.abs(r64 - g64)
        finite = np.isfinite(r64)
        same_nonfinite = bool(np.array_equal(r64[~finite], g64[~finite], equal_nan=True))
        errf = err[finite] if finite.any() else np.zeros(1)
        scale = float(np.max(np.abs(r64[finite]))) if finite.any() else 0.0
        tol = rel * scale + ab
        max_abs = float(errf.max())
        max_rel = float((errf / np.maximum(np.abs(r64[finite]), 1e-12)).max()) if finite.any() else 0.0
        out.append(Comparison(name, max_abs, max_rel, float(errf.mean()), tol,
                              bool(max_abs <= tol and same_nonfinite)))
    return out


def describe_failure(comps: list[Comparison]) -> str:
    bad = [c for c in comps if not c.passed]
    return "; ".join(f"output {c.output!r}: max abs err {c.max_abs_err:.3g} > tol {c.tolerance:.3g}" for c in bad)
