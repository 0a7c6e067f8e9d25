"""Swap recognised normalization modules for normexport modules (docs/design.md §1, issue 3): the driver.

`prepare(module, report)` copies `module`'s module tree (the weights shared) and replaces, wherever
it can prove the swap preserves behaviour, RMSNorm-like modules with `normexport.prepare.nn.RMSNorm`
(gated RMSNorms with `nn.GatedRMSNorm`: the RMSNorm part as the op, the gate outside) and adaLN-Zero
normalise-and-modulate steps with `normexport.prepare.nn.AdaLNZero`. Those call the
`torch.ops.normexport.*` custom ops, which `torch.onnx.export(..., custom_translation_table=
normexport.ops.TRANSLATION_TABLE)` turns into `normexport::RMSNorm` / `normexport::AdaLNZero`.

Recognition is by behaviour, not by class name alone. The recognisers (normexport.prepare.
recognisers: one module per kind, walked in the order of its registry) only make a module a
*candidate* with one or more hypotheses; for each, the replacement is built, its forward must take
the module's calls (normexport.prepare.signature; with example inputs, every call form seen in one
forward of the model, captured by normexport.prepare.calls.capture_calls), and both are run in
float32 on random input and on those captured inputs (normexport.prepare.numeric): the swap is kept
only if max|new - old| / max|old| <= 1e-5. Otherwise the module is left alone (the ONNX rewriter
sees its decomposition) and the report says why; `summary_lines` puts one line per class on the
terminal. Modules are visited top-down; a swapped module's children are not visited; block
recognisers (DiT-style `modulate`) run on each module before its children.

The modulations diffusers writes inline in a block's forward (the norm2 / norm2_context of SD3 and
Flux blocks, norm3 of BasicTransformerBlock, PixArt's `scale_shift_table` norm1 / norm2, the
norm_out of DiT / PixArt) have no module to swap: their nn.LayerNorm is exported as
LayerNormalization and the ONNX rewriter (rules/adaln*.py) fuses it with the modulation.

Anything else whose class name contains "Norm" is reported as skipped with the reason.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from . import recognisers
from .calls import Calls, capture_calls, capture_key, check_calls
from .numeric import REL_TOL, as_eval, compare, device, float32_copy, param_dtype, rel_err
from .recognisers import entry
from .recognisers.diffusers_adaln import (AdaLayerNormContinuousNE, AdaLayerNormZeroNE, AdaLayerNormZeroSingleNE,
                                          SD35AdaLayerNormZeroXNE)
from .recognisers.dit_block import DeferredLayerNorm, _restore_fused, fused_class  # noqa: F401 (old pickles)
from .recognisers.rms_family import RMSNormWithBias, UpcastRMSNorm
from .signature import signature_problem


def _try_swap(name: str, m: nn.Module, report: list, seen: Calls | None = None) -> nn.Module | None:
    """The replacement for `m` (verified), or None; appends a report entry for candidates and
    for modules named like norms. `seen`: the calls of the example forward (capture_calls)."""
    why = recognisers.left_alone(m)
    if why is not None:
        report.append(entry(name, m, "skipped", None, why, math.nan))
        return None
    cands = recognisers.candidates(m)
    if not cands:
        if "Norm" in type(m).__name__ and (name or not any(True for _ in m.children())):
            report.append(entry(name, m, "skipped", None, recognisers.wrapped_norm(m) or
                                "named like a norm but not a recognised RMSNorm / AdaLN-Zero form "
                                "(no 1-D weight with eps/variance_epsilon)", math.nan))
        return None
    calls = (seen or {}).get(capture_key(m))
    dtype, dev = param_dtype(m), device(m)
    ref = float32_copy(m)
    best, fails = (math.inf, None), []
    for op, build, inputs_fn, reason in cands:
        try:
            new32 = as_eval(build(torch.float32))
            problem = signature_problem(m, new32, calls)
            if problem is not None:
                fails.append(f"{reason}: signature: {problem}")
                continue
            err = compare(new32, ref, inputs_fn())
            where = "random input"
            if err <= REL_TOL and calls:
                err, bad_call = check_calls(new32, ref, calls)
                where = f"the inputs it receives in the example forward {bad_call}"
        except Exception as e:  # noqa: BLE001
            fails.append(f"{reason}: check failed ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})")
            continue
        if err <= REL_TOL:
            new = build(dtype).to(dev).train(m.training)
            checked = (f"; checked on random input and on its {len(calls)} call form(s) in the example forward"
                       if calls else "")
            report.append(entry(name, m, "swapped", op, reason + checked, err))
            return new
        fails.append(f"{reason}: rel err {err:.3g} > {REL_TOL:g} on {where}")
        best = min(best, (err, op), key=lambda t: t[0])
    report.append(entry(name, m, "skipped", None, "behaviour differs from every hypothesis: " + "; ".join(fails),
                        best[0]))
    return None


def _walk(module: nn.Module, prefix: str, report: list, seen: Calls | None = None) -> None:
    skip = recognisers.recognise_blocks(module, prefix, report)
    for cname, child in list(module.named_children()):
        if cname in skip:
            continue
        full = f"{prefix}.{cname}" if prefix else cname
        new = _try_swap(full, child, report, seen)
        if new is not None:
            setattr(module, cname, new)
        else:
            _walk(child, full, report, seen)


def structure_copy(module: nn.Module) -> nn.Module:
    """A deep copy of `module`'s module tree that shares its parameters and buffers (docs/design.md §8:
    the weights are held once; swaps replace modules in the copy, they never write into tensors)."""
    memo = {id(t): t for t in list(module.parameters()) + list(module.buffers())}
    # a tensor held as a plain attribute is shared too: torch.nn.utils.weight_norm's `weight`, which its
    # pre-forward hook recomputes from weight_g / weight_v (not a leaf: deepcopy refuses it)
    memo.update({id(t): t for m in module.modules() for t in vars(m).values() if isinstance(t, torch.Tensor)})
    return copy.deepcopy(module, memo)


def prepare(module: nn.Module, report: list | None = None, example_inputs: tuple | None = None) -> nn.Module:
    """A copy of `module` (its module tree; the weights shared) with recognised norm modules
    swapped for normexport modules.

    A swap is kept only when (1) the replacement's forward takes every call the module gets: with
    `example_inputs`, each call form seen in one forward of the model (forward hooks), else the
    same number of positional inputs; (2) its outputs match (float32, rel err <= 1e-5) on random
    input and, with `example_inputs`, on the inputs the module's class received in that forward.
    Otherwise the module is left to the ONNX rewriter. `report`, when given, receives one dict per
    candidate or norm-named module: {"name", "kind", "action": "swapped"|"skipped", "op":
    "RMSNorm"|"AdaLNZero"|None, "reason", "max_rel_err"} (max_rel_err is NaN where no numeric
    check ran, e.g. for standard torch norms); `summary_lines(report)` is what the terminal shows.
    The input module is not modified."""
    if report is None:
        report = []
    new = structure_copy(module)
    seen = capture_calls(new, tuple(example_inputs), report) if example_inputs is not None else None
    root = _try_swap("", new, report, seen)
    if root is not None:
        new = root
    else:
        _walk(new, "", report, seen)
    return new


def summary_lines(report: list[dict]) -> list[str]:
    """Terminal lines for a prepare report: the swaps per class and op, then one line per class of
    candidates left to the rewriter, with the count and the first reason (standard torch norms,
    exported as standard ops by design, are not listed)."""
    entries = [r for r in report if r.get("action") in ("swapped", "skipped", "note") and "kind" in r and "op" in r
               and "lowering" not in r]  # complex lowering entries: said by prepare.complex
    swapped: dict[tuple, int] = {}
    for r in entries:
        if r["action"] == "swapped":
            swapped[(r["kind"], r["op"])] = swapped.get((r["kind"], r["op"]), 0) + 1
    lines = []
    if swapped:
        lines.append("  swapped: " + ", ".join(f"{n} {k} -> {op}" for (k, op), n in swapped.items()))
    skipped: dict[str, list[dict]] = {}
    for r in entries:
        if r["action"] == "skipped" and not r["reason"].startswith("standard torch norm"):
            skipped.setdefault(r["kind"], []).append(r)
    for kind, rs in skipped.items():
        lines.append(f"  not swapped, left to the rewriter: {len(rs)} {kind}: {rs[0]['reason']}")
    lines += [f"  note: {r['reason']}" for r in entries if r["action"] == "note"]
    return lines


__all__ = ["prepare", "capture_calls", "summary_lines", "structure_copy", "rel_err", "REL_TOL", "AdaLayerNormZeroNE",
           "AdaLayerNormZeroSingleNE", "AdaLayerNormContinuousNE", "SD35AdaLayerNormZeroXNE", "DeferredLayerNorm",
           "fused_class", "RMSNormWithBias", "UpcastRMSNorm"]
