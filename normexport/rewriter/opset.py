"""Raising a model's default-domain opset for rules whose replacements need a newer one."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from normexport.errors import first_line


def model_opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))


def upgrade_opset(model: ir.Model, version: int) -> tuple[ir.Model, str]:
    """`model` importing default-domain opset `version`: bumped in place when no op the model uses changed in
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


def _used_value(model: ir.Model, name: str) -> ir.Value | None:
    """The value named `name` that a node of the main graph reads (an initializer the converter
    received as a stripped input)."""
    for n in model.graph:
        for v in n.inputs:
            if v is not None and v.name == name:
                return v
    return None
