"""A mixture of experts whose dispatch is data-dependent in python, run densely for export (issue 46
item 6; docs/design.md §9, beside transformers' experts implementations in implementations.py).

Some MoE modules route tokens with host-side counts: diffusers' HiDream `MOEFeedForwardSwiGLU.moe_infer`
sorts the tokens by expert and reads `flat_expert_indices.bincount().cpu().numpy()`, then loops over
the experts it found. No exporter traces that (dynamo: ".numpy() is not supported for tensor
subclasses"; a trace would bake one routing). It is the model's code, not a torch or normexport bug.

The dense form computes the same sum with standard ops and static shapes: every expert on every
token, each output weighted by the gate's weight where the token chose that expert (0 elsewhere),
plus the shared experts where the module has them. Found by structure, not by class: a module with
a ModuleList `experts` and a `gate` returning (top-k indices, top-k weights, ...). The dense forward
is kept only where it agrees with the module's own forward on the inputs that module receives in
one forward of the model (max |diff| <= 1e-5 x max |output|); otherwise the module is left as it
was and the report says why. The module tree is copied (weights shared); the input is not changed.
Costs: each expert runs on every token (top-k of n experts: n/k times the expert FLOPs).
"""

from __future__ import annotations

import types

import torch
from torch import nn

#: the dense forward is kept when it moves the module's output by at most this, relative to max |output|
TOL = 1e-5


def _candidates(module: nn.Module) -> list[str]:
    return [n for n, m in module.named_modules()
            if isinstance(getattr(m, "experts", None), nn.ModuleList) and len(m.experts) > 1
            and callable(getattr(m, "gate", None))]


def _dense_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the gate's top-k weight for it (0 where not chosen)."""
    idx, weight = self.gate(x)[:2]
    flat = x.reshape(-1, x.shape[-1])
    idx = idx.reshape(flat.shape[0], -1)
    weight = weight.reshape(flat.shape[0], -1)
    out = None
    for i, expert in enumerate(self.experts):
        w = (weight * (idx == i).to(weight.dtype)).sum(dim=-1, keepdim=True)
        y = expert(flat) * w.to(flat.dtype)
        out = y if out is None else out + y
    out = out.reshape(x.shape).to(x.dtype)
    shared = getattr(self, "shared_experts", None)
    return out + shared(x) if shared is not None else out


def dense_experts(module: nn.Module, args: tuple | None, report: list) -> nn.Module:
    """`module`, or a copy of its module tree (weights shared) whose data-dependent MoE modules run
    densely where that is verified (module doc); one report entry per candidate."""
    names = _candidates(module)
    if not names or args is None:
        return module
    from .swap import structure_copy

    new = structure_copy(module)
    mods = dict(new.named_modules())
    seen: dict[str, tuple] = {}

    def hook(name):
        def pre(_m, a, kw):
            if name not in seen:
                seen[name] = (tuple(a), dict(kw))
        return pre

    handles = [mods[n].register_forward_pre_hook(hook(n), with_kwargs=True) for n in names]
    try:
        with torch.no_grad():
            new(*args)
    except Exception:  # noqa: BLE001 - the model's own failure surfaces in the exporters, as before
        return module
    finally:
        for h in handles:
            h.remove()
    kept = 0
    for n in names:
        m = mods[n]
        entry = {"model": n, "what": "experts", "from": f"{type(m).__name__}.forward (data-dependent dispatch)",
                 "to": "dense", "max_rel_err": float("nan")}
        if n not in seen:
            report.append({**entry, "action": "failed", "reason": "not called in one forward of the model"})
            continue
        a, kw = seen[n]
        try:
            with torch.no_grad():
                want = m(*a, **kw)
                m.forward = types.MethodType(_dense_forward, m)
                got = m(*a, **kw)
            if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and got.shape == want.shape):
                raise ValueError("the module's output is not one tensor of the input's shape")
            scale = want.abs().max().item() or 1.0
            err = (got.double() - want.double()).abs().max().item() / scale
        except Exception as e:  # noqa: BLE001 - not this structure: left as it was
            vars(m).pop("forward", None)
            report.append({**entry, "action": "reverted", "reason": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        if not err <= TOL:
            vars(m).pop("forward", None)
            report.append({**entry, "action": "reverted", "max_rel_err": err,
                           "reason": f"outputs differ from the module's own forward (rel {err:.3g} > {TOL:g})"})
            continue
        kept += 1
        report.append({**entry, "action": "switched", "max_rel_err": err,
                       "reason": "every expert on every token, weighted by the gate (verified on the model's call)"})
    return new if kept else module
