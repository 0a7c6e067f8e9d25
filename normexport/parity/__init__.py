"""`normexport check`: parity of an ONNX model against its eager PyTorch reference, in
onnxruntime (CPU, CUDA) and TensorRT, measured against a float64 reference (DESIGN §5, §7).

How a result is judged (one row = one backend x one input shape x one output):

* The errors (`max_abs_err`, `max_rel_err` = max_abs_err / max|ref|, `mean_abs_err`) compare
  the backend's output with the **float64 reference**: a deep copy of the reference module in
  float64, run on the inputs upcast to float64. While it runs, every cast to a lower float
  dtype (`.float()`, `.to(torch.float32)`, `dtype=torch.float32` in factories) is kept in
  float64 and the normexport custom ops are computed with their float64 numpy reference
  (the torch ops compute their statistics in float32), so "statistics in float32" code does
  not hide float32 rounding in the reference. When the model cannot run in float64, the
  reference is eager's own output, `ref_err_fp64` is null and the reason is recorded.
* `ref_err_fp64` is eager's own max abs error (in the model's dtype) against that reference.
* `tolerance` (DESIGN §7) = rtol x max|ref| + atol with, unless `rtol` / `atol` are given:
  float32 rtol 1e-5, atol 1e-6; float16 rtol 2e-3; bfloat16 rtol 1.6e-2 (atol 0); float64
  rtol 1e-10, atol 1e-12. Integer and bool outputs must match exactly.
* `limit` = min(tolerance, max(2 x ref_err_fp64, floor)) (DESIGN §7: within tolerance *and* not
  more than 2x eager's own error in the same dtype). The floor keeps an eager that happens to be
  nearly exact from making the bound ~0 (two correct implementations may round differently):
    - float32 / float64: floor = 4 x eps(dtype) x max|ref| (eps = machine epsilon, 2**-23 for
      float32; 4 eps x max|ref| is 4 to 8 units in the last place at the largest output);
    - float16 / bfloat16: floor = 1 x eps(dtype) x max|ref| (1 to 2 ulp there). Their DESIGN
      tolerances (2e-3, 1.6e-2) are only ~2 eps x max|ref|, so a 4 eps floor would switch the
      2x rule off; eager's own error in these dtypes includes the rounding of its output to
      the dtype, so 2 x eager is rarely below this floor anyway.
  Without a float64 reference the 2x rule cannot be applied and limit = tolerance.
* The dtype: the reference module and the floating inputs are cast to `dtype` (`--dtype`); when
  it is not given, the ONNX model's first floating input decides (a float16 ONNX file is judged
  against eager float16), applied when the given inputs are of another float dtype. The float64
  reference is computed from the cast module and inputs, in float64.
* Shapes: the given shape, plus `extra_shapes` more along the dynamic axes. An extra shape the
  reference module rejects is skipped (listed with the reason); the summary line says how many
  shapes were checked and skipped, and why no extra shape was checked when there are none.
* A row passes when max_abs_err <= limit, the shapes match and non-finite values (nan, inf)
  sit at the same places with the same values as in the reference.
* A backend that cannot run here is listed under `skipped` with the reason, never as passed;
  the report passes when at least one backend ran, and every backend that ran passed every row
  and actually compared at least one row with elements (zero comparisons is a failure).

Modules (after Polygraphy's loaders / runners / comparators): `report` (Row, CheckReport, table,
JSON), `reference` (the float64 reference), `runners` (onnxruntime, TensorRT), `shapes` (extra
shapes along dynamic axes), `tolerances`, `verdict` (one row's errors and rule), `driver` (check()),
`cli` (the `check` command).
"""

from __future__ import annotations

from .cli import add_arguments, run
from .driver import check
from .report import CheckReport, Row
from .runners import BACKENDS
from .tolerances import DEFAULT_TOLERANCES, FLOOR_EPS, LIMIT_RULE, floor_for, limit_for, tolerance_for

__all__ = ["check", "CheckReport", "Row", "tolerance_for", "limit_for", "floor_for", "add_arguments", "run",
           "BACKENDS", "DEFAULT_TOLERANCES", "FLOOR_EPS", "LIMIT_RULE"]
