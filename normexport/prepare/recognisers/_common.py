"""What the recognisers share: the candidate a recogniser proposes, the eps attribute of a norm,
and the report entry (one dict per candidate or norm-named module, docs/design.md §9)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

#: (op, builder, inputs_fn, reason): builder(dtype) makes the replacement with parameters in
#: `dtype`; inputs_fn() makes float32 check inputs; op is "RMSNorm" or "AdaLNZero"
Candidate = tuple[str, Callable[[torch.dtype], nn.Module], Callable[[], tuple], str]


def eps_of(m: nn.Module) -> float | None:
    """The module's float `variance_epsilon` / `eps` / `epsilon` (the first found), else None."""
    for name in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(m, name, None)
        if isinstance(v, (float, int)) and not isinstance(v, bool):
            return float(v)
    return None


def entry(name: str, module: nn.Module, action: str, op: str | None, reason: str, err: float) -> dict:
    """A prepare report entry: {"name", "kind", "action", "op", "reason", "max_rel_err"}."""
    return {"name": name, "kind": type(module).__name__, "action": action, "op": op,
            "reason": reason, "max_rel_err": float(err)}
