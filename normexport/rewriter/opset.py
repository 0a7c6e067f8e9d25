"""Raising a model's default-domain opset for rules whose replacements need a newer one."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from normexport import ops as _ops
from normexport.errors import first_line

from ._weights import reweighted, weightless


def all_nodes(model: onnx.ModelProto):
    """Every node of the model, those in subgraphs (If / Loop / Scan bodies) included."""
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
    for n in all_nodes(model):
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
    light, big, fake = weightless(model)
    try:
        out = onnx.version_converter.convert_version(light, version)
    except Exception as e:  # noqa: BLE001 - the converter raises many kinds
        raise ValueError(f"onnx.version_converter {old} -> {version} failed: {first_line(e, 200)}") from e
    return reweighted(out, big, fake), f"opset converted {old} -> {version} with onnx.version_converter"


def model_opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))


def upgrade_opset_ir(model: ir.Model, version: int) -> tuple[ir.Model, str]:
    """upgrade_opset for an onnx_ir model: bumped in place when no op the model uses changed in
    between, else converted by onnx.version_converter on the model without its weights (a new
    model, the same weight tensors). Raises ValueError when neither is possible."""
    from onnx_ir.passes.common import _c_api_utils

    old = model_opset(model)
    bump = True
    for n in ir.traversal.RecursiveGraphIterator(model.graph):
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
        model.opset_imports[""] = version
        return model, f"opset import bumped {old} -> {version} (no op changed in between)"
    weights = {name: v.const_value for name, v in model.graph.initializers.items()}
    real = {v.name for v in model.graph.inputs}
    try:
        proto = _c_api_utils.call_onnx_api(lambda p: onnx.version_converter.convert_version(p, version), model)
    except Exception as e:  # noqa: BLE001 - the converter raises many kinds
        raise ValueError(f"onnx.version_converter {old} -> {version} failed: {first_line(e, 200)}") from e
    new = ir.serde.deserialize_model(proto)
    for v in list(new.graph.inputs):
        if v.name in weights and v.name not in real:
            new.graph.inputs.remove(v)
    for name, tensor in weights.items():  # the original tensors (lazy, memory-mapped), not the proto's copies
        v = new.graph.initializers.get(name)
        if v is None:
            v = next((x for x in new.graph.inputs if x.name == name), None) or _used_value(new, name)
            if v is None:
                continue
            v.const_value = tensor
            new.graph.register_initializer(v)
        else:
            v.const_value = tensor
    return new, f"opset converted {old} -> {version} with onnx.version_converter"


def _used_value(model: ir.Model, name: str) -> ir.Value | None:
    """The value named `name` that a node of the main graph reads (an initializer the converter
    received as a stripped input)."""
    for n in model.graph:
        for v in n.inputs:
            if v is not None and v.name == name:
                return v
    return None
