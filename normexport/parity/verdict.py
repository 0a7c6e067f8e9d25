"""The verdict of one row (docs/design.md §7): the errors of the backend's output against the float64
reference, and the rule that judges them.

Whole models: normexport answers for the error it adds, not for the runtime's own kernels nor for
the model's fragility in a dtype. Per output, three errors against the float64 reference: eager in
the same dtype (`ref_err_fp64`), the runtime on the plain torch.onnx export of the same model
(`plain_err`, computed only when the first rule fails) and the runtime on normexport's file
(`max_abs_err`):

1. "2x eager":     max_abs_err <= max(2 x ref_err_fp64, floor)
2. "plain export": max_abs_err <= 1.25 x plain_err + floor
3. "tolerance":    max_abs_err <= tolerance, only where no float64 reference could be computed.

With a float64 reference the tolerance only warns: "numerically fragile in <dtype>" when eager
itself exceeds it, or that the file exceeds it (within one of the rules above).

Elements where the float64 reference is non-finite and eager finite have no float64 reference (a
float64 run can overflow where the dtype's does not): they are judged against eager by the
tolerance (rule 3 on those elements: |file - eager| <= tolerance), the others by rules 1-2, and both
must pass; the reason or the warning says how many there were and what decided.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from ._util import _as_float64, _dtype_name
from .report import Row
from .tolerances import PLAIN_FACTOR, floor_for, limit_for, plain_limit_for, tolerance_for

RULE_EAGER = "2x eager"
RULE_PLAIN = "plain export"
RULE_TOLERANCE = "tolerance"

#: () -> (the plain export's max abs error on this output, None) or (None, why it is not there)
PlainError = Callable[[], "tuple[float | None, str | None]"]


def abs_diff(got: np.ndarray, ref64: np.ndarray) -> np.ndarray:
    """|got - ref64|; matching non-finite values (same nan / same inf at the same place) count 0,
    any other non-finite difference counts inf."""
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(got - ref64)
    same_nonfinite = ~np.isfinite(ref64) & ((np.isnan(ref64) & np.isnan(got)) | (ref64 == got))
    diff = np.where(same_nonfinite, 0.0, diff)
    return np.where(np.isnan(diff), np.inf, diff)


def max_abs_error(got, ref64: np.ndarray) -> float | None:
    """The largest abs_diff, 0 for empty outputs, None when the shapes differ."""
    got = _as_float64(got)
    if got.shape != ref64.shape:
        return None
    return float(abs_diff(got, ref64).max()) if got.size else 0.0


def _compare(row: Row, got, ref64: np.ndarray, eager64: np.ndarray, dtype: torch.dtype,
             eager_err: float | None, rtol, atol, plain: PlainError | None = None) -> Row:
    """Fill `row` with the errors of `got` and the verdict. `plain` is asked for the plain
    export's error only when the 2x-eager rule fails."""
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
    if eager_err is not None and dtype.is_floating_point:
        row.floor = floor_for(dtype, max_ref)
    if got.size == 0:
        row.max_abs_err = row.max_rel_err = row.mean_abs_err = 0.0
        row.passed = True
        row.reason = "empty output: nothing to compare"
        return row
    row.elements = int(got.size)
    orphan = (~np.isfinite(ref64) & np.isfinite(eager64)) if eager64.shape == got.shape else None
    if orphan is not None and orphan.any():  # no float64 reference there (module docstring)
        vs_eager = float(abs_diff(got[orphan], eager64[orphan]).max())
        tol = tolerance_for(dtype, max(max_ref, float(np.abs(eager64[orphan]).max())), rtol, atol)
        n = int(np.count_nonzero(orphan))
        orphan_note = (f"the float64 reference is non-finite at {n} element(s) where eager is finite: judged there "
                       f"against eager, |file - eager| {vs_eager:.3g} {'<=' if vs_eager <= tol else '>'} tolerance "
                       f"{tol:.3g} (rule '{RULE_TOLERANCE}')")
        got, ref64 = np.where(orphan, 0.0, got), np.where(orphan, 0.0, ref64)  # rules 1-2 on the others
    else:
        orphan = None
    diff = abs_diff(got, ref64)
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
        eager = "" if row.worst_eager is None else f", eager {row.worst_eager}"
        row.reason = (f"non-finite mismatch at index {tuple(row.worst_index)}: got {row.worst_value}, "
                      f"reference {row.worst_ref}{eager}")
        return row
    _judge(row, dtype, eager_err, plain)
    if orphan is not None:  # both must pass: rules 1-2 on the others, the tolerance against eager here
        if orphan.all():
            row.rule = RULE_TOLERANCE
        if vs_eager > tol:
            row.reason = orphan_note if row.passed else f"{row.reason}; and {orphan_note}"
            row.passed = False
        else:
            row.warning = orphan_note if row.warning is None else f"{row.warning}; {orphan_note}"
    if eager64.shape == got.shape:
        # eager's own error (the driver's ref_err_fp64) is taken where eager is finite; say where it is not
        bad = int(np.count_nonzero(~np.isfinite(abs_diff(eager64, ref64))))
        if bad:
            note = (f"eager itself is non-finite at {bad} element(s) where the float64 reference is not "
                    f"(eager's error is taken over the others)")
            row.warning = note if row.warning is None else f"{row.warning}; {note}"
    return row


def _judge(row: Row, dtype: torch.dtype, eager_err: float | None, plain: PlainError | None) -> None:
    err, tol = row.max_abs_err, row.tolerance
    if eager_err is None or not dtype.is_floating_point:  # no float64 reference (or exact outputs)
        row.rule, row.passed = RULE_TOLERANCE, err <= tol
        if not row.passed:
            why = ("integer / bool output differs" if not dtype.is_floating_point
                   else f"max_abs_err {err:.3g} > tolerance {tol:.3g} (no float64 reference: the tolerance is the limit)")
            row.reason = f"{why}; {_worst(row)}"
        return
    if eager_err > tol:
        row.warning = (f"eager itself is {eager_err:.3g} from the float64 reference, above the tolerance {tol:.3g}: "
                       f"the model is numerically fragile in {_dtype_name(dtype)}")
    eager_limit = row.limit
    row.rule, row.passed = RULE_EAGER, err <= eager_limit
    if not row.passed and plain is not None:
        row.plain_err, row.plain_reason = plain()
        if row.plain_err is not None and not math.isfinite(row.plain_err):  # NaN / inf in the plain export
            row.plain_reason = (f"the plain export's error is {row.plain_err} (non-finite where the float64 reference "
                                "is not): it excuses nothing")
            row.plain_err = None
        if row.plain_err is not None:
            row.rule = RULE_PLAIN
            row.limit = plain_limit_for(dtype, row.max_abs_ref, row.plain_err)
            row.passed = err <= row.limit
    if row.passed and err > tol and row.warning is None:
        row.warning = (f"max_abs_err {err:.3g} is above the tolerance {tol:.3g}; accepted by rule '{row.rule}' "
                       f"(eager's own error {eager_err:.3g}"
                       + (f", the plain export's {row.plain_err:.3g})" if row.plain_err is not None else ")"))
    if row.passed:
        return
    why = (f"max_abs_err {err:.3g} > max(2 x eager's own error {eager_err:.3g}, floor {row.floor:.3g}) = "
           f"{eager_limit:.3g}")
    if row.plain_err is not None:
        why += (f", and > {PLAIN_FACTOR} x the plain export's error {row.plain_err:.3g} + floor = {row.limit:.3g}: "
                "normexport's file adds error")
    else:
        why += f" (no plain export to compare with: {row.plain_reason or 'not asked for'})"
    row.reason = f"{why}; {_worst(row)}"


def _worst(row: Row) -> str:
    eager = "n/a" if row.worst_eager is None else format(row.worst_eager, ".7g")
    return (f"worst at index {tuple(row.worst_index)}: got {row.worst_value:.7g}, "
            f"reference {row.worst_ref:.7g}, eager {eager}")
