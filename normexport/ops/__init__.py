"""Custom ops of the `normexport` ONNX domain. Each op's contract lives in one module
(`rms_norm.py`, `adaln_zero.py`, `skip_rms_norm.py`, `gated_adaln_zero.py`); this package wires those specs to torch and ONNX."""

from __future__ import annotations

import onnx
import torch

from . import adaln_zero, gated_adaln_zero, rms_norm, skip_rms_norm
from ._spec import DOMAIN, MIN_OPSET, PLUGIN_ATTRIBUTES, VERSION, OpSpec

SPECS: dict[str, OpSpec] = {m.SPEC.name: m.SPEC for m in (rms_norm, adaln_zero, skip_rms_norm, gated_adaln_zero)}

for _spec in SPECS.values():
    _spec.register_schema()

#: torch.onnx.export(..., custom_translation_table=TRANSLATION_TABLE)
TRANSLATION_TABLE = {
    torch.ops.normexport.rms_norm.default: rms_norm.translate,
    torch.ops.normexport.adaln_zero.default: adaln_zero.translate,
    torch.ops.normexport.skip_rms_norm.default: skip_rms_norm.translate,
    torch.ops.normexport.gated_adaln_zero.default: gated_adaln_zero.translate,
}


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def custom_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == DOMAIN]


def mark_plugin_nodes(model: onnx.ModelProto) -> int:
    """Add PLUGIN_ATTRIBUTES (see _spec.py) to every normexport node of the main graph that lacks
    them (in place); returns how many nodes were changed."""
    changed = 0
    for node in custom_nodes(model):
        present = {a.name for a in node.attribute}
        missing = [k for k in PLUGIN_ATTRIBUTES if k not in present]
        node.attribute.extend(onnx.helper.make_attribute(k, PLUGIN_ATTRIBUTES[k]) for k in missing)
        changed += bool(missing)
    return changed


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give `model` (in place) the `normexport` opset import, one FunctionProto per custom op it
    uses (so any ONNX runtime runs it with no registration) and the PLUGIN_ATTRIBUTES on its
    custom nodes (so TensorRT with libnormexport_plugins.so loaded runs the plugins instead).

    Existing normexport functions are replaced (their opset must match the model's)."""
    nodes = custom_nodes(model)
    kept = [f for f in model.functions if f.domain != DOMAIN]
    del model.functions[:]
    model.functions.extend(kept)
    if not nodes:
        return model
    opset = default_opset(model)
    if opset < MIN_OPSET:
        raise ValueError(f"normexport custom ops need opset >= {MIN_OPSET}; this model imports {opset}")
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, VERSION))
    by_type: dict[str, set[int]] = {}
    attrs: dict[str, set[str]] = {}  # the attribute names the op's nodes carry (which body: OpSpec.function_proto)
    for n in nodes:
        if n.op_type not in SPECS:
            raise ValueError(f"unknown op {DOMAIN}::{n.op_type}")
        by_type.setdefault(n.op_type, set()).add(len([i for i in n.input]))
        attrs.setdefault(n.op_type, set()).update(a.name for a in n.attribute)
    for op_type, arities in sorted(by_type.items()):
        if len(arities) > 1:
            raise ValueError(f"{DOMAIN}::{op_type} is used with {sorted(arities)} inputs in one model; use one form")
        model.functions.append(SPECS[op_type].function_proto(opset, arities.pop(), attrs[op_type]))
    mark_plugin_nodes(model)
    return model


def mark_plugin_nodes_ir(model) -> int:
    """mark_plugin_nodes for an onnx_ir model (its main graph), in place."""
    import onnx_ir as ir

    changed = 0
    for node in model.graph:
        if node.domain != DOMAIN:
            continue
        missing = [k for k in PLUGIN_ATTRIBUTES if k not in node.attributes]
        for k in missing:
            node.attributes[k] = ir.Attr(k, ir.AttributeType.STRING, PLUGIN_ATTRIBUTES[k])
        changed += bool(missing)
    return changed


def attach_functions_ir(model) -> None:
    """attach_functions for an onnx_ir model, in place: the `normexport` opset import, one function
    per custom op its main graph uses, the plugin attributes. The weights are not touched."""
    import onnx_ir as ir

    for key in [k for k, f in model.functions.items() if f.domain == DOMAIN]:
        del model.functions[key]
    by_type: dict[str, set[int]] = {}
    attrs: dict[str, set[str]] = {}
    for n in model.graph:
        if n.domain == DOMAIN:
            if n.op_type not in SPECS:
                raise ValueError(f"unknown op {DOMAIN}::{n.op_type}")
            by_type.setdefault(n.op_type, set()).add(len(n.inputs))
            attrs.setdefault(n.op_type, set()).update(n.attributes)
    if not by_type:
        return
    opset = model.opset_imports.get("", 0)
    if opset < MIN_OPSET:
        raise ValueError(f"normexport custom ops need opset >= {MIN_OPSET}; this model imports {opset}")
    model.opset_imports.setdefault(DOMAIN, VERSION)
    for op_type, arities in sorted(by_type.items()):
        if len(arities) > 1:
            raise ValueError(f"{DOMAIN}::{op_type} is used with {sorted(arities)} inputs in one model; use one form")
        f = ir.serde.deserialize_function(SPECS[op_type].function_proto(opset, arities.pop(), attrs[op_type]))
        model.functions[f.identifier()] = f
    mark_plugin_nodes_ir(model)


__all__ = ["DOMAIN", "VERSION", "MIN_OPSET", "PLUGIN_ATTRIBUTES", "SPECS", "TRANSLATION_TABLE", "attach_functions",
           "attach_functions_ir", "custom_nodes", "default_opset", "mark_plugin_nodes", "mark_plugin_nodes_ir"]
