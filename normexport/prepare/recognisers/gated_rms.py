"""Gated RMSNorm by behaviour: a 1-D weight + eps and a forward of two inputs (hidden_states,
gate): y = rmsnorm(x * silu(gate)) * w (Mamba2, Zamba2, Bamba, NemotronH) or rmsnorm(x) * w *
silu(gate) (Qwen3-Next, FalconH1), over the whole last dim or the groups its attributes name
(group_size / n_groups / ngroups / num_groups); the hypothesis that reproduces the module wins.
The replacement (normexport.prepare.nn.GatedRMSNorm) computes the gate outside and the RMSNorm
part with the normexport op. The plain RMSNorm hypotheses (rms_family) are tried after these."""

from __future__ import annotations

import torch
from torch import nn

from .. import nn as nenn
from ..numeric import rand
from ..signature import positional_params
from ._common import Candidate, eps_of

FINAL = False


def recognise(m: nn.Module) -> list[Candidate]:
    """Gated RMSNorm hypotheses for a module with a 1-D weight + eps whose forward takes two
    inputs (hidden_states, gate): the gate before the norm (Mamba2) or after it (norm before
    gate), statistics over the whole last dim or over the groups its attributes name
    (group_size / n_groups / ngroups / num_groups). The order follows the module's own
    `norm_before_gate` (its hypothesis first)."""
    eps, w = eps_of(m), getattr(m, "weight", None)
    params = positional_params(m.forward)
    if eps is None or not isinstance(w, torch.Tensor) or w.dim() != 1 or not w.is_floating_point() \
            or params is None or len(params) != 2:
        return []
    hidden = w.shape[0]
    groups = [1]
    size = getattr(m, "group_size", None)
    if isinstance(size, int) and size > 0 and hidden % size == 0:
        groups.append(hidden // size)
    for a in ("n_groups", "ngroups", "num_groups"):
        g = getattr(m, a, None)
        if isinstance(g, int) and g > 0 and hidden % g == 0:
            groups.append(g)
    groups = sorted(set(groups), key=groups.index)
    order = [bool(getattr(m, "norm_before_gate", False))]
    order.append(not order[0])

    def inputs():
        return (rand((2, 5, hidden), 11, 0.3), rand((2, 5, hidden), 12))

    cands = []
    for before in order:
        for g in groups:
            def build(dtype, g=g, before=before):
                return nenn.GatedRMSNorm(w.detach(), eps, groups=g, norm_before_gate=before)
            form = "RMSNorm(x) * w * silu(gate)" if before else "RMSNorm(x * silu(gate)) * w"
            cands.append(("RMSNorm", build, inputs, f"gated RMSNorm by behaviour: y = {form}"
                          + (f" over {g} groups" if g > 1 else "") + "; RMSNorm fused, the gate outside"))
    return cands
