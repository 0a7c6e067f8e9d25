"""The signature check of a swap (docs/design.md §1, issue 22): can the replacement take every call the
module gets? With the calls seen in an example forward (normexport.prepare.calls), each must bind
to the replacement's forward; without, it must take as many positional inputs as the module's."""

from __future__ import annotations

import inspect

import torch
from torch import nn


def positional_params(fn) -> list[str] | None:
    """Names of fn's positional parameters (None: unreadable, or *args: any number)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def signature_text(fn) -> str:
    try:
        return f"({', '.join(inspect.signature(fn).parameters)})"
    except (TypeError, ValueError):
        return "(...)"


def call_text(args: tuple, kwargs: dict) -> str:
    """A call form as the terminal shows it: forward(2x5x32, None, emb=tensor)."""
    parts = ["None" if a is None else ("x".join(map(str, a.shape)) if isinstance(a, torch.Tensor) else type(a).__name__)
             for a in args] + [f"{k}=" + ("None" if v is None else "tensor" if isinstance(v, torch.Tensor) else type(v).__name__)
                               for k, v in kwargs.items()]
    return f"({', '.join(parts)})"


def signature_problem(m: nn.Module, new: nn.Module, calls: dict | None) -> str | None:
    """Why `new` cannot stand in for `m` at its call sites, or None. With the calls seen in the
    example forward: each must bind to new's forward. Without (the module did not run, or no
    example inputs): new's forward must take as many positional inputs as m's."""
    try:
        sig = inspect.signature(new.forward)
    except (TypeError, ValueError):
        return None
    if calls:
        for args, kwargs in calls.values():
            try:
                sig.bind(*args, **kwargs)
            except TypeError:
                return (f"called as forward{call_text(args, kwargs)} in the example forward; "
                        f"{type(new).__name__}.forward{signature_text(new.forward)} cannot take that call")
        return None
    old, cur = positional_params(m.forward), positional_params(new.forward)
    if old is not None and cur is not None and len(old) > len(cur):
        return (f"forward{signature_text(m.forward)} takes {len(old)} inputs, {type(new).__name__}.forward"
                f"{signature_text(new.forward)} {len(cur)} (not called in an example forward to show which are used)")
    return None
