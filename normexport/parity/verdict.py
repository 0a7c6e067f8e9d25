"""The verdict of one row: errors of the backend's output against the float64 reference and the
limit they are judged by (package docstring)."""

from __future__ import annotations

import math

import numpy as np
import torch

from ._util import _as_float64
from .report import Row
from .tolerances import floor_for, limit_for, tolerance_for

def _compare(row: Row, got, ref64: np.ndarray, eager64: np.ndarray, dtype: torch.dtype,
             eager_err: float | None, rtol, atol) -> Row:
    got = _as_float64(got)
    if got.shape != ref64.shape:
        row.reason = f"shape {list(got.shape)} != reference shape {list(ref64.shape)}"
        return row
    finite = np.isfinite(ref64)
    max_ref = float(np.abs(ref64[finite]).max()) if finite.any() else 0.0
    row.max_abs_ref = max_ref
    row.ref_err_fp64 = eager_err
    row.tolerance = tolerance_for(dtype, max_ref, rtol, atol)
    row.limit = limit_for(dtype, row.tolerance, max_ref, eager_err)
    if got.size == 0:
        row.max_abs_err = row.max_rel_err = row.mean_abs_err = 0.0
        row.passed = True
        row.reason = "empty output: nothing to compare"
        return row
    row.elements = int(got.size)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(got - ref64)
    # matching non-finite values (same nan / same inf at the same place) are not errors
    same_nonfinite = ~finite & ((np.isnan(ref64) & np.isnan(got)) | (ref64 == got))
    diff = np.where(same_nonfinite, 0.0, diff)
    diff = np.where(np.isnan(diff), np.inf, diff)
    flat = int(np.argmax(diff))
    idx = np.unravel_index(flat, diff.shape)
    row.max_abs_err = float(diff.reshape(-1)[flat])
    row.mean_abs_err = float(diff.mean())
    if max_ref > 0:
        row.max_rel_err = row.max_abs_err / max_ref
    else:
        row.max_rel_err = 0.0 if row.max_abs_err == 0 else float("inf")
    row.worst_index = [int(i) for i in idx]
    row.worst_value = float(got[idx])
    row.worst_ref = float(ref64[idx])
    row.worst_eager = float(eager64[idx]) if eager64.shape == got.shape else None
    if not math.isfinite(row.max_abs_err):
        row.reason = (f"non-finite mismatch at index {tuple(row.worst_index)}: got {row.worst_value}, "
                      f"reference {row.worst_ref}")
        return row
    row.passed = row.max_abs_err <= row.limit
    if not row.passed:
        if row.max_abs_err > row.tolerance:
            why = f"max_abs_err {row.max_abs_err:.3g} > tolerance {row.tolerance:.3g}"
        else:
            why = (f"max_abs_err {row.max_abs_err:.3g} > limit {row.limit:.3g} = max(2 x eager's own error "
                   f"{eager_err:.3g}, floor {floor_for(dtype, max_ref):.3g}): more than 2 x eager's error "
                   f"though within tolerance {row.tolerance:.3g}")
        row.reason = (f"{why}; worst at index {tuple(row.worst_index)}: got {row.worst_value:.7g}, "
                      f"reference {row.worst_ref:.7g}, eager {row.worst_eager if row.worst_eager is None else format(row.worst_eager, '.7g')}")
    return row
