"""MoE experts and attention switched to implementations the exporters take (docs/design.md §9, issue 22).

transformers picks how a model runs its experts and its attention from the config
(`config._experts_implementation`, `config._attn_implementation`), and offers setters for both
(`PreTrainedModel.set_experts_implementation` / `set_attn_implementation`). Its defaults are
chosen for speed, not export:

* experts "grouped_mm" (the default for every class decorated `@use_experts_implementation`:
  Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, ...) sorts the tokens by expert and calls
  `torch.nn.functional.grouped_mm`, or under torch.export the custom op
  `transformers::grouped_mm_fallback`; neither has an ONNX translation ("No ONNX function found
  for transformers.grouped_mm_fallback"), and the TorchScript exporter fails on `aten::diff`.
  "eager" loops over the experts a batch hits (`nonzero()`: a data-dependent loop torch.export
  rejects and tracing would bake). "batched_mm" gathers each token's expert weights and runs
  `bmm`: standard ops, static shapes, the same arithmetic. It is the one taken here.
* attention "flash_attention_*", "flex_attention", "paged|..." or a hub kernel: not exportable
  (custom kernels, higher-order ops); "sdpa" is (torch.onnx writes Attention / its decomposition),
  else "eager".

`exportable_implementations(module, example_inputs, report)` finds every transformers model in
`module` (the module itself, one inside a call adapter, sub-models with their own config) and
switches what is not exportable, through transformers' own setters, driven by what the config and
the class expose (no list of families). With example inputs the switched model is compared with
the same model on transformers' "eager" implementations (reference loops / attention math that
run anywhere); the switch is kept only if the outputs agree (max |diff| <= 1e-4 x max |eager|),
otherwise it is reverted and the report says why. The switch is made in place (the configs the
model's modules share) unless `inplace=False` (then on a copy of the module tree, weights shared).

Report entries: {"model", "what": "experts"|"attention", "from", "to", "action":
"switched"|"reverted"|"failed", "reason", "max_rel_err"}; `summary_lines(report)` is what the
terminal shows.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

#: experts implementations whose forward torch.export traces into standard ops (first: the one taken)
EXPORTABLE_EXPERTS = ("batched_mm",)
#: attention implementations the exporters take (first: the one taken)
EXPORTABLE_ATTENTION = ("sdpa", "eager")
#: a switch is kept when the model's outputs move by at most this, relative to max |output|
SWITCH_TOL = 1e-4


def _pretrained_models(module: nn.Module) -> list[nn.Module]:
    """transformers models in `module` (PreTrainedModel-like: a config and the setters), outermost
    first; a sub-model sharing its parent's config class is handled by the parent's setter."""
    out = []
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is None or not hasattr(m, "set_attn_implementation") and not hasattr(m, "set_experts_implementation"):
            continue
        out.append(m)
    return out


def _experts_modules(module: nn.Module) -> list[nn.Module]:
    """Experts modules dispatched by config._experts_implementation (transformers'
    `@use_experts_implementation` sets these attributes on them)."""
    return [m for m in module.modules()
            if hasattr(m, "_is_expert_parallel") and hasattr(m, "has_gate")
            and hasattr(getattr(m, "config", None), "_experts_implementation")]


def _experts_choice() -> str | None:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except Exception:  # noqa: BLE001 - a transformers without switchable experts
        return None
    return next((k for k in EXPORTABLE_EXPERTS if k in ALL_EXPERTS_FUNCTIONS), None)


def _why_experts(impl: str | None) -> str:
    if impl == "grouped_mm":
        return ("grouped_mm (torch grouped_mm / the custom op transformers::grouped_mm_fallback) has no ONNX "
                "translation")
    if impl == "eager":
        return "eager loops over the experts a batch hits (data-dependent: torch.export rejects it, tracing bakes it)"
    return f"{impl} runs custom kernels no exporter translates"


class _Switch:
    """One switch: `set(impl)` applies an implementation; `original`, `choice` and the report entry."""

    def __init__(self, setter, original, choice, entry):
        self.set, self.original, self.choice, self.entry = setter, original, choice, entry


def _model_setter(m, method: str):
    def set_(impl):
        getattr(m, method)(impl)
    return set_


def _config_setter(cfg):
    def set_(impl):
        cfg._experts_implementation_internal = impl
    return set_


def _switch_experts(models, experts, report: list) -> list[_Switch]:
    """Switch non-exportable experts (transformers' setter per model, else the experts' config)."""
    done: list[_Switch] = []
    bad = [e for e in experts if e.config._experts_implementation not in EXPORTABLE_EXPERTS]
    if not bad:
        return done
    choice = _experts_choice()
    if choice is None:
        report.append(_entry(type(bad[0]).__name__, "experts", bad[0].config._experts_implementation, None, "failed",
                             "this transformers has no batched_mm experts implementation: the export will "
                             "likely fail on the experts", math.nan))
        return done
    for m in models:
        cur = getattr(m.config, "_experts_implementation", None)
        can = getattr(m, "_can_set_experts_implementation", None)
        if cur is None or cur in EXPORTABLE_EXPERTS or not callable(can) or not can() \
                or not any(e.config is m.config for e in bad):
            continue
        try:
            m.set_experts_implementation(choice)
        except Exception as e:  # noqa: BLE001 - the setter refused (say so; the configs below are tried)
            report.append(_entry(type(m).__name__, "experts", cur, choice, "failed",
                                 f"set_experts_implementation refused: {type(e).__name__}: {e}", math.nan))
            continue
        report.append(_entry(type(m).__name__, "experts", cur, choice, "switched", _why_experts(cur), math.nan))
        done.append(_Switch(_model_setter(m, "set_experts_implementation"), cur, choice, report[-1]))
    for e in experts:  # an experts config no model's setter reached (a bare experts module, a sub-config)
        cur = e.config._experts_implementation
        if cur in EXPORTABLE_EXPERTS:
            continue
        e.config._experts_implementation_internal = choice
        report.append(_entry(type(e).__name__, "experts", cur, choice, "switched", _why_experts(cur), math.nan))
        done.append(_Switch(_config_setter(e.config), cur, choice, report[-1]))
    return done


def _switch_attention(models, report: list) -> list[_Switch]:
    done: list[_Switch] = []
    seen: set[int] = set()
    for m in models:
        cfg = m.config
        cur = getattr(cfg, "_attn_implementation", None)
        if id(cfg) in seen or cur is None or cur in EXPORTABLE_ATTENTION or not hasattr(m, "set_attn_implementation"):
            seen.add(id(cfg))
            continue
        seen.add(id(cfg))
        errors = []
        for choice in EXPORTABLE_ATTENTION:
            try:
                m.set_attn_implementation(choice)
            except Exception as e:  # noqa: BLE001 - e.g. a class without sdpa support: eager next
                errors.append(f"{choice}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
                continue
            report.append(_entry(type(m).__name__, "attention", cur, choice, "switched",
                                 f"{cur} runs kernels no exporter translates", math.nan))
            done.append(_Switch(_model_setter(m, "set_attn_implementation"), cur, choice, report[-1]))
            break
        else:
            report.append(_entry(type(m).__name__, "attention", cur, None, "failed",
                                 "set_attn_implementation refused " + "; ".join(errors), math.nan))
    return done


def _entry(model, what, frm, to, action, reason, err) -> dict:
    return {"model": model, "what": what, "from": frm, "to": to, "action": action, "reason": reason,
            "max_rel_err": float(err)}


def _run(module: nn.Module, inputs: tuple):
    with torch.no_grad():
        return module(*inputs)


def _first(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def exportable_implementations(module: nn.Module, example_inputs: tuple | None = None,
                               report: list | None = None, inplace: bool = True) -> nn.Module:
    """Switch the transformers experts and attention implementations in `module` that no
    exporter takes to ones that they do (see the module docstring); returns the module switched:
    `module` itself, or with `inplace=False` a copy of its module tree (weights shared) when
    anything is switched.

    With `example_inputs`, the switched model is compared with the same model running
    transformers' "eager" implementations (its reference loops and attention math, which run
    anywhere, unlike flash / flex kernels): a switch whose outputs differ by more than SWITCH_TOL
    (relative to max|output|) is reverted and reported."""
    from .swap import rel_err, structure_copy

    report = report if report is not None else []
    experts = _experts_modules(module)
    models = _pretrained_models(module)
    pending = [e for e in experts if e.config._experts_implementation not in EXPORTABLE_EXPERTS]
    pending += [m for m in models if getattr(m.config, "_attn_implementation", None) not in (None, *EXPORTABLE_ATTENTION)]
    if not pending:
        return module
    if not inplace:
        module = structure_copy(module)
        models, experts = _pretrained_models(module), _experts_modules(module)
    switches = _switch_experts(models, experts, report) + _switch_attention(models, report)
    if not switches or example_inputs is None:
        return module
    try:
        after = _run(module, example_inputs)
        for sw in switches:
            sw.set("eager")
        try:
            ref = _run(module, example_inputs)
        finally:
            for sw in switches:
                sw.set(sw.choice)
        err = rel_err(after, ref)
        problem = None if err <= SWITCH_TOL else f"outputs differ from transformers' eager implementations by " \
                                                 f"{err:.3g} x max|output| (> {SWITCH_TOL:g})"
    except Exception as e:  # noqa: BLE001
        err, problem = math.inf, f"the switched model failed: {_first(e)}"
    for sw in switches:
        sw.entry["max_rel_err"] = float(err)
    if problem is not None:
        for sw in reversed(switches):
            sw.set(sw.original)
            sw.entry["action"], sw.entry["reason"] = "reverted", f"{sw.entry['reason']}; switch reverted: {problem}"
    return module


def summary_lines(report: list[dict]) -> list[str]:
    """One terminal line per (model, what) switched, reverted or refused."""
    lines, seen = [], set()
    for r in report:
        key = (r["model"], r["what"], r["from"], r["to"], r["action"])
        if key in seen:
            continue
        seen.add(key)
        n = sum(1 for x in report if (x["model"], x["what"], x["from"], x["to"], x["action"]) == key)
        who = f"{r['model']}" + (f" (x{n})" if n > 1 else "")
        if r["action"] == "switched":
            err = "" if math.isnan(r["max_rel_err"]) else f"; equal to transformers' eager to {r['max_rel_err']:.2g} of max|output|"
            lines.append(f"  {r['what']}: {who} {r['from']} -> {r['to']} for export ({r['reason']}{err})")
        else:
            lines.append(f"  {r['what']}: {who} kept {r['from']} ({r['action']}: {r['reason']})")
    return lines


__all__: list[Any] = ["exportable_implementations", "summary_lines", "EXPORTABLE_EXPERTS", "EXPORTABLE_ATTENTION",
                      "SWITCH_TOL"]
