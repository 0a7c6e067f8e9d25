"""Raising a model's default-domain opset for rules whose replacements need a newer one."""

from __future__ import annotations

import onnx

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
