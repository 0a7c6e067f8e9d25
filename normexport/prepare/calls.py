"""The calls a model makes to its swap candidates (docs/design.md §1, issue 22): one forward of the model on
its example inputs with forward pre-hooks on every candidate records, per module class (and
parameter shapes) and call form (how many positional inputs, which keywords, which are None), the
inputs of its first call (`capture_calls`); a replacement must then take those calls
(normexport.prepare.signature) and match on them (`check_calls`)."""

from __future__ import annotations

import math

import torch
from torch import nn

from . import recognisers
from .numeric import REL_TOL, float32_inputs, rel_err
from .signature import call_text

#: per module class and parameter shapes: per call pattern (number of positional inputs, keyword
#: names, which are None), the inputs of its first call in the example forward
Calls = dict[tuple, dict[tuple, tuple[tuple, dict]]]


def capture_key(m: nn.Module) -> tuple:
    return (type(m), tuple(tuple(p.shape) for p in m.parameters()))


def _pattern(args: tuple, kwargs: dict) -> tuple:
    keys = tuple(sorted(kwargs))
    return (len(args), keys, tuple(a is None for a in args), tuple(kwargs[k] is None for k in keys))


def _detached(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_detached(v) for v in x) if not hasattr(x, "_fields") else type(x)(*(_detached(v) for v in x))
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    return x


def capture_calls(module: nn.Module, example_inputs: tuple, report: list | None = None) -> Calls:
    """Run `module(*example_inputs)` once with forward pre-hooks on every swap candidate and keep,
    per class (and parameter shapes) and call pattern, the inputs of the first call."""
    calls: Calls = {}

    def hook(mod, args, kwargs):
        per = calls.setdefault(capture_key(mod), {})
        pat = _pattern(args, kwargs)
        if pat not in per:
            per[pat] = (_detached(tuple(args)), _detached(dict(kwargs)))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in module.modules()
               if recognisers.left_alone(m) is None and recognisers.candidates(m)]
    try:
        with torch.no_grad():
            module(*example_inputs)
    except Exception as e:  # noqa: BLE001 - swaps are then checked on random inputs and signatures only
        if report is not None:
            report.append({"name": "", "kind": type(module).__name__, "action": "note", "op": None,
                           "reason": f"the model did not run on the example inputs ({type(e).__name__}: "
                                     f"{str(e).splitlines()[0][:160] if str(e) else ''}): swaps checked on random "
                                     "inputs and forward signatures only", "max_rel_err": math.nan})
        return {}
    finally:
        for h in handles:
            h.remove()
    return calls


def check_calls(new: nn.Module, ref: nn.Module, calls: dict) -> tuple[float, str | None]:
    """max rel err of new vs ref over the inputs m received in the example forward (float32), and
    the first call form that fails (None when all pass)."""
    worst = 0.0
    for args, kwargs in calls.values():
        a, k = float32_inputs(args), float32_inputs(kwargs)
        with torch.no_grad():
            err = rel_err(new(*a, **k), ref(*a, **k))
        if not err <= REL_TOL:
            return err, call_text(args, kwargs)
        worst = max(worst, err)
    return worst, None
