"""A save_pretrained folder's checkpoint against the model its config.json builds (docs/design.md §14).

A config.json that says one layer more than the weights hold loads in transformers / diffusers with
that layer randomly initialised (a logged warning normexport's quiet loading hides); one layer fewer
drops the checkpoint's last layer; a hidden size / vocabulary that disagrees re-initialises the
tensors of another shape (with `ignore_mismatched_sizes`) or fails deep in the library. Every load
from a folder here goes through `from_pretrained`: the library's own report
(`output_loading_info=True`: missing_keys / unexpected_keys / mismatched_keys, already filtered by
the class's ignore lists, `_keys_to_ignore_on_load_missing` / `_unexpected`, and the tied weights it
re-ties) decides, and any disagreement is one line (UsageError: exit 2, nothing written) naming the
count and the first keys of each kind. `--allow-random-weights` (convert, check: `allowing()`) loads
such a folder anyway and says on the terminal what is random or dropped.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from ..errors import UsageError

FLAG = "--allow-random-weights"
_SHOWN = 3  # keys named per kind
_allowed = [False]


@contextlib.contextmanager
def allowing(on: bool = True):
    """While inside, a folder whose checkpoint and config disagree loads (said on stderr) instead of
    being refused (the CLI's --allow-random-weights; the Python API's way to the same)."""
    previous = _allowed[0]
    _allowed[0] = bool(on)
    try:
        yield
    finally:
        _allowed[0] = previous


def allowed() -> bool:
    return _allowed[0]


def from_pretrained(cls, path: Path, what: str, **kwargs):
    """cls.from_pretrained(path) offline with the library's loading report, judged by `judge`
    (`what`: how the one-line error names the folder). Shapes that disagree are reported, not
    raised (`ignore_mismatched_sizes=True`: the library's size-mismatch error is a multi-line
    report), so they end in the same line as missing and unused tensors."""
    out = cls.from_pretrained(str(path), local_files_only=True, output_loading_info=True,
                              ignore_mismatched_sizes=True, **kwargs)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):  # a class without the report
        print(f"normexport: note: {what}: {cls.__name__}.from_pretrained gives no loading report: its checkpoint "
              "was not compared with config.json", file=sys.stderr)
        return out[0] if isinstance(out, tuple) else out
    model, info = out
    judge(info, what)
    return model


def disagreements(info: dict) -> list[str]:
    """What the loading report says is wrong, one clause per kind (empty when the checkpoint fits)."""
    missing = sorted(map(str, info.get("missing_keys") or ()))
    unexpected = sorted(map(str, info.get("unexpected_keys") or ()))
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda m: str(m[0]))
    out = []
    if missing:
        out.append(f"{len(missing)} parameter(s) of the model config.json builds are not in the checkpoint "
                   f"({_first(missing)}): random values")
    if unexpected:
        out.append(f"{len(unexpected)} checkpoint tensor(s) the model does not use ({_first(unexpected)}): dropped")
    if mismatched:
        shown = [f"{m[0]}: checkpoint {_dims(m[1])}, model {_dims(m[2])}" for m in mismatched[:_SHOWN]]
        more = f" and {len(mismatched) - _SHOWN} more" if len(mismatched) > _SHOWN else ""
        out.append(f"{len(mismatched)} checkpoint tensor(s) of another shape than the model's "
                   f"({'; '.join(shown)}{more}): random values")
    return out


def judge(info: dict, what: str) -> None:
    """A UsageError naming every disagreement; under `allowing()` the same said on stderr instead."""
    wrong = disagreements(info)
    if not wrong:
        if allowed():
            print(f"normexport: {FLAG}: {what}: every weight came from the checkpoint (nothing random, nothing "
                  "dropped)", file=sys.stderr)
        return
    if allowed():
        print(f"normexport: warning: {FLAG}: {what} loaded although config.json and the checkpoint disagree: "
              f"{' | '.join(wrong)}", file=sys.stderr)
        return
    raise UsageError(f"{what}: config.json and the checkpoint disagree: {' | '.join(wrong)}: fix config.json (or "
                     f"save the model again with save_pretrained), or pass {FLAG} to load it with random / dropped "
                     "weights on purpose")


def _first(keys: list[str]) -> str:
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return ", ".join(keys[:_SHOWN]) + more


def _dims(shape) -> str:
    return "x".join(str(int(d)) for d in shape) or "scalar"
