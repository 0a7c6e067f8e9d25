"""`normexport check`: parity of an ONNX model against its eager PyTorch reference, in
onnxruntime (CPU, CUDA) and TensorRT, measured against a float64 reference (docs/design.md §5, §7).

How a result is judged (one row = one backend x one input shape x one output):

* The errors (`max_abs_err`, `max_rel_err` = max_abs_err / max|ref|, `mean_abs_err`) compare
  the backend's output with the **float64 reference**: a deep copy of the reference module in
  float64, run on the inputs upcast to float64. While it runs, every cast to a lower float
  dtype (`.float()`, `.to(torch.float32)`, `dtype=torch.float32` in factories) is kept in
  float64 and the normexport custom ops are computed with their float64 numpy reference
  (the torch ops compute their statistics in float32), so "statistics in float32" code does
  not hide float32 rounding in the reference. When the model cannot run in float64, the
  reference is eager's own output, `ref_err_fp64` is null and the reason is recorded.
* `eager_err` / `ref_err_fp64` is eager's own max abs error (in the model's dtype) against that
  reference, `file_err` / `max_abs_err` the backend's on this file, and `plain_err` the backend's
  on the plain torch.onnx export of the same model (no BN folding, swaps or rewrites; built on
  demand, only when the first rule fails: `plain.py`).
* The verdict (docs/design.md §7, `verdict.py`): a row passes by rule "2x eager" when
  max_abs_err <= max(2 x ref_err_fp64, floor), else by rule "plain export" when
  max_abs_err <= 1.25 x plain_err + floor (normexport answers for the error it adds, not for the
  runtime's kernels). The floor keeps a nearly exact eager from making the bound ~0:
  4 x eps(dtype) x max|ref| in float32 / float64, 1 x eps(dtype) x max|ref| in float16 / bfloat16.
* `tolerance` = rtol x max|ref| + atol with, unless `rtol` / `atol` are given: float32 rtol 1e-5,
  atol 1e-6; float16 rtol 2e-3; bfloat16 rtol 1.6e-2 (atol 0); float64 rtol 1e-10, atol 1e-12. It
  is the limit (rule "tolerance") only without a float64 reference; otherwise it warns (eager
  itself beyond it: "numerically fragile in float16"). Integer and bool outputs must match exactly.
* The dtype: the reference module and the floating inputs are cast to `dtype` (`--dtype`); when
  it is not given, the ONNX model's first floating input decides (a float16 ONNX file is judged
  against eager float16), applied when the given inputs are of another float dtype. The float64
  reference is computed from the cast module and inputs, in float64.
* Inputs (`check` command, `choose.py`): `--input`, else the reference's example inputs, else
  sizes the ONNX file runs at (normexport.sizes); the `verified at` line says which.
* Shapes: the given shape, plus `extra_shapes` more along the dynamic axes (size + 1, 2 x size, ...;
  the spatial axes of image inputs step by their power-of-two alignment). An extra shape the
  reference module rejects is skipped (listed with the reason); the summary line says how many
  shapes were checked and skipped, and why no extra shape was checked when there are none.
* A row passes when its rule passes, the shapes match and non-finite values (nan, inf) sit at
  the same places with the same values as in the reference.
* A backend that cannot run here is listed under `skipped` with the reason, never as passed;
  the report passes when at least one backend ran, and every backend that ran passed every row
  and actually compared at least one row with elements (zero comparisons is a failure).

Modules (after Polygraphy's loaders / runners / comparators): `report` (Row, CheckReport, table,
JSON), `reference` (the float64 reference), `runners` (one Runner interface, activate / infer /
deactivate: eager, float64, onnxruntime, TensorRT; `RUNNERS`, the `--backend` table), `shapes` (extra
shapes along dynamic axes), `tolerances`, `verdict` (one row's errors and rule), `plain` (the plain
export), `driver` (check()), `choose` (the inputs `check` runs at), `cli` (the `check` command).
"""

from __future__ import annotations

from .cli import add_arguments, run
from .driver import check
from .report import CheckReport, Row
from .runners import BACKENDS
from .tolerances import DEFAULT_TOLERANCES, FLOOR_EPS, LIMIT_RULE, floor_for, limit_for, tolerance_for

__all__ = ["check", "CheckReport", "Row", "tolerance_for", "limit_for", "floor_for", "add_arguments", "run",
           "BACKENDS", "DEFAULT_TOLERANCES", "FLOOR_EPS", "LIMIT_RULE"]
