"""normexport.rewriter — the engine behind normexport.rewrite(): fuse decomposed normalisation patterns in any ONNX file.

The driver loads every module named in `rules.RULE_MODULES` (in that order) and, per rule:
apply it (onnxscript rewriter) -> run original and rewritten graphs in onnxruntime on random
inputs -> keep the result only if every output agrees within DESIGN §7, else revert and record
"numeric verification: ...". A diagnostic pass before each module records pattern near-misses
and failed checks, so the report says why something was not fused.

Optional hooks a rule module may define besides RULES / TARGETS (rules/__init__.py):
    rules_for(target) -> list[RewriteRule]   rules for that target (default: RULES)
    required_opset(target) -> int            default-domain opset the replacements need; the
                                             driver upgrades the model first when a rule matches
    explain_unapplied(ModelProto) -> [(ir node, reason)]   after the module ran: the nodes it is about
                                             that are still there, and why (reported as skipped)
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import os
import shutil
import tempfile
from typing import Any

import onnx
import onnx_ir as ir
import onnxscript.optimizer
from onnxscript.rewriter import pattern
from onnxscript.rewriter._basics import MatchingTracer, MatchStatus

import normexport
from normexport import ops as _ops
from normexport import sizes as _sizes
from normexport.errors import UsageError, first_line

from . import _verify
from .rules import RULE_MODULES

TARGETS = ("trt", "ort", "onnx")
_TWO_GB = 2**31
_NEAR_MISS_NODES = 3  # a failed match that got this many nodes in is a "pattern near-miss"
_OTHER_USES = "Matched nodes have other uses preventing replacement."


# ---- report ----------------------------------------------------------------------------------
@dataclasses.dataclass
class RuleRecord:
    name: str
    module: str
    matched: int = 0
    applied: int = 0
    rejected: list[dict[str, str]] = dataclasses.field(default_factory=list)

    def reject(self, reason: str, where: str = "") -> None:
        self.rejected.append({"reason": reason, "node": where})


@dataclasses.dataclass
class RewriteReport:
    target: str = "trt"
    verify: bool = True
    rules: dict[str, RuleRecord] = dataclasses.field(default_factory=dict)
    modules: dict[str, str] = dataclasses.field(default_factory=dict)
    opset_before: int = 0
    opset_after: int = 0
    nodes_before: int = 0
    nodes_after: int = 0
    inputs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    sizes: str = ""  # where the input sizes came from (normexport.sizes), "" while not run
    verification: list[_verify.Comparison] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def record(self, rule_name: str, module: str) -> RuleRecord:
        if rule_name not in self.rules:
            self.rules[rule_name] = RuleRecord(rule_name, module)
        return self.rules[rule_name]

    @property
    def applied(self) -> int:
        return sum(r.applied for r in self.rules.values())

    def fused_ops(self) -> dict[str, int]:
        by_module: dict[str, int] = {}
        for r in self.rules.values():
            by_module[r.module] = by_module.get(r.module, 0) + r.applied
        return by_module

    def to_dict(self) -> dict[str, Any]:
        return {
            "normexport_version": normexport.__version__,
            "command": "rewrite",
            "target": self.target,
            "verify": self.verify,
            "inputs": [{"name": i["name"], "shape": i["shape"], "dtype": i["dtype"]} for i in self.inputs],
            "sizes": self.sizes or "not run (nothing to verify)",
            "opset": {"before": self.opset_before, "after": self.opset_after},
            "nodes": {"before": self.nodes_before, "after": self.nodes_after},
            "modules": dict(self.modules),
            "rules": [
                {"name": r.name, "module": r.module, "matched": r.matched, "applied": r.applied,
                 "rejected": list(r.rejected)}
                for r in self.rules.values()
            ],
            # the reference here is the original graph run in onnxruntime (CPU)
            "backends": {"ort": {c.output: c.to_dict() for c in self.verification}} if self.verification else {},
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        lines = [f"normexport rewrite (target {self.target}, verify {'on' if self.verify else 'off'}): "
                 f"{self.applied} fusion(s), nodes {self.nodes_before} -> {self.nodes_after}, "
                 f"opset {self.opset_before} -> {self.opset_after}"]
        for r in self.rules.values():
            if not (r.matched or r.applied or r.rejected):
                continue
            reasons: dict[str, int] = {}
            for rej in r.rejected:
                reasons[rej["reason"]] = reasons.get(rej["reason"], 0) + 1
            why = "; ".join(f"{k} x{v}" if v > 1 else k for k, v in reasons.items())
            lines.append(f"  {r.module}/{r.name}: matched {r.matched}, applied {r.applied}"
                         + (f", rejected: {why}" if why else ""))
        for m, status in self.modules.items():
            if status != "ok" and not status.startswith("not for target"):  # (those stay in the JSON report)
                lines.append(f"  module {m}: {status}")
        if self.sizes:
            lines.append(f"  verified at {_sizes.describe({i['name']: i['shape'] for i in self.inputs})} ({self.sizes})")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


# ---- helpers ---------------------------------------------------------------------------------
class _Tracer(MatchingTracer):
    """Keeps every successful / check-failed match and every near-miss (not just the best)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[Any, ir.Node, Any, MatchStatus]] = []

    def log(self, rule, container, node, match_result, status) -> None:  # noqa: D401
        if status == MatchStatus.NO_MATCH and len(match_result.nodes) < _NEAR_MISS_NODES:
            return
        self.events.append((rule, node, match_result, status))


def _where(node: ir.Node) -> str:
    out = node.outputs[0].name if node.outputs else ""
    return f"{node.op_type}{'(' + node.name + ')' if node.name else ''} -> {out}"


def _load_module(name: str):
    full = f"{__name__}.rules.{name}"
    if importlib.util.find_spec(full) is None:
        return None
    return importlib.import_module(full)


def _all_nodes(model: onnx.ModelProto):
    def walk(graph):
        for n in graph.node:
            yield n
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    yield from walk(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for g in a.graphs:
                        yield from walk(g)

    yield from walk(model.graph)


def _set_default_opset(model: onnx.ModelProto, version: int) -> None:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = version
            return
    model.opset_import.append(onnx.helper.make_opsetid("", version))


def upgrade_opset(model: onnx.ModelProto, version: int) -> tuple[onnx.ModelProto, str]:
    """A copy of `model` importing default-domain opset `version`. Bumps the import when every
    op the model uses has the same schema at both versions, else uses onnx.version_converter.
    Raises ValueError when neither is possible."""
    old = _ops.default_opset(model)
    bump = True
    for n in _all_nodes(model):
        if n.domain not in ("", "ai.onnx"):
            continue
        try:
            schema = onnx.defs.get_schema(n.op_type, version, "")
        except onnx.defs.SchemaError:
            bump = False
            break
        if schema.since_version > old:
            bump = False
            break
    if bump:
        out = onnx.ModelProto()
        out.CopyFrom(model)
        _set_default_opset(out, version)
        return out, f"opset import bumped {old} -> {version} (no op changed in between)"
    light, big, fake = _weightless(model)
    try:
        out = onnx.version_converter.convert_version(light, version)
    except Exception as e:  # noqa: BLE001 - the converter raises many kinds
        raise ValueError(f"onnx.version_converter {old} -> {version} failed: {first_line(e, 200)}") from e
    return _reweighted(out, big, fake), f"opset converted {old} -> {version} with onnx.version_converter"


#: initializers larger than this stay out of the model while onnx's C++ passes (shape inference,
#: version converter) run: each round-trips the whole proto through C++ several times, which with
#: the weights in made rewriting a 480 MB model peak at 7x its size in memory
_LIGHT_BYTES = 1024


def _weightless(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[onnx.TensorProto], set[str]]:
    """(a copy of `model` whose large initializers are graph inputs of the same type and shape,
    those initializers, the names of the inputs added for them)."""
    g = model.graph
    big = [t for t in g.initializer if t.data_location == onnx.TensorProto.EXTERNAL or t.ByteSize() > _LIGHT_BYTES]
    names = {t.name for t in big}
    light = onnx.ModelProto()
    for fd, value in model.ListFields():
        if fd.name != "graph":
            _copy_field(light, fd, value)
    for fd, value in g.ListFields():
        if fd.name != "initializer":
            _copy_field(light.graph, fd, value)
    light.graph.initializer.extend(t for t in g.initializer if t.name not in names)
    declared = {i.name for i in g.input}
    fake = {t.name for t in big if t.name not in declared}
    light.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                             for t in big if t.name in fake)
    return light, big, fake


def _copy_field(dst, fd, value) -> None:
    if fd.is_repeated:
        getattr(dst, fd.name).extend(value)
    elif fd.message_type is not None:
        getattr(dst, fd.name).CopyFrom(value)
    else:
        setattr(dst, fd.name, value)


def _reweighted(light: onnx.ModelProto, big: list[onnx.TensorProto], fake: set[str]) -> onnx.ModelProto:
    """`light` (in place) with the initializers `_weightless` took out back in."""
    if big:
        inputs = [i for i in light.graph.input if i.name not in fake]
        del light.graph.input[:]
        light.graph.input.extend(inputs)
        light.graph.initializer.extend(big)
    return light


class _Verifier:
    def __init__(self, original: onnx.ModelProto, report: RewriteReport, given=None) -> None:
        self.original = original
        self.report = report
        self.given = given
        self._ref: dict | None = None
        self._feeds: dict | None = None
        self._error: str | None = None

    def _prepare(self) -> None:
        if self._ref is not None or self._error is not None:
            return
        try:
            found = _sizes.find(self.original, self.given)
        except Exception as e:  # noqa: BLE001
            self._error = f"cannot run the original model: {first_line(e, 300)}"
            return
        self._feeds, self._ref = found.feeds, found.outputs
        self.report.inputs = _input_records(self.original, found.shapes)
        self.report.sizes = found.how

    def check(self, candidate: onnx.ModelProto) -> str | None:
        """None when `candidate` agrees with the original, else the reason."""
        self._prepare()
        if self._error:
            return self._error
        try:
            got = _verify.run(candidate, self._feeds)
        except Exception as e:  # noqa: BLE001
            return f"rewritten model does not run: {first_line(e, 200)}"
        comps = _verify.compare(self._ref, got)
        if all(c.passed for c in comps):
            self.report.verification = comps
            return None
        return _verify.describe_failure(comps)


def _input_records(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> list[dict[str, Any]]:
    return [{"name": i.name, "shape": list(shapes[i.name]), "elem_type": i.elem_type,
             "dtype": onnx.helper.tensor_dtype_to_string(i.elem_type).replace("TensorProto.", "").lower()}
            for i in _sizes.real_inputs(model) if i.name in shapes]


def _one_adaln_form(ir_model: ir.Model) -> None:
    """attach_functions wants one arity per op: when AdaLNZero nodes with and without affine are
    mixed, give the ones without an explicit weight = 1 / bias = 0 (the same math)."""
    import numpy as np

    nodes = [n for n in ir_model.graph if n.domain == _ops.DOMAIN and n.op_type == "AdaLNZero"]
    if len({len(n.inputs) for n in nodes}) < 2:
        return
    for n in nodes:
        x = n.inputs[0]
        if len(n.inputs) != 3 or x.shape is None or not isinstance(x.shape[-1], int) or x.dtype is None:
            continue
        extra = []
        for tag, v in (("unit_weight", 1.0), ("zero_bias", 0.0)):
            name = f"{n.outputs[0].name}__{tag}"
            t = ir.tensor(np.full([x.shape[-1]], v, dtype=x.dtype.numpy()), name=name)
            val = ir.Value(name=name, shape=ir.Shape([x.shape[-1]]), type=ir.TensorType(x.dtype), const_value=t)
            ir_model.graph.register_initializer(val)
            extra.append(val)
        n.resize_inputs(5)
        n.replace_input_with(3, extra[0])
        n.replace_input_with(4, extra[1])


def _serialize(ir_model: ir.Model) -> onnx.ModelProto:
    _one_adaln_form(ir_model)
    proto = ir.serde.serialize_model(ir_model)
    if _ops.custom_nodes(proto):
        _ops.attach_functions(proto)
    return proto


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


# ---- the driver ------------------------------------------------------------------------------
def rewrite(model: onnx.ModelProto, target: str = "trt", verify: bool = True,
            report: RewriteReport | None = None, inputs: dict[str, list[int]] | None = None) -> onnx.ModelProto:
    """Fuse decomposed LayerNorm / RMSNorm / AdaLN (and whatever RULE_MODULES lists) in `model`
    for `target`. Returns a new model; `model` is not mutated. With `verify`, every rule's
    effect is checked in onnxruntime and reverted when outputs differ, at the sizes `inputs`
    gives ({input name: dims}; the others found by normexport.sizes: sizes the model runs at)."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; use one of {', '.join(TARGETS)}")
    _sizes.check_given(model, inputs)
    if report is None:
        report = RewriteReport()
    report.target, report.verify = target, verify
    report.opset_before = report.opset_after = _ops.default_opset(model)
    report.nodes_before = report.nodes_after = len(model.graph.node)
    try:
        report.inputs = _input_records(model, _sizes.candidates(model, inputs)[0])
    except ValueError:
        report.inputs = []

    light, big, fake = _weightless(model)
    try:
        light = onnx.shape_inference.infer_shapes(light, data_prop=True)
    except Exception as e:  # noqa: BLE001
        report.notes.append(f"shape inference failed ({first_line(e, 120)}); rules see fewer shapes")
    work = _reweighted(light, big, fake)
    verifier = _Verifier(model, report, inputs)
    changed = False

    explain = None  # the previous module's explain_unapplied hook, run on the model it left
    for mod_name in RULE_MODULES:
        _record_unapplied(explain, work, report)
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
        tracer = _Tracer()
        _apply(rules, ir_model, tracer)
        if not any(ev[3] == MatchStatus.SUCCESS for ev in tracer.events):
            _record_diagnostics(tracer, records)
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
                        rec.reject(f"failed check: needs opset {need}: {e}", _where(ev[1]))
                _record_diagnostics(tracer, records, successes=False)
                continue
            why = verifier.check(upgraded) if verify else None
            if why:
                report.notes.append(f"{mod_name}: opset upgrade to {need} rejected: numeric verification: {why}")
                for ev in tracer.events:
                    if ev[3] == MatchStatus.SUCCESS:
                        records[ev[0].name].matched += 1
                        records[ev[0].name].reject(f"numeric verification: opset upgrade to {need}: {why}", _where(ev[1]))
                continue
            report.notes.append(f"{mod_name}: {how}")
            work = upgraded
            ir_model = ir.serde.deserialize_model(work)
            tracer = _Tracer()
            _apply(rules, ir_model, tracer)
        _record_diagnostics(tracer, records, successes=False)

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
    _record_unapplied(explain, work, report)

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


def _try(ir_model: ir.Model, verifier: "_Verifier", verify: bool) -> tuple[onnx.ModelProto | None, str | None]:
    """(the serialized candidate, None) when it verifies, else (None, the reason)."""
    try:
        candidate = _serialize(ir_model)
        why = verifier.check(candidate) if verify else None
    except Exception as e:  # noqa: BLE001 - e.g. attach_functions refusing a mixed form
        why = f"rewritten model invalid: {first_line(e, 200)}"
    return (candidate, None) if why is None else (None, why)


def _site(node: ir.Node) -> tuple[str, tuple[str, ...]]:
    """A match site by its root node, stable across serialize / deserialize: op and output names."""
    return node.op_type, tuple(o.name or "" for o in node.outputs)


def _sites(rule, ir_model: ir.Model) -> list[tuple[str, tuple[str, ...]]]:
    """Where `rule` would rewrite (a dry run: the rewriter does not rewrite under a tracer)."""
    tracer = _Tracer()
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


def _record_unapplied(explain, work: onnx.ModelProto, report: RewriteReport) -> None:
    """Run a module's explain_unapplied hook (`explain` = (module name, hook), or None: nothing to
    do): the nodes it left in place, with its reason, unless a rule of it already said why."""
    if explain is None:
        return
    mod_name, hook = explain
    said = {r["node"] for rec in report.rules.values() if rec.module == mod_name for r in rec.rejected
            if r["reason"] != "pattern near-miss"}
    rec = None
    for node, why in hook(work):
        where = _where(node)
        if where in said:
            continue
        rec = rec or report.record("skipped", mod_name)
        rec.reject(f"skipped: {why}", where)


def _record_diagnostics(tracer: _Tracer, records: dict[str, RuleRecord], successes: bool = False) -> None:
    """Failed checks and near-misses, one per root node (the best-scoring rule), skipping nodes
    that some rule of the module matches successfully."""
    covered: set[int] = set()
    for rule, node, mr, status in tracer.events:
        if status == MatchStatus.SUCCESS:
            covered.update(id(n) for n in mr.nodes)
    best: dict[int, tuple[int, Any, ir.Node, Any, MatchStatus]] = {}
    for rule, node, mr, status in tracer.events:
        if status == MatchStatus.SUCCESS or id(node) in covered:
            continue
        score = len(mr.nodes) + 100 * int(status.value)
        if mr.reason == _OTHER_USES:
            score += 100
        if id(node) not in best or score > best[id(node)][0]:
            best[id(node)] = (score, rule, node, mr, status)
    for _, rule, node, mr, status in best.values():
        rec = records[rule.name]
        if status == MatchStatus.CONDITION_FAILED:
            rec.matched += 1
            rec.reject(f"failed check: {mr.reason or 'condition not met'}", _where(node))
        elif mr.reason == _OTHER_USES:
            rec.matched += 1
            rec.reject("failed check: an intermediate value is used outside the pattern (or is a graph output)", _where(node))
        else:
            rec.reject("pattern near-miss", _where(node))


# ---- files -----------------------------------------------------------------------------------
def _has_external_data(model: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in _iter_tensors(model))


def _iter_tensors(model: onnx.ModelProto):
    yield from model.graph.initializer
    for n in _all_nodes(model):
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                yield a.t


def rewrite_file(in_path: str | os.PathLike, out_path: str | os.PathLike, target: str = "trt",
                 verify: bool = True, report_path: str | os.PathLike | None = None,
                 inputs: list[str] | dict[str, list[int]] | None = None) -> RewriteReport:
    """Load `in_path` (with its external data), rewrite, write `out_path` atomically (external
    data next to it when the input had external data or the result exceeds 2 GB). `inputs`: the
    sizes to verify at, as `--input NAME:DIMS[:DTYPE]` texts or {name: dims}."""
    import json

    in_path, out_path = os.fspath(in_path), os.fspath(out_path)
    if not os.path.isfile(in_path):
        raise UsageError(f"{in_path}: no such file; pass an existing .onnx file")
    try:
        model = onnx.load(in_path, load_external_data=False)
        external = _has_external_data(model)
        if external:
            onnx.load_external_data_for_model(model, os.path.dirname(os.path.abspath(in_path)))
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"{in_path}: not a readable ONNX model ({first_line(e, 120)}); pass a valid .onnx file") from e
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise UsageError(f"{out_path}: cannot write there; choose an existing writable folder with -o")
    if inputs is not None and not isinstance(inputs, dict):
        inputs = _sizes.parse_inputs(model, list(inputs))
    report = RewriteReport()
    result = rewrite(model, target=target, verify=verify, report=report, inputs=inputs)
    big = result.ByteSize() >= _TWO_GB if not external else True
    try:
        tmpdir = tempfile.mkdtemp(prefix=".normexport-", dir=out_dir)
        try:
            base = os.path.basename(out_path)
            tmp_model = os.path.join(tmpdir, base)
            if big:
                data_name = base + ".data"
                onnx.save_model(result, tmp_model, save_as_external_data=True, all_tensors_to_one_file=True,
                                location=data_name, size_threshold=0 if external else 1024)
                if os.path.exists(os.path.join(tmpdir, data_name)):
                    os.replace(os.path.join(tmpdir, data_name), os.path.join(out_dir, data_name))
            else:
                onnx.save_model(result, tmp_model)
            os.replace(tmp_model, os.path.abspath(out_path))
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
    except OSError as e:
        raise UsageError(f"{out_path}: cannot write ({e.strerror}); choose a writable path with -o") from e
    if report_path is not None:
        rp = os.fspath(report_path)
        try:
            tmp = rp + ".tmp"
            with open(tmp, "w") as f:
                json.dump(report.to_dict(), f, indent=2)
            os.replace(tmp, rp)
        except OSError as e:
            raise UsageError(f"{rp}: cannot write the report ({e.strerror}); choose a writable path") from e
    return report


__all__ = ["rewrite", "rewrite_file", "RewriteReport", "RuleRecord", "upgrade_opset", "TARGETS"]
