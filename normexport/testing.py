"""Test helpers for users of normexport: `assert_parity(module, onnx_model, inputs)`."""

from __future__ import annotations

from .parity import CheckReport, check


def assert_parity(module, onnx_path_or_model, inputs, *, rtol=None, atol=None, backends=("ort",),
                  dynamic_axes=None, extra_shapes: int = 2, dtype=None, plain_export=True) -> CheckReport:
    """Check `onnx_path_or_model` against `module` (see normexport.parity.check for the rules)
    and raise AssertionError with a readable diff when any backend that ran fails, or when no
    backend could run. Returns the report when parity holds.

    `plain_export` is the second rule of the verdict (docs/design.md §7): True (default) builds the plain
    torch.onnx export of `module` (no BN folding, norm swaps or rewrites; the file's input names,
    dynamic axes and opset) when a row fails the 2x-eager rule, as `convert` and `check` do; a
    function returning that onnx.ModelProto; or None to judge by 2x eager alone."""
    report = check(onnx_path_or_model, module, inputs, backends=backends, dynamic_axes=dynamic_axes,
                   extra_shapes=extra_shapes, rtol=rtol, atol=atol, dtype=dtype, command="assert_parity",
                   plain_export=plain_export)
    if report.passed:
        return report
    raise AssertionError(format_failure(report))


def format_failure(report: CheckReport) -> str:
    lines = [f"ONNX parity failed: {report.onnx_model} vs {report.reference}"]
    if not report.ran:
        lines.append("no backend could run: " + "; ".join(f"{b}: {why}" for b, why in report.skipped.items()))
    for b, err in report.backend_errors.items():
        lines.append(f"  [{b}] {err}")
    for b in report.ran:
        if b not in report.backend_errors and not report.compared(b):
            lines.append(f"  [{b}] nothing was compared (every output was empty): give inputs with elements")
    for r in report.failures:
        shape = ", ".join(f"{k}={'x'.join(map(str, v)) or 'scalar'}" for k, v in r.input_shapes.items())
        head = f"  [{r.backend}] output '{r.output}' ({r.dtype}), input shape #{r.shape_index} ({shape}):"
        if r.max_abs_err is None:
            lines.append(f"{head} {r.reason}")
            continue
        eager_err = "n/a" if r.ref_err_fp64 is None else format(r.ref_err_fp64, ".3e")
        plain_err = "not built" if r.plain_err is None else format(r.plain_err, ".3e")
        lines.append(f"{head} max_abs_err {r.max_abs_err:.3e} > limit {r.limit:.3e} (rule '{r.rule}'; "
                     f"eager's own error vs fp64 {eager_err}, the plain export's {plain_err}, "
                     f"tolerance {r.tolerance:.3e}, max|ref| {r.max_abs_ref:.4g}, max_rel_err {r.max_rel_err:.3e}, "
                     f"mean_abs_err {r.mean_abs_err:.3e})")
        if r.reason:
            lines.append(f"      {r.reason}")
    n = len(report.failures)
    lines.append(f"{n} of {len(report.rows)} comparisons failed; {report.shapes_summary()}; skipped backends: "
                 + (", ".join(f"{b} ({why})" for b, why in report.skipped.items()) or "none"))
    return "\n".join(lines)


__all__ = ["assert_parity", "format_failure"]
