"""The check report: one Row per backend x input shape x output, the CheckReport with its table and
JSON form (docs/design.md §5)."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from .tolerances import LIMIT_RULE

@dataclasses.dataclass
class Row:
    """One backend x one input shape x one output."""

    backend: str
    shape_index: int
    input_shapes: dict[str, list[int]]
    output: str
    dtype: str
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    mean_abs_err: float | None = None
    ref_err_fp64: float | None = None
    tolerance: float | None = None
    limit: float | None = None
    max_abs_ref: float | None = None
    passed: bool = False
    worst_index: list[int] | None = None
    worst_value: float | None = None
    worst_ref: float | None = None
    worst_eager: float | None = None
    elements: int = 0  # elements compared (0: nothing was compared)
    reason: str | None = None  # why it failed, or how it was judged
    floor: float | None = None  # the floor of both rules (eps-based, package docstring)
    plain_err: float | None = None  # the runtime on the plain export vs float64 (when the first rule failed)
    plain_reason: str | None = None  # why plain_err is missing though it was needed
    rule: str | None = None  # the rule that decided: "2x eager", "plain export", "tolerance"
    warning: str | None = None  # e.g. eager itself above the tolerance ("numerically fragile in float16")

    @property
    def compared(self) -> bool:
        return self.max_abs_err is not None and self.elements > 0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        del d["backend"], d["output"]
        return {k: _json_number(v) for k, v in d.items()}


def _json_number(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # strict JSON has no inf / nan; `reason` says what happened
    return v


@dataclasses.dataclass
class CheckReport:
    command: str
    onnx_model: str
    reference: str
    inputs: list[dict]  # name, shape, dtype (the given inputs)
    shapes: list[dict]  # per checked input shape: {"index", "inputs": {name: shape}, "skipped"?}
    backends: list[str]
    rows: list[Row] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    fp64_reference: dict = dataclasses.field(default_factory=dict)  # {"available": bool, "reason"?}
    backend_errors: dict[str, str] = dataclasses.field(default_factory=dict)
    dtype: str | None = None  # the dtype eager ran in when cast (None: as given)
    dtype_source: str | None = None  # "--dtype" / "argument", or "ONNX input '<name>'"
    no_extra_shapes: str | None = None  # why only the given shape was checked
    plain_export: dict = dataclasses.field(default_factory=dict)  # {"built": bool, "reason"?}; {} when not needed
    sizes: str | None = None  # where the input sizes came from (`check`: parity/choose.py), None: given by the caller

    @property
    def ran(self) -> list[str]:
        return [b for b in self.backends if b not in self.skipped]

    def compared(self, backend: str) -> int:
        """Rows of `backend` where outputs were actually compared (elements > 0)."""
        return sum(1 for r in self.rows if r.backend == backend and r.compared)

    def backend_passed(self, backend: str) -> bool:
        rows = [r for r in self.rows if r.backend == backend]
        return (bool(rows) and backend not in self.backend_errors and all(r.passed for r in rows)
                and self.compared(backend) > 0)

    @property
    def passed(self) -> bool:
        return bool(self.ran) and all(self.backend_passed(b) for b in self.ran)

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.passed]

    def to_dict(self) -> dict:
        from .. import __version__

        results: dict[str, dict[str, list[dict]]] = {}
        for r in self.rows:
            results.setdefault(r.backend, {}).setdefault(r.output, []).append(r.to_dict())
        status = {}
        for b in self.backends:
            if b in self.skipped:
                status[b] = {"status": "skipped", "reason": self.skipped[b]}
            else:
                status[b] = {"status": "passed" if self.backend_passed(b) else "failed",
                             "rows_compared": self.compared(b)}
                if b in self.backend_errors:
                    status[b]["error"] = self.backend_errors[b]
                elif not self.compared(b):
                    status[b]["error"] = "nothing was compared"
        return {
            "normexport_version": __version__,
            "command": self.command,
            "onnx_model": self.onnx_model,
            "reference": self.reference,
            "inputs": self.inputs,
            "dtype": self.dtype,
            "dtype_source": self.dtype_source,
            "shapes": self.shapes,
            "shapes_summary": self.shapes_summary(),
            "sizes": self.sizes,
            "limit_rule": LIMIT_RULE,
            "fp64_reference": self.fp64_reference,
            "plain_export": self.plain_export,
            "backends": status,
            "results": results,
            "skipped": [{"backend": b, "reason": why} for b, why in self.skipped.items()],
            "passed": self.passed,
        }

    def write_json(self, path: str | os.PathLike) -> Path:
        from ..io import write_json

        return write_json(self.to_dict(), path)

    def table(self) -> str:
        head = ("backend", "shape", "output", "dtype", "eager_err", "plain_err", "file_err", "max_rel_err",
                "limit", "tolerance", "rule", "result")
        lines = []
        for r in self.rows:
            shape = " ".join(f"{k}={'x'.join(map(str, v)) or 'scalar'}" for k, v in r.input_shapes.items())
            if len(shape) > 34:
                shape = f"#{r.shape_index} " + shape[: 30] + ".."
            lines.append((r.backend, shape, r.output, r.dtype, _fmt(r.ref_err_fp64), _fmt(r.plain_err),
                          _fmt(r.max_abs_err), _fmt(r.max_rel_err), _fmt(r.limit), _fmt(r.tolerance), r.rule or "-",
                          "PASS" if r.passed else "FAIL"))
        widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
        in_dtype = f", eager in {self.dtype} ({self.dtype_source})" if self.dtype else ""
        out = [f"parity check: {self.onnx_model} vs {self.reference} "
               f"(errors against the float64 reference{'' if self.fp64_reference.get('available') else ' -- unavailable, against eager'}"
               f"{in_dtype})"]
        out.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        out.extend("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in lines)
        if self.sizes and self.shapes:
            from ..sizes import describe

            out.append(f"  verified at {describe(self.shapes[0]['inputs'])} ({self.sizes})")
        out.append("  max abs errors vs float64: eager_err = eager in the same dtype, plain_err = the backend on the "
                   "plain torch.onnx export (only when 2x eager fails), file_err = the backend on this file")
        for r in self.rows:
            if r.warning:
                out.append(f"  WARNING {r.backend} {r.output} shape #{r.shape_index}: {r.warning}")
        if self.plain_export.get("reason"):
            out.append(f"  plain export: {self.plain_export['reason']}")
        for r in self.rows:
            if not r.passed and r.reason:
                out.append(f"  FAIL {r.backend} {r.output} shape #{r.shape_index}: {r.reason}")
        for b, err in self.backend_errors.items():
            out.append(f"  ERROR {b}: {err}")
        for s in self.shapes:
            if s.get("skipped"):
                out.append(f"  shape #{s['index']} not checked: {s['skipped']}")
        if not self.fp64_reference.get("available", True):
            out.append(f"  no float64 reference: {self.fp64_reference.get('reason')}")
        for b, why in self.skipped.items():
            out.append(f"  skipped {b}: {why}")
        verdict = "PASSED" if self.passed else "FAILED"
        if not self.ran:
            verdict += " (no backend could run)"
        nothing = [b for b in self.ran if not self.compared(b)]
        if nothing:
            verdict += f" (nothing compared in {', '.join(nothing)})"
        out.append(f"{verdict}: {len(self.ran)} backend(s) x {self.shapes_summary()}, "
                   f"{len(self.rows) - len(self.failures)}/{len(self.rows)} rows within limits")
        return "\n".join(out)

    def shapes_summary(self) -> str:
        """'3 shape(s) checked (0 skipped)', '1 shape(s) checked (2 skipped: ...)', or why only one."""
        checked = sum(1 for s in self.shapes if not s.get("skipped"))
        skipped = [s["skipped"] for s in self.shapes if s.get("skipped")]
        text = f"{checked} shape(s) checked"
        if skipped:
            whys = sorted(set(skipped))
            why = whys[0] if len(whys) == 1 else "the reference model rejects them, reasons listed above"
            text += f" ({len(skipped)} skipped: {why})"
        elif self.no_extra_shapes:
            text += f" (no extra shapes: {self.no_extra_shapes})"
        else:
            text += " (0 skipped)"
        return text


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.3g}" if v == 0 or abs(v) >= 1e-3 and abs(v) < 1e4 else f"{v:.2e}"
