"""rewrite_file: an ONNX file in (its external data memory-mapped, never loaded whole), the
rewritten file out, written atomically with the weights streamed into external data (docs/design.md §8)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import onnx_ir as ir

from normexport import io as _io
from normexport import ops as _ops
from normexport import sizes as _sizes

from .driver import interface, rewrite_ir
from .report import RewriteReport


def _has_external_data(model: ir.Model) -> bool:
    return any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())


def rewrite_file(in_path: str | os.PathLike, out_path: str | os.PathLike, target: str = "trt",
                 verify: bool = True, report_path: str | os.PathLike | None = None,
                 inputs: list[str] | dict[str, list[int]] | None = None,
                 off: dict[str, str] | None = None) -> RewriteReport:
    """Load `in_path` (external data memory-mapped), rewrite, write `out_path` atomically (weights
    in `<out>.data` beside it when the input had external data or they exceed 1 GiB). `inputs`:
    the sizes to verify at, as `--input NAME:DIMS[:DTYPE]` texts or {name: dims}; `off`: rule
    modules turned off by the command line (switches.from_flags).

    When fusions matched but none could be verified (`report.nothing_verifiable`), nothing is
    written: the caller says so and exits 1."""
    in_path, out_path = os.fspath(in_path), os.fspath(out_path)
    _io.check_writable(out_path)
    if report_path is not None:
        _io.check_writable(report_path, "--report")
    model = _io.load_ir(in_path)
    external = _has_external_data(model)
    if inputs is not None and not isinstance(inputs, dict):
        inputs = _sizes.parse_inputs(interface(model), list(inputs))
    report = RewriteReport()
    model = rewrite_ir(model, target=target, verify=verify, report=report, inputs=inputs, off=off)
    if report_path is not None:
        _io.write_json(report.to_dict(), report_path, "--report")
    if report.nothing_verifiable:
        return report
    if not report.applied and not external and not any(n.domain == _ops.DOMAIN for n in model.graph):
        # nothing fused (and no plugin attributes to add): the input file as it is, byte for byte,
        # not its canonical forms nor the shapes inference annotated (docs/design.md §11)
        _io.write_atomic(Path(out_path), lambda tmp: shutil.copyfile(in_path, tmp), "-o")
        return report
    # the checker on the written file before it takes its place: the input passed it (io.load_ir),
    # so a refusal here is normexport's bug and surfaces as one (nothing is left behind)
    _io.save_ir(model, out_path, external_data=True if external else None, validate=_io.check_onnx_path)
    return report
