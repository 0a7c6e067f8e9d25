"""The per-rule check: the original model runs once (at the sizes normexport.sizes finds, or the
user's), then each candidate on the same inputs; they must agree within docs/design.md §7."""

from __future__ import annotations

import onnx

from normexport import sizes as _sizes
from normexport.errors import UsageError, first_line

from . import _verify
from .report import RewriteReport, input_records


class Verifier:
    def __init__(self, original: onnx.ModelProto, report: RewriteReport, given=None) -> None:
        self.original = original
        self.report = report
        self.given = given
        self._ref: dict | None = None
        self._feeds: dict | None = None
        self._error: str | None = None

    def _prepare(self) -> None:
        if self._ref is not None or self._error is not None:
            return
        try:
            found = _sizes.find(self.original, self.given)
        except UsageError:  # the user's --input sizes do not fit: their error, not a rule's
            raise
        except Exception as e:  # noqa: BLE001
            self._error = "cannot run the original model (see the note)"
            self.report.notes.append(f"verification: cannot run the original model: {first_line(e, 400)}")
            return
        self._feeds, self._ref = found.feeds, found.outputs
        self.report.inputs = input_records(self.original, found.shapes)
        self.report.sizes = found.how

    def check(self, candidate: onnx.ModelProto) -> str | None:
        """None when `candidate` agrees with the original, else the reason."""
        self._prepare()
        if self._error:
            return self._error
        try:
            got = _verify.run(candidate, self._feeds)
        except Exception as e:  # noqa: BLE001
            return f"rewritten model does not run: {_sizes.ort_error(e)}"
        comps = _verify.compare(self._ref, got)
        if all(c.passed for c in comps):
            self.report.verification = comps
            return None
        return _verify.describe_failure(comps)
