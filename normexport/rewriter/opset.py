"""Raising a model's default-domain opset for rules whose replacements need a newer one."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from normexport.errors import first_line


def model_opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))


#: ops whose meaning changed at a version that onnx.version_converter does not adapt (it relabels them):
#: a model holding one below that version is not raised past it (the rule needing it is refused)
UNADAPTED = {"GroupNormalization": 21}  # scale / bias per group (18) -> per channel (21); onnx 1.23 relabels


def upgrade_opset(model: ir.Model, version: int) -> tuple[ir.Model, str]:
    """`model` importing default-domain opset `version`: bumped in place when no op the model uses
    changed in between, or when onnx.version_converter, run on one node of each kind that changed
    (`_relabelled`), leaves every one of them as it is (a change of types only: Reshape, Transpose,
    Cast ... 20 -> 23); else converted by onnx.version_converter on the model without its weights
    (a new model, the same weight tensors). Raises ValueError when neither is possible."""
    from onnx_ir.passes.common import _c_api_utils

    old = model_opset(model)
    changed, convert = [], False
    for n in ir.traversal.RecursiveGraphIterator(model.graph):
        if n.domain not in ("", "ai.onnx"):
            continue
        try:
            schema = onnx.defs.get_schema(n.op_type, version, "")
        except onnx.defs.SchemaError:  # (an op replaced by another: the converter's adapters)
            convert = True
            continue
        if schema.since_version > old:
            if old < UNADAPTED.get(n.op_type, 0) <= version:
                raise ValueError(f"{n.op_type} changed meaning at opset {UNADAPTED[n.op_type]}, which "
                                 f"onnx.version_converter does not adapt")
            changed.append(n)
    if not changed and not convert:
        model.opset_imports[""] = version
        return model, f"opset import bumped {old} -> {version} (no op changed in between)"
    if not convert and _relabelled(changed, old, version):
        model.opset_imports[""] = version
        kinds = sorted({n.op_type for n in changed})
        return model, (f"opset import bumped {old} -> {version} (onnx.version_converter leaves the ops that changed "
                       f"as they are: {', '.join(kinds)})")
    weights = {name: v.const_value for name, v in model.graph.initializers.items()}
    real = {v.name for v in model.graph.inputs}
    try:
        proto = _c_api_utils.call_onnx_api(lambda p: onnx.version_converter.convert_version(p, version), model)
    except Exception as e:  # noqa: BLE001 - the converter raises many kinds
        raise ValueError(f"onnx.version_converter {old} -> {version} failed: {first_line(e, 200)}") from e
    new = ir.serde.deserialize_model(proto)
    stripped = {}  # the weights the converter got as inputs (a subgraph may be their only reader)
    for v in list(new.graph.inputs):
        if v.name in weights and v.name not in real:
            new.graph.inputs.remove(v)
            stripped[v.name] = v
    for name, tensor in weights.items():  # the original tensors (lazy, memory-mapped), not the proto's copies
        v = new.graph.initializers.get(name)
        if v is None:
            v = stripped.get(name) or next((x for x in new.graph.inputs if x.name == name), None) \
                or _used_value(new, name)
            if v is None:
                continue
            v.const_value = tensor
            new.graph.register_initializer(v)
        else:
            v.const_value = tensor
    return new, f"opset converted {old} -> {version} with onnx.version_converter"


#: constant inputs up to this size go to `_relabelled`'s probe with their values (an adapter may read them)
_PROBE_CONST_BYTES = 4096


def _relabelled(nodes: list[ir.Node], old: int, version: int) -> bool:
    """Whether onnx.version_converter (old -> version) leaves each of `nodes` as it is: run once on a
    model of one node per kind (op, attributes, input types and ranks, small constant inputs' values),
    as it would run on the whole model, node by node. False where a kind holds a subgraph or the
    converter changes, adds or removes any node."""
    probe, seen = [], set()
    inits, inputs, outputs = [], [], []
    for n in nodes:
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in n.attributes.values()):
            return False
        ins, key = [], [n.op_type, tuple(sorted((k, repr(a.value)) for k, a in n.attributes.items()))]
        for v in n.inputs:
            if v is None:
                ins.append(None)
                key.append(None)
                continue
            t = v.const_value
            data = t.numpy().tobytes() if t is not None and t.nbytes <= _PROBE_CONST_BYTES else None
            ins.append((v, data))
            key.append((v.dtype, None if v.shape is None else len(v.shape), data))
        key = repr(key)
        if key in seen:
            continue
        seen.add(key)
        k = len(probe)
        names = []
        for j, item in enumerate(ins):
            if item is None:
                names.append("")
                continue
            v, data = item
            name = f"i{k}_{j}"
            names.append(name)
            if data is not None:
                t = v.const_value
                inits.append(onnx.helper.make_tensor(name, t.dtype.value, [int(d) for d in t.shape], data, raw=True))
            elif v.dtype is None:  # untyped (an adapter that needs the type fails: not proved)
                inputs.append(onnx.ValueInfoProto(name=name))
            else:
                dims = None if v.shape is None else [d if isinstance(d, int) else f"d{k}_{j}_{i}"
                                                     for i, d in enumerate(v.shape)]
                inputs.append(onnx.helper.make_tensor_value_info(name, v.dtype.value, dims))
        outs = [f"o{k}_{j}" for j in range(len(n.outputs))]
        outputs += [onnx.helper.make_empty_tensor_value_info(o) for o in outs]
        attrs = ir.serde.serialize_node(n).attribute
        node = onnx.helper.make_node(n.op_type, names, outs, name=f"n{k}")
        node.attribute.extend(attrs)
        probe.append(node)
    model = onnx.helper.make_model(onnx.helper.make_graph(probe, "probe", inputs, outputs, inits),
                                   opset_imports=[onnx.helper.make_opsetid("", old)])
    try:
        out = onnx.version_converter.convert_version(model, version)
    except Exception:  # noqa: BLE001 - the converter raises many kinds; the whole-model path says which
        return False
    if len(out.graph.node) != len(probe):
        return False
    for a, b in zip(probe, out.graph.node):
        if (a.op_type, a.domain, list(a.input), list(a.output)) != (b.op_type, b.domain, list(b.input), list(b.output)) \
                or sorted(x.SerializeToString() for x in a.attribute) != sorted(x.SerializeToString() for x in b.attribute):
            return False
    return True


def _used_value(model: ir.Model, name: str) -> ir.Value | None:
    """The value named `name` that a node of the main graph reads (an initializer the converter
    received as a stripped input)."""
    for n in model.graph:
        for v in n.inputs:
            if v is not None and v.name == name:
                return v
    return None
