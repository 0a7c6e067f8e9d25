"""`--inputs FILE`: example inputs a user can always give (docs/design.md §9) — a `torch.save`d
`(args, kwargs)` of one call of the model, as `normexport.capture` writes it, loaded with
`weights_only=True` (nested lists / tuples / dicts of tensors and plain values; no code runs)."""

from __future__ import annotations

import os

import torch

from ..errors import UsageError, first_line

#: what an --inputs file may hold besides tensors (weights_only=True admits no more)
PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


def load_inputs_file(path: str) -> tuple[tuple, dict]:
    """(args, kwargs) from FILE; one line naming the problem and the fix otherwise."""
    if not os.path.isfile(path):
        raise UsageError(f"--inputs file not found: '{path}': record one with "
                         "`with normexport.capture(model, \"inputs.pt\"): pipeline(...)`")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling refused (not plain data) or not a torch file
        raise UsageError(f"cannot read --inputs '{path}' with weights_only=True ({first_line(e, 160)}): save "
                         "(args, kwargs) of tensors and plain values with torch.save, or record it with "
                         "normexport.capture") from None
    if isinstance(obj, dict) and set(obj) <= {"args", "kwargs"}:  # {"args": ..., "kwargs": ...} alike
        obj = (obj.get("args", ()), obj.get("kwargs", {}))
    if not (isinstance(obj, (tuple, list)) and len(obj) == 2 and isinstance(obj[0], (tuple, list))
            and isinstance(obj[1], dict)):
        raise UsageError(f"--inputs '{path}' holds a {type(obj).__name__}, not (args, kwargs): save "
                         "torch.save((args, kwargs), FILE) with args a tuple and kwargs a dict, or record it "
                         "with normexport.capture")
    args, kwargs = tuple(obj[0]), dict(obj[1])
    bad = [k for k in kwargs if not isinstance(k, str)]
    if bad:
        raise UsageError(f"--inputs '{path}': keyword {bad[0]!r} is not a string: name keyword inputs by parameter")
    _check_leaves((args, kwargs), path)
    if not any(isinstance(t, torch.Tensor) for t in torch.utils._pytree.tree_leaves((args, kwargs))):
        raise UsageError(f"--inputs '{path}' holds no tensor: record a call that passes the model tensors")
    return args, kwargs


def _check_leaves(obj, path: str, where: str = "") -> None:
    if isinstance(obj, torch.Tensor) or isinstance(obj, PLAIN):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_leaves(v, path, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_leaves(v, path, f"{where}[{i}]")
        return
    raise UsageError(f"--inputs '{path}': {where or 'the value'} is a {type(obj).__name__}: an --inputs file holds "
                     "tensors and plain values (lists, tuples, dicts, numbers, strings, None)")
