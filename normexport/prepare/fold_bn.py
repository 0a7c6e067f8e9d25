"""Fold inference BatchNorm (running statistics) into the preceding Conv / ConvTranspose / Linear.

At inference a BatchNorm computes

    y = (x - running_mean) / sqrt(running_var + eps) * weight + bias  =  x * s + t

with the per-channel constants s = weight / sqrt(running_var + eps), t = bias - running_mean * s.
When x is the output of a convolution or linear layer (and nothing else reads that output), s and t
go into the producer's weight and bias exactly; otherwise the BN becomes a per-channel scale/shift
(:class:`BatchNormAffine`).  A BN that computes batch statistics at inference (training mode, or
``track_running_stats=False``) is left alone.

Data flow is found with ``torch.fx`` symbolic tracing; when the model does not trace, folding falls
back to adjacency inside ``nn.Sequential`` containers.  The folded constants are computed in float64
and cast back to the parameter dtype.  The input module is never modified (deep copy).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils.fusion import fuse_conv_bn_weights, fuse_linear_bn_weights

__all__ = ["fold_batchnorm", "BatchNormAffine", "FoldedLinearBatchNorm1d"]

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONVT = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_PRODUCERS = _CONV + _CONVT + (nn.Linear,)


class BatchNormAffine(nn.Module):
    """Inference BatchNorm as a per-channel scale and shift on dim 1: ``x * s.view(1, C, 1..) + t``."""

    def __init__(self, scale: torch.Tensor, shift: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", scale.detach().clone())
        self.register_buffer("shift", shift.detach().clone())

    @classmethod
    def from_batchnorm(cls, bn: _BatchNorm) -> "BatchNormAffine":
        s, t = _bn_scale_shift(bn)
        dtype = bn.running_mean.dtype
        return cls(s.to(dtype), t.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = [1, -1] + [1] * (x.dim() - 2)
        return x * self.scale.view(shape) + self.shift.view(shape)

    def extra_repr(self) -> str:
        return f"num_features={self.scale.numel()}"


class FoldedLinearBatchNorm1d(nn.Module):
    """Linear followed by BatchNorm1d, folded for 2-D input ``[N, C]``.

    BatchNorm1d normalizes dim 1; only for 2-D input is that the Linear's output-feature dim, so the
    folded weights are exact only there.  For any other rank (fixed while tracing/exporting) this runs
    the original Linear and BatchNorm1d.  Used when the input rank could not be established from an
    example input."""

    def __init__(self, folded: nn.Linear, linear: nn.Linear, bn: _BatchNorm):
        super().__init__()
        self.folded = folded
        self.linear = linear
        self.bn = bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.folded(x)
        return self.bn(self.linear(x))


# ----------------------------------------------------------------------------------------------
# numerics


def _bn_scale_shift(bn: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """s, t in float64."""
    mean = bn.running_mean.detach().double()
    var = bn.running_var.detach().double()
    w = bn.weight.detach().double() if bn.weight is not None else torch.ones_like(mean)
    b = bn.bias.detach().double() if bn.bias is not None else torch.zeros_like(mean)
    s = w / torch.sqrt(var + float(bn.eps))
    return s, b - mean * s


def _bn_params64(bn: _BatchNorm):
    mean = bn.running_mean.detach().double()
    var = bn.running_var.detach().double()
    w = bn.weight.detach().double() if bn.weight is not None else torch.ones_like(mean)
    b = bn.bias.detach().double() if bn.bias is not None else torch.zeros_like(mean)
    return mean, var, float(bn.eps), w, b


def _fold_conv(conv: nn.Module, bn: _BatchNorm) -> nn.Module:
    """A new conv / conv-transpose module with the BN folded in (float64 math, original dtype)."""
    fused = copy.deepcopy(conv)
    w = conv.weight.detach()
    wdt = w.dtype
    bdt = conv.bias.dtype if conv.bias is not None else wdt
    cb = conv.bias.detach().double() if conv.bias is not None else None
    mean, var, eps, g, b = _bn_params64(bn)
    transposed = isinstance(conv, _CONVT)
    if transposed and conv.groups > 1:
        # weight [C_in, C_out/groups, *k]; output channel o = group * (C_out/groups) + j
        s = g / torch.sqrt(var + eps)
        cin, cpg = w.shape[0], w.shape[1]
        k = tuple(w.shape[2:])
        w64 = w.double().reshape(conv.groups, cin // conv.groups, cpg, *k)
        sv = s.reshape(conv.groups, 1, cpg, *([1] * len(k)))
        new_w = (w64 * sv).reshape(w.shape).to(wdt)
        cb64 = cb if cb is not None else torch.zeros_like(mean)
        new_b = ((cb64 - mean) * s + b).to(bdt)
    else:
        # torch's helper, fed float64 so the products are rounded once
        pw, pb = fuse_conv_bn_weights(w.double(), cb, mean, var, eps, g, b, transpose=transposed)
        new_w, new_b = pw.detach().to(wdt), pb.detach().to(bdt)
    fused.weight = nn.Parameter(new_w, requires_grad=conv.weight.requires_grad)
    fused.bias = nn.Parameter(new_b, requires_grad=conv.weight.requires_grad)
    return fused


def _fold_linear(linear: nn.Linear, bn: _BatchNorm) -> nn.Linear:
    fused = copy.deepcopy(linear)
    w = linear.weight.detach()
    bdt = linear.bias.dtype if linear.bias is not None else w.dtype
    lb = linear.bias.detach().double() if linear.bias is not None else None
    mean, var, eps, g, b = _bn_params64(bn)
    pw, pb = fuse_linear_bn_weights(w.double(), lb, mean, var, eps, g, b)
    fused.weight = nn.Parameter(pw.detach().to(w.dtype), requires_grad=linear.weight.requires_grad)
    fused.bias = nn.Parameter(pb.detach().to(bdt), requires_grad=linear.weight.requires_grad)
    return fused


# ----------------------------------------------------------------------------------------------
# module-tree helpers


def _set_submodule(root: nn.Module, qualname: str, new: nn.Module) -> None:
    parent_name, _, child = qualname.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def _bn_refusal(bn: _BatchNorm) -> str | None:
    """Why this BN cannot be turned into constants at all (None when it can)."""
    if bn.training:
        return "BN is in training mode (computes batch statistics); call .eval() first"
    if not bn.track_running_stats or bn.running_mean is None or bn.running_var is None:
        return "track_running_stats=False: BN computes batch statistics at inference"
    if isinstance(bn, nn.modules.lazy.LazyModuleMixin) and bn.has_uninitialized_params():
        return "lazy BN with uninitialized parameters"
    return None


def _producer_refusal(prod: nn.Module, bn: _BatchNorm) -> str | None:
    """Why ``prod -> bn`` cannot be folded (None when it can)."""
    if not isinstance(prod, _PRODUCERS):
        return f"producer {type(prod).__name__} is not Conv/ConvTranspose/Linear"
    if getattr(prod, "weight", None) is None or not isinstance(prod.weight, torch.Tensor):
        return "producer has no weight tensor"
    if not prod.weight.dtype.is_floating_point:
        return "producer weight is not floating point"
    if isinstance(prod, nn.Linear):
        if not isinstance(bn, nn.BatchNorm1d):
            return f"Linear followed by {type(bn).__name__} (only BatchNorm1d folds)"
        if prod.out_features != bn.num_features:
            return "Linear out_features != BN num_features"
        return None
    if isinstance(prod, _CONV) and prod.out_channels != bn.num_features:
        return "conv out_channels != BN num_features"
    if isinstance(prod, _CONVT):
        if prod.out_channels != bn.num_features:
            return "conv-transpose out_channels != BN num_features"
        if prod.in_channels % prod.groups or prod.out_channels % prod.groups:
            return "conv-transpose channels not divisible by groups"
    nd = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3, nn.ConvTranspose1d: 1,
          nn.ConvTranspose2d: 2, nn.ConvTranspose3d: 3}[type(prod)] if type(prod) in (
        _CONV + _CONVT) else None
    bn_nd = {nn.BatchNorm1d: 1, nn.BatchNorm2d: 2, nn.BatchNorm3d: 3}.get(type(bn))
    if nd is not None and bn_nd is not None and nd != bn_nd:
        return f"{type(prod).__name__} followed by {type(bn).__name__} (rank mismatch)"
    return None


def _call_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            counts[n.target] = counts.get(n.target, 0) + 1
    return counts


def _shape_prop(gm: torch.fx.GraphModule, example_inputs) -> bool:
    from torch.fx.passes.shape_prop import ShapeProp

    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(*example_inputs)
        return True
    except Exception:  # noqa: BLE001 - shapes are only a refinement
        return False


def _plan_fx(model: nn.Module, example_inputs) -> list[tuple[str, str | None, str]] | None:
    """[(bn_name, producer_name | None, why-not-folded or rank info)] from an fx trace, or None."""
    try:
        gm = torch.fx.symbolic_trace(model)
    except Exception:  # noqa: BLE001 - any trace failure -> Sequential fallback
        return None
    counts = _call_counts(gm)
    have_shapes = example_inputs is not None and _shape_prop(gm, example_inputs)
    modules = dict(gm.named_modules())
    plan: list[tuple[str, str | None, str]] = []
    for node in gm.graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target), _BatchNorm):
            continue
        bn_name = node.target
        if counts[bn_name] > 1:
            plan.append((bn_name, None, f"BN module is called {counts[bn_name]} times"))
            continue
        src = node.args[0] if node.args else None
        if not isinstance(src, torch.fx.Node):
            plan.append((bn_name, None, "BN input is not a traced value"))
            continue
        if src.op != "call_module":
            what = src.target if isinstance(src.target, str) else getattr(src.target, "__name__", src.target)
            plan.append((bn_name, None, f"producer is {src.op} {what}, not a foldable module"))
            continue
        prod_name = src.target
        prod = modules[prod_name]
        rank = None
        if isinstance(prod, nn.Linear) and have_shapes:
            meta = src.meta.get("tensor_meta")
            rank = len(meta.shape) if meta is not None and hasattr(meta, "shape") else None
        if rank is not None and rank != 2:
            why = (f"Linear output is {rank}-D: BatchNorm1d normalizes dim 1, not the "
                   "Linear's output features")
        else:
            why = _producer_refusal(prod, modules[bn_name])
        if why is None and len(src.users) != 1:
            why = f"producer output has {len(src.users)} consumers"
        if why is None and counts[prod_name] > 1:
            why = f"producer module is called {counts[prod_name]} times (shared weights)"
        if why is None and isinstance(prod, nn.Linear) and rank is None:
            why = "rank?"  # fold with a rank guard
        plan.append((bn_name, prod_name if why in (None, "rank?") else None, why or ""))
    planned = {p[0] for p in plan}
    for name, m in model.named_modules():
        if isinstance(m, _BatchNorm) and name not in planned:
            plan.append((name, None, "BN is not called in the traced forward"))
    return plan


def _plan_sequential(model: nn.Module) -> list[tuple[str, str | None, str]]:
    uses: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        uses[id(m)] = uses.get(id(m), 0) + 1
    plan: list[tuple[str, str | None, str]] = []
    seen: set[str] = set()
    for seq_name, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq.named_children())
        for i, (cname, child) in enumerate(children):
            if not isinstance(child, _BatchNorm):
                continue
            bn_name = f"{seq_name}.{cname}" if seq_name else cname
            seen.add(bn_name)
            if uses[id(child)] > 1:
                plan.append((bn_name, None, "BN module appears more than once in the model"))
                continue
            if i == 0:
                plan.append((bn_name, None, "no producer before BN in its nn.Sequential"))
                continue
            pname, prod = children[i - 1]
            prod_name = f"{seq_name}.{pname}" if seq_name else pname
            why = _producer_refusal(prod, child)
            if why is None and uses[id(prod)] > 1:
                why = "producer module appears more than once in the model (shared weights)"
            if why is None and isinstance(prod, nn.Linear):
                why = "rank?"
            plan.append((bn_name, prod_name if why in (None, "rank?") else None, why or ""))
    # BNs outside any Sequential: data flow unknown, only the (always valid) affine form
    for name, m in model.named_modules():
        if isinstance(m, _BatchNorm) and name not in seen:
            plan.append((name, None, "model is not fx-traceable and BN is not inside nn.Sequential"))
    return plan


def fold_batchnorm(module: nn.Module, report: list | None = None, *,
                   example_inputs: tuple | None = None) -> nn.Module:
    """Return a deep copy of ``module`` with every inference BatchNorm folded away.

    - producer (Conv1d/2d/3d, ConvTranspose1d/2d/3d, Linear + BatchNorm1d on 2-D input) whose
      output feeds only the BN -> producer weights/bias folded, BN replaced by ``nn.Identity``
      (action "folded");
    - any other BN with running statistics in eval mode -> :class:`BatchNormAffine`
      (action "affine");
    - BN in training mode or with ``track_running_stats=False`` -> left as is (action "skipped").

    ``example_inputs`` (optional) lets the fx pass see shapes: Linear -> BatchNorm1d folds plainly
    for 2-D input and becomes affine for 3-D input.  Without it a Linear -> BatchNorm1d pair becomes
    :class:`FoldedLinearBatchNorm1d` (folded for 2-D input, original ops otherwise).

    ``report`` (a list) receives one dict per BN: ``{"name", "action", "into", "reason"}``.
    """
    if not any(isinstance(m, _BatchNorm) for m in module.modules()):
        return module  # nothing to fold: no copy (a multi-GiB model stays one copy)
    model = copy.deepcopy(module)
    plan = _plan_fx(model, example_inputs)
    how = "fx"
    if plan is None:
        plan = _plan_sequential(model)
        how = "nn.Sequential adjacency (fx tracing failed)"
    entries: list[dict[str, Any]] = []
    for bn_name, prod_name, why in plan:
        bn = model.get_submodule(bn_name)
        refusal = _bn_refusal(bn)
        if refusal is None and why == "BN is not called in the traced forward":
            refusal = why
        if refusal is not None:
            entries.append({"name": bn_name, "action": "skipped", "into": None, "reason": refusal})
            continue
        if prod_name is not None:
            prod = model.get_submodule(prod_name)
            if isinstance(prod, nn.Linear):
                folded = _fold_linear(prod, bn)
                if why == "rank?":
                    new = FoldedLinearBatchNorm1d(folded, prod, bn)
                    reason = (f"Linear+BatchNorm1d folded for 2-D input ({how}); input rank unknown "
                              "(no example_inputs), other ranks run the original ops")
                else:
                    new = folded
                    reason = f"folded into Linear ({how}, 2-D input)"
            else:
                new = _fold_conv(prod, bn)
                reason = f"folded into {type(prod).__name__} ({how})"
            _set_submodule(model, prod_name, new)
            _set_submodule(model, bn_name, nn.Identity())
            entries.append({"name": bn_name, "action": "folded", "into": prod_name, "reason": reason})
        else:
            _set_submodule(model, bn_name, BatchNormAffine.from_batchnorm(bn))
            entries.append({"name": bn_name, "action": "affine", "into": None,
                            "reason": f"not foldable: {why}; replaced by per-channel scale/shift"})
    if report is not None:
        report.extend(entries)
    return model
