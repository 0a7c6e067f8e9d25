"""The rewrite loop: per rule module (rules.RULE_MODULES, in order) apply its rules on the onnx-ir
model; every match is verified locally (local.py: the matched subgraph against its replacement,
vs float64) before it is applied, so the model never leaves onnx-ir and its weights are never
copied or serialised whole (docs/design.md §8). A whole-model comparison in onnxruntime runs as an extra
where the model is small enough."""

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

from . import canonical
from .diagnostics import Tracer, record_diagnostics, record_unapplied, where
from .local import LocalVerifier, concrete_shapes, probe_ir, probe_shapes
from .opset import model_opset, upgrade_opset
from . import switches
from .report import RewriteReport, input_records, norm_node_counts
from .serialize import finish
from .verifier import Verifier

TARGETS = ("trt", "ort", "onnx")
#: the whole-model comparison (an extra beside the local checks) runs when the weights are at most
#: this large: it holds the original and the rewritten model in onnxruntime at once
WHOLE_MODEL_LIMIT = 256 << 20


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


def weight_bytes(model: ir.Model) -> int:
    """Bytes of the model's initializers (lazy external tensors are not read)."""
    total = 0
    for v in model.graph.initializers.values():
        t = v.const_value
        if t is not None:
            try:
                total += t.nbytes
            except Exception:  # noqa: BLE001 - a tensor without a size
                pass
    return total


def interface(model: ir.Model) -> onnx.ModelProto:
    """The model's graph inputs and outputs alone (no nodes, no weights): what normexport.sizes
    reads to check --input sizes."""
    inits = set(model.graph.initializers)
    ins = [ir.serde.serialize_value(v) for v in model.graph.inputs if v.name not in inits]
    outs = [ir.serde.serialize_value(v) for v in model.graph.outputs]
    graph = onnx.helper.make_graph([], model.graph.name or "g", ins, outs)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()])


def rewrite(model, target: str = "trt", verify: bool = True, report: RewriteReport | None = None,
            inputs: dict[str, list[int]] | None = None, off: dict[str, str] | None = None):
    """Fuse decomposed LayerNorm / RMSNorm / AdaLN (and whatever RULE_MODULES lists) for `target`.

    `model`: an onnx.ModelProto (not mutated; a new ModelProto is returned) or an onnx_ir.Model
    (rewritten in place and returned; weights stay where they are, lazy or memory-mapped).
    With `verify`, each fusion is verified locally before it is applied (docs/design.md §8) and, for
    models of at most WHOLE_MODEL_LIMIT bytes of weights, the result is also compared with the
    original as a whole in onnxruntime at the sizes `inputs` gives ({input name: dims}; else
    sizes the model runs at, found by normexport.sizes). `off`: {rule module: the flag that turned
    it off} (switches.from_flags); those modules do not run and the report says why."""
    if isinstance(model, onnx.ModelProto):
        ir_model = ir.serde.deserialize_model(model)  # shares the proto's tensor bytes
        report = report if report is not None else RewriteReport()
        out = rewrite_ir(ir_model, target, verify, report, inputs, original=model, off=off)
        if report.applied:
            return ir.serde.serialize_model(out)
        same = onnx.ModelProto()  # nothing fused: the model as it came (plugin attributes added)
        same.CopyFrom(model)
        _ops.mark_plugin_nodes(same)
        report.opset_after = report.opset_before
        return same
    return rewrite_ir(model, target, verify, report, inputs, off=off)


def rewrite_ir(model: ir.Model, target: str = "trt", verify: bool = True, report: RewriteReport | None = None,
               inputs: dict[str, list[int]] | None = None, original: onnx.ModelProto | None = None,
               off: dict[str, str] | None = None) -> ir.Model:
    """rewrite() on an onnx_ir model; returns the rewritten model (the same object unless an opset
    conversion had to build a new one). `original`: the model as a proto, when the caller has it
    (for the whole-model extra)."""
    from . import RULE_MODULES  # read at call time: tests and tools swap the package's list

    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; use one of {', '.join(TARGETS)}")
    if not model.graph.outputs:  # an empty file parses as an empty ModelProto: nothing to rewrite, nothing to write
        raise UsageError("the model has no graph (no graph outputs): an empty or truncated file parses as an "
                         "empty ONNX model; pass a model with a graph")
    _negative_dims_unknown(model)
    face = interface(model)
    _sizes.check_given(face, inputs)
    if report is None:
        report = RewriteReport()
    report.target, report.verify = target, verify
    report.off = off = switches.resolve(off)  # modules turned off by the flags (docs/design.md §5: in the report)
    report.opset_before = report.opset_after = model_opset(model)
    report.nodes_before = report.nodes_after = len(model.graph)
    try:
        first = _sizes.candidates(face, inputs)[0]  # the --input sizes, else the first sizes normexport.sizes tries
    except ValueError:
        first = dict(inputs or {})
    report.inputs = input_records(face, first)

    whole = None
    if verify:
        nbytes = weight_bytes(model)
        if nbytes <= WHOLE_MODEL_LIMIT:
            whole = original if original is not None else ir.serde.serialize_model(model)
        else:
            report.whole_model = (f"not run: {nbytes / 2**30:.2f} GiB of weights (the extra runs up to "
                                  f"{WHOLE_MODEL_LIMIT >> 20} MiB); every fusion was verified locally")

    unmarked = {id(n) for n in model.graph
                if n.domain == _ops.DOMAIN and not all(k in n.attributes for k in _ops.PLUGIN_ATTRIBUTES)}
    ir.passes.common.ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
    pristine = model.clone()  # (the tensors shared) returned when no rule applies: the original spelling
    report.canonical = canonical.canonicalize(model, report.notes)  # docs/design.md §11: the rules see canonical forms
    if report.canonical:
        ir.passes.common.ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
    local = None
    if verify:
        concrete = concrete_shapes(model, first)
        types: dict[str, int] = {}
        why = ""
        if whole is not None:  # small: what shape inference left unknown, from one run
            probed, types, why = probe_shapes(whole, model, concrete, inputs)
            concrete.update(probed)
            if why:
                report.notes.append(f"local verification: sizes of intermediate values not probed ({why})")
        # large: one probe run only when a fusion needs it (its weights read where they lie)
        prober = None if whole is not None else (lambda m: probe_ir(m, concrete_shapes(m, first), inputs))
        local = LocalVerifier(model, _symbol_sizes(model, first), concrete=concrete, types=types, probe_note=why,
                              prober=prober)
    report.local = local

    explain = None  # the previous module's explain_unapplied hook, run on the model it left
    for mod_name in RULE_MODULES:
        record_unapplied(explain, model, report)
        explain = None
        mod = _load_module(mod_name)
        if mod is None:
            report.modules[mod_name] = "not installed"
            continue
        if target not in mod.TARGETS:
            report.modules[mod_name] = f"not for target {target}"
            continue
        if mod_name in off:
            report.modules[mod_name] = f"off ({off[mod_name]})"
            continue
        report.modules[mod_name] = "ok"
        if hasattr(mod, "explain_unapplied"):
            explain = (mod_name, mod.explain_unapplied)
        rules = list(mod.rules_for(target)) if hasattr(mod, "rules_for") else list(mod.RULES)
        if not rules:
            report.modules[mod_name] = _off(mod, target)
            continue
        records = {r.name: report.record(r.name, mod_name) for r in rules}
        tracer = Tracer()
        _apply([_verified(r, None, None) for r in rules], model, tracer)  # a dry run: what matches, near-misses, failed checks
        if not any(ev[3] == MatchStatus.SUCCESS for ev in tracer.events):
            record_diagnostics(tracer, records)
            continue
        need = mod.required_opset(target) if hasattr(mod, "required_opset") else 0
        if model_opset(model) < need:
            try:
                model, how = upgrade_opset(model, need)
            except ValueError as e:
                for ev in tracer.events:
                    if ev[3] == MatchStatus.SUCCESS:
                        rec = records[ev[0].name]
                        rec.matched += 1
                        rec.reject(f"failed check: needs opset {need}: {e}", where(ev[1]))
                record_diagnostics(tracer, records)
                continue
            report.notes.append(f"{mod_name}: {how}")
            if local is not None:
                local.model = model
            ir.passes.common.ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
            tracer = Tracer()
            _apply([_verified(r, None, None) for r in rules], model, tracer)
        record_diagnostics(tracer, records)
        for rule in rules:  # one rule at a time, in the module's order
            _apply([_verified(rule, records[rule.name], local)], model)
    record_unapplied(explain, model, report)
    canonical.restore(model)  # a canonical BatchNormalization no rule folded: back to its Mul / Add
    if report.canonical and not report.applied:  # nothing fused: the model as it came, not its canonical forms
        model = pristine
        unmarked = {id(n) for n in model.graph
                    if n.domain == _ops.DOMAIN and not all(k in n.attributes for k in _ops.PLUGIN_ATTRIBUTES)}

    # normexport nodes another tool wrote without the plugin attributes (the fused ones get them in finish)
    marked = sum(1 for n in model.graph if id(n) in unmarked)
    finish(model)
    if marked:
        report.notes.append(f"added plugin_namespace / plugin_version to {marked} normexport node(s) "
                            "so that TensorRT's ONNX parser runs the plugin rather than the function body")
    report.opset_after = model_opset(model)
    report.nodes_after = len(model.graph)
    report.norm_nodes = norm_node_counts(model.graph)
    if whole is not None and report.applied:
        _whole_model(whole, model, report, inputs)
    return model


def _negative_dims_unknown(model: ir.Model) -> None:
    """A dim of -1 (Paddle2ONNX's spelling of a dynamic dim, which onnxruntime reads so) becomes an
    unnamed symbolic dim on every value: the rules and the local verifier take ints as sizes."""
    values = list(model.graph.inputs) + list(model.graph.outputs) + [o for n in model.graph for o in n.outputs]
    for v in values:
        if v.shape is not None and any(isinstance(d, int) and d < 0 for d in v.shape):
            v.shape = ir.Shape([None if isinstance(d, int) and d < 0 else d for d in v.shape])


def _off(mod, target: str) -> str:
    """The status of a rule module for `target` that gave no rules: off, and why (never silent)."""
    return f"off for target {target} (the module gave no rules)"


def _verified(rule, rec, local: LocalVerifier | None):
    """A copy of `rule` that counts its matches in `rec` and, with `local`, applies a match only
    when the local check passes (else records why and leaves the match as it was)."""
    one = copy.copy(rule)
    inner = rule.try_rewrite

    def try_rewrite(model, graph_or_function, node, *, verbose=None, tracer=None):
        delta = inner(model, graph_or_function, node, verbose=verbose, tracer=tracer)
        if delta is None:
            return None
        if tracer is not None:  # a dry run: the replacement is dropped
            _detach(delta)
            return delta
        rec.matched += 1
        if local is not None:
            try:
                why = local.verify(rule.name, where(node), delta)
            except UsageError:
                raise
            except Exception as e:  # noqa: BLE001 - a verifier failure is a rejection, never a crash
                why = f"cannot verify locally: {type(e).__name__}: {first_line(e, 160)}"
            if why is not None:
                rec.reject(f"local verification: {why}", where(node))
                _detach(delta)
                return None
        rec.applied += 1
        return delta

    one.try_rewrite = try_rewrite
    return one


def _detach(delta) -> None:
    """Unhook a replacement that will not be inserted: its nodes read graph values, and every such
    read counts as a use of the value (a later rule would see phantom readers)."""
    for n in delta.new_nodes:
        for i in range(len(n.inputs)):
            n.replace_input_with(i, None)


def _symbol_sizes(model: ir.Model, given: dict[str, list[int]] | None) -> dict[str, int]:
    """{symbolic dim name: size} from sizes of the graph inputs ({input name: dims}: the --input
    sizes, else the first that normexport.sizes tries, e.g. batch 2, sequence 8)."""
    out: dict[str, int] = {}
    for v in model.graph.inputs:
        dims = (given or {}).get(v.name)
        if dims is None or v.shape is None or len(v.shape) != len(dims):
            continue
        for d, n in zip(v.shape, dims):
            if not isinstance(d, int) and getattr(d, "value", None):
                out.setdefault(d.value, int(n))
    return out


def _whole_model(original: onnx.ModelProto, model: ir.Model, report: RewriteReport, inputs) -> None:
    """The extra: the rewritten model against the original, whole, in onnxruntime (reported, not a
    veto: the local checks decided each fusion)."""
    try:
        candidate = ir.serde.serialize_model(model)
    except Exception as e:  # noqa: BLE001
        report.whole_model = f"not run: the rewritten model does not serialise ({first_line(e, 160)})"
        return
    verifier = Verifier(original, report, inputs)
    why = verifier.check(candidate)
    if why is None:
        report.whole_model = "passed"
    elif why.startswith("cannot run the original model"):
        report.whole_model = f"not run: {report.notes[-1].removeprefix('verification: ') if report.notes else why}"
    else:
        report.whole_model = f"differs: {why}"
