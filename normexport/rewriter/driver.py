"""The rewrite loop: per rule module (rules.RULE_MODULES, in order) apply its rules, verify each
rule's effect (site by site when a rule's sites fail together), keep what verifies."""

from __future__ import annotations

import copy
import importlib
import importlib.util

import onnx
import onnx_ir as ir
import onnxscript.optimizer
from onnxscript.rewriter import pattern
from onnxscript.rewriter._basics import MatchStatus

from normexport import ops as _ops
from normexport import sizes as _sizes
from normexport.errors import UsageError, first_line

from ._weights import reweighted, weightless
from .diagnostics import Tracer, record_diagnostics, record_unapplied, where
from .opset import upgrade_opset
from .report import RewriteReport, input_records
from .serialize import serialize
from .verifier import Verifier

TARGETS = ("trt", "ort", "onnx")


def _load_module(name: str):
    full = f"{__package__}.rules.{name}"
    if importlib.util.find_spec(full) is None:
        return None
    return importlib.import_module(full)


def _apply(rules, ir_model: ir.Model, tracer=None) -> int:
    """Apply `rules` to graph and non-normexport functions (never to our own function bodies,
    which contain the very patterns we fuse)."""
    ours = {k: f for k, f in ir_model.functions.items() if f.domain == _ops.DOMAIN}
    for k in ours:
        del ir_model.functions[k]
    try:
        n = pattern.RewriteRuleSet(list(rules)).apply_to_model(ir_model, tracer=tracer)
        if n and tracer is None:
            onnxscript.optimizer.remove_unused_nodes(ir_model)  # constants the fused nodes used
        return n
    finally:
        ir_model.functions.update(ours)


def rewrite(model: onnx.ModelProto, target: str = "trt", verify: bool = True,
            report: RewriteReport | None = None, inputs: dict[str, list[int]] | None = None) -> onnx.ModelProto:
    """Fuse decomposed LayerNorm / RMSNorm / AdaLN (and whatever RULE_MODULES lists) in `model`
    for `target`. Returns a new model; `model` is not mutated. With `verify`, every rule's
    effect is checked in onnxruntime and reverted when outputs differ, at the sizes `inputs`
    gives ({input name: dims}; the others found by normexport.sizes: sizes the model runs at)."""
    from . import RULE_MODULES  # read at call time: tests and tools swap the package's list

    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; use one of {', '.join(TARGETS)}")
    _sizes.check_given(model, inputs)
    if report is None:
        report = RewriteReport()
    report.target, report.verify = target, verify
    report.opset_before = report.opset_after = _ops.default_opset(model)
    report.nodes_before = report.nodes_after = len(model.graph.node)
    try:
        report.inputs = input_records(model, _sizes.candidates(model, inputs)[0])
    except ValueError:
        report.inputs = []

    light, big, fake = weightless(model)
    try:
        light = onnx.shape_inference.infer_shapes(light, data_prop=True)
    except Exception as e:  # noqa: BLE001
        report.notes.append(f"shape inference failed ({first_line(e, 120)}); rules see fewer shapes")
    work = reweighted(light, big, fake)
    verifier = Verifier(model, report, inputs)
    changed = False

    explain = None  # the previous module's explain_unapplied hook, run on the model it left
    for mod_name in RULE_MODULES:
        record_unapplied(explain, work, report)
        explain = None
        mod = _load_module(mod_name)
        if mod is None:
            report.modules[mod_name] = "not installed"
            continue
        if target not in mod.TARGETS:
            report.modules[mod_name] = f"not for target {target}"
            continue
        report.modules[mod_name] = "ok"
        if hasattr(mod, "explain_unapplied"):
            explain = (mod_name, mod.explain_unapplied)
        rules = list(mod.rules_for(target)) if hasattr(mod, "rules_for") else list(mod.RULES)
        if not rules:
            continue
        records = {r.name: report.record(r.name, mod_name) for r in rules}
        ir_model = ir.serde.deserialize_model(work)
        tracer = Tracer()
        _apply(rules, ir_model, tracer)
        if not any(ev[3] == MatchStatus.SUCCESS for ev in tracer.events):
            record_diagnostics(tracer, records)
            continue
        need = mod.required_opset(target) if hasattr(mod, "required_opset") else 0
        if _ops.default_opset(work) < need:
            try:
                upgraded, how = upgrade_opset(work, need)
            except ValueError as e:
                for ev in tracer.events:
                    if ev[3] == MatchStatus.SUCCESS:
                        rec = records[ev[0].name]
                        rec.matched += 1
                        rec.reject(f"failed check: needs opset {need}: {e}", where(ev[1]))
                record_diagnostics(tracer, records)
                continue
            why = verifier.check(upgraded) if verify else None
            if why:
                report.notes.append(f"{mod_name}: opset upgrade to {need} rejected: numeric verification: {why}")
                for ev in tracer.events:
                    if ev[3] == MatchStatus.SUCCESS:
                        records[ev[0].name].matched += 1
                        records[ev[0].name].reject(f"numeric verification: opset upgrade to {need}: {why}", where(ev[1]))
                continue
            report.notes.append(f"{mod_name}: {how}")
            work = upgraded
            ir_model = ir.serde.deserialize_model(work)
            tracer = Tracer()
            _apply(rules, ir_model, tracer)
        record_diagnostics(tracer, records)

        for rule in rules:
            rec = records[rule.name]
            n = _apply([rule], ir_model)
            if n == 0:
                continue
            rec.matched += n
            candidate, why = _try(ir_model, verifier, verify)
            if candidate is not None:
                rec.applied += n
                work, changed = candidate, True
                continue
            ir_model = ir.serde.deserialize_model(work)
            sites = _sites(rule, ir_model) if n > 1 else []
            if len(sites) < 2:
                rec.reject(f"numeric verification: {why}", f"{n} site(s)")
                continue
            # one site spoiled the lot: keep every site that verifies on its own
            for site in sites:
                if _apply([_only_at(rule, site)], ir_model) == 0:
                    continue
                candidate, why1 = _try(ir_model, verifier, verify)
                if candidate is not None:
                    rec.applied += 1
                    work, changed = candidate, True
                else:
                    rec.reject(f"numeric verification: {why1}", f"{site[0]} -> {', '.join(site[1])}")
                    ir_model = ir.serde.deserialize_model(work)
    record_unapplied(explain, work, report)

    if not changed:
        work = onnx.ModelProto()
        work.CopyFrom(model)
    marked = _ops.mark_plugin_nodes(work)  # nodes from other tools may lack them; ours have them
    if marked:
        report.notes.append(f"added plugin_namespace / plugin_version to {marked} normexport node(s) "
                            "so that TensorRT's ONNX parser runs the plugin rather than the function body")
    report.opset_after = _ops.default_opset(work)
    report.nodes_after = len(work.graph.node)
    return work


def _try(ir_model: ir.Model, verifier: Verifier, verify: bool) -> tuple[onnx.ModelProto | None, str | None]:
    """(the serialized candidate, None) when it verifies, else (None, the reason)."""
    try:
        candidate = serialize(ir_model)
        why = verifier.check(candidate) if verify else None
    except UsageError:  # the --input sizes do not fit the model
        raise
    except Exception as e:  # noqa: BLE001 - e.g. attach_functions refusing a mixed form
        why = f"rewritten model invalid: {first_line(e, 200)}"
    return (candidate, None) if why is None else (None, why)


def _site(node: ir.Node) -> tuple[str, tuple[str, ...]]:
    """A match site by its root node, stable across serialize / deserialize: op and output names."""
    return node.op_type, tuple(o.name or "" for o in node.outputs)


def _sites(rule, ir_model: ir.Model) -> list[tuple[str, tuple[str, ...]]]:
    """Where `rule` would rewrite (a dry run: the rewriter does not rewrite under a tracer)."""
    tracer = Tracer()
    _apply([rule], ir_model, tracer)
    return list(dict.fromkeys(_site(node) for _, node, _, status in tracer.events if status == MatchStatus.SUCCESS))


def _only_at(rule, site):
    """A copy of `rule` whose check also requires the match's root to be `site`."""
    one = copy.copy(rule)
    check = rule._condition_function

    def condition(context, **bindings):
        if _site(context.root) != site:
            return pattern.MatchResult().fail("not the site being verified")
        return check(context, **bindings)

    one._condition_function = condition
    return one
