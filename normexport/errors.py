"""Errors that the command line turns into one line on stderr and an exit code."""


class UsageError(Exception):
    """Bad input or usage: exit 2. The message names the problem and the fix, in one line."""


class ParityError(Exception):
    """A parity check failed: exit 1."""


class ExportError(Exception):
    """The model could not be exported (a limitation of torch.onnx or of normexport): exit 1."""
