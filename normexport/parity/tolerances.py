"""docs/design.md §7 tolerances, the floor of the 2x-eager rule, and the limit (see the package docstring)."""

from __future__ import annotations

import torch

#: (rtol, atol) per dtype, docs/design.md §7
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-6),
    torch.float16: (2e-3, 0.0),
    torch.bfloat16: (1.6e-2, 0.0),
    torch.float64: (1e-10, 1e-12),
}

#: the floor of the 2x-eager limit, in eps(dtype) x max|ref| (module docstring)
FLOOR_EPS: dict[torch.dtype, float] = {
    torch.float32: 4.0, torch.float64: 4.0, torch.float16: 1.0, torch.bfloat16: 1.0,
}
#: the 2x-eager rule: err(file) <= max(EAGER_FACTOR x err(eager), floor)
EAGER_FACTOR = 2.0
#: the plain-export rule: err(file) <= PLAIN_FACTOR x err(plain export) + floor
PLAIN_FACTOR = 1.25
LIMIT_RULE = ("pass when max_abs_err <= max(2 x ref_err_fp64, floor) (rule '2x eager'), or else when "
              "max_abs_err <= 1.25 x plain_err + floor (rule 'plain export': the runtime on the plain torch.onnx "
              "export of the same model); floor = 4 x eps x max|ref| (float32, float64), 1 x eps x max|ref| "
              "(float16, bfloat16); without a float64 reference: max_abs_err <= tolerance (rule 'tolerance'); "
              "otherwise the tolerance only warns")

def tolerance_for(dtype: torch.dtype, max_abs_ref: float, rtol: float | None = None, atol: float | None = None) -> float:
    """docs/design.md §7 tolerance for an output of `dtype` whose largest |reference| is `max_abs_ref`."""
    if not dtype.is_floating_point:
        return 0.0
    r, a = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.float32])
    r = r if rtol is None else rtol
    a = a if atol is None else atol
    return r * max_abs_ref + a


def floor_for(dtype: torch.dtype, max_abs_ref: float) -> float:
    """The least limit the 2x-eager rule gives: FLOOR_EPS[dtype] x eps(dtype) x max|ref|."""
    if not dtype.is_floating_point:
        return 0.0
    return FLOOR_EPS.get(dtype, 4.0) * torch.finfo(dtype).eps * max_abs_ref


def limit_for(dtype: torch.dtype, tolerance: float, max_abs_ref: float, eager_err: float | None) -> float:
    """The limit of the first rule (docs/design.md §7): max(2 x eager's own error, floor); the tolerance
    when there is no float64 reference (eager_err None) or the output is not floating."""
    if eager_err is None or not dtype.is_floating_point:
        return tolerance
    return eager_limit_for(dtype, max_abs_ref, eager_err)


def eager_limit_for(dtype: torch.dtype, max_abs_ref: float, eager_err: float) -> float:
    """The limit of the 2x-eager rule: max(EAGER_FACTOR x eager's own error, floor)."""
    return max(EAGER_FACTOR * eager_err, floor_for(dtype, max_abs_ref))


def plain_limit_for(dtype: torch.dtype, max_abs_ref: float, plain_err: float) -> float:
    """The limit of the plain-export rule: PLAIN_FACTOR x the plain export's error + floor."""
    return PLAIN_FACTOR * plain_err + floor_for(dtype, max_abs_ref)
