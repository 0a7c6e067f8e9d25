"""A JSON file that must hold an object, read with the one-line refusal (docs/design.md §14): a
save_pretrained config, a pipeline's model_index.json, the exported pipeline's manifest. A leaf:
it imports errors only (normexport.load may use it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import UsageError, first_line


def read_json_object(path: str | os.PathLike, fix: str) -> dict:
    """A JSON file that must hold an object (a config, model_index.json, a manifest); where it cannot
    be read or is not an object, one line naming the file and `fix` (what the user should do)."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read '{path}' ({first_line(e, 120)}): {fix}") from None
    if not isinstance(value, dict):
        raise UsageError(f"'{path}' is not a JSON object: {fix}")
    return value
