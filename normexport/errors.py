"""Errors that the command line turns into one line on stderr and an exit code."""


class UsageError(Exception):
    """Bad input or usage: exit 2. The message names the problem and the fix, in one line."""


class ParityError(Exception):
    """A parity check failed: exit 1."""


class ExportError(Exception):
    """The model could not be exported (a limitation of torch.onnx or of normexport): exit 1."""


class AxesFixed(ExportError):
    """The exporter ladder would give up axes its caller requires (it serves them otherwise where the
    model fixes them: a pipeline's padded text axis, pipeline/padding.py); `axes`: {input: [axes]}
    of those, `fixed`: every axis the ladder learned the model fixes (torch.export's conflicts)."""

    def __init__(self, message: str, axes: dict, fixed: dict | None = None):
        super().__init__(message)
        self.axes, self.fixed = axes, dict(fixed or {})


def first_line(e: BaseException, limit: int) -> str:
    """The first line of an exception's message (its type name when empty), at most `limit` chars:
    what a one-line error quotes of the cause."""
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:limit]
