"""The shape of an op spec: one object per custom op drives the torch op, the ONNX schema,
the ONNX function body and the TensorRT plugin's field names (docs/design.md §2)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import onnx
from onnx.defs import OpSchema

DOMAIN = "normexport"
VERSION = 1
#: Function bodies use ReduceMean with axes as an input, so they need opset 18 or newer.
MIN_OPSET = 18
FLOAT_TYPES = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)")
#: String attributes every normexport node carries for TensorRT's ONNX parser (10.7+): it looks the
#: plugin up by op type, plugin_version and plugin_namespace, and only prefers a registered plugin
#: over the node's local function when the node names it (without them, it inlines the function
#: body even with libnormexport_plugins.so loaded). The function bodies ignore them, and the plugin
#: creators do not declare them as fields, so the parser does not pass them to createPlugin.
PLUGIN_ATTRIBUTES = {"plugin_namespace": DOMAIN, "plugin_version": str(VERSION)}
_PLUGIN_ATTRIBUTE_DOC = "for TensorRT's ONNX parser: names the plugin that runs this node (the body ignores it)"


@dataclasses.dataclass(frozen=True)
class Input:
    name: str
    doc: str
    optional: bool = False
    #: an optional input's value inside the function body when a node leaves it out: a vector of
    #: X's last dim filled with it (LayerNorm weight 1, bias 0)
    fill: float | None = None


@dataclasses.dataclass(frozen=True)
class Attr:
    name: str
    default: float | int
    doc: str
    #: declared only by the op's `full_body`: a model gets that body where one of its nodes of the op
    #: carries the attribute, else `body`, which does not declare it, so the function (and every file
    #: whose nodes leave the attribute out) stays as it was before the attribute existed; optional
    #: with no default in the ONNX schema, so that torch.onnx does not write it into every node
    body_when_set: bool = False


@dataclasses.dataclass(frozen=True)
class OpSpec:
    name: str  # ONNX op type and TensorRT plugin name
    torch_op: str  # torch.library qualified name
    doc: str
    inputs: tuple[Input, ...]
    attributes: tuple[Attr, ...]
    reference: Callable[..., Any]  # numpy float64 reference, (*inputs, **attributes)
    #: the FunctionProto (body in standard ops, opset 18) of a node with every input; a node without
    #: its trailing optional inputs gets it with those made inside (Input.fill)
    body: Callable[[], onnx.FunctionProto]
    #: (name, doc) of each output, in order
    outputs: tuple[tuple[str, str], ...] = (("Y", "same shape and type as X"),)
    #: the FunctionProto declaring every attribute, those with `body_when_set` too (None: `body` does)
    full_body: Callable[[], onnx.FunctionProto] | None = None

    @property
    def defaults(self) -> dict[str, float | int]:
        return {a.name: a.default for a in self.attributes}

    def schema(self) -> OpSchema:
        def param(i: Input) -> OpSchema.FormalParameter:
            option = OpSchema.FormalParameterOption.Optional if i.optional else OpSchema.FormalParameterOption.Single
            return OpSchema.FormalParameter(i.name, "T", i.doc, param_option=option)

        return OpSchema(
            self.name,
            DOMAIN,
            VERSION,
            self.doc,
            inputs=[param(i) for i in self.inputs],
            outputs=[OpSchema.FormalParameter(name, "T", doc) for name, doc in self.outputs],
            type_constraints=[("T", list(FLOAT_TYPES), "float32, float16 or bfloat16")],
            attributes=[_schema_attribute(a) for a in self.attributes]
            + [OpSchema.Attribute(k, onnx.helper.make_attribute(k, v), _PLUGIN_ATTRIBUTE_DOC)
               for k, v in PLUGIN_ATTRIBUTES.items()],
        )

    def function_proto(self, opset: int, n_inputs: int, attributes=()) -> onnx.FunctionProto:
        """The FunctionProto of this op for a model importing default-domain `opset` whose nodes of
        the op carry the attribute names `attributes` (the full body where one of them is a
        `body_when_set` attribute)."""
        if opset < MIN_OPSET:
            raise ValueError(f"normexport::{self.name} function bodies need opset >= {MIN_OPSET}, got {opset}")
        required = sum(not i.optional for i in self.inputs)
        if not required <= n_inputs <= len(self.inputs):
            raise ValueError(f"normexport::{self.name} takes {required} to {len(self.inputs)} inputs, got {n_inputs}")
        fn = (self.full_body if self.needs_full_body(attributes) else self.body)()
        if n_inputs < len(self.inputs):
            _fill_absent(fn, self.inputs[n_inputs:])
        for imp in fn.opset_import:
            if imp.domain == "":
                imp.version = opset  # the body only uses ops whose semantics are unchanged since 18
        declared = set(fn.attribute) | {a.name for a in fn.attribute_proto}
        for k, v in PLUGIN_ATTRIBUTES.items():  # declared (with defaults) so nodes may carry them
            if k not in declared:
                fn.attribute_proto.append(onnx.helper.make_attribute(k, v))
        return fn

    def needs_full_body(self, attributes) -> bool:
        """Whether nodes carrying the attribute names `attributes` need `full_body`."""
        names = set(attributes)
        return self.full_body is not None and any(a.body_when_set and a.name in names for a in self.attributes)

    def register_schema(self) -> None:
        if not onnx.defs.has(self.name, DOMAIN):
            onnx.defs.register_schema(self.schema())


def _schema_attribute(a: Attr) -> OpSchema.Attribute:
    """The schema's entry for `a`: with its default, except a `body_when_set` attribute, which is
    optional with no default in the schema (its default is the function body's): torch.onnx writes
    every schema default into the nodes it makes, and such an attribute must stay out of a node
    that does not set it."""
    if a.body_when_set:
        kind = OpSchema.AttrType.INT if isinstance(a.default, int) else OpSchema.AttrType.FLOAT
        return OpSchema.Attribute(a.name, kind, f"{a.doc} (default {a.default!r})", required=False)
    return OpSchema.Attribute(a.name, onnx.helper.make_attribute(a.name, a.default), a.doc)


def _fill_absent(fn: onnx.FunctionProto, absent: tuple[Input, ...]) -> None:
    """`fn` (in place) for a node without its trailing inputs `absent`: each is made inside the body,
    a float32 vector of X's last dim holding its `fill` value."""
    unfilled = [i.name for i in absent if i.fill is None]
    if unfilled:
        raise ValueError(f"{fn.name} needs its input(s) {unfilled}: they have no value to fill in")
    del fn.input[len(fn.input) - len(absent):]
    prologue = [onnx.helper.make_node("Shape", ["X"], ["_hidden"], start=-1)]
    prologue += [onnx.helper.make_node("ConstantOfShape", ["_hidden"], [i.name],
                                       value=onnx.helper.make_tensor("v", onnx.TensorProto.FLOAT, [1], [i.fill]))
                 for i in absent]
    nodes = prologue + list(fn.node)
    del fn.node[:]
    fn.node.extend(nodes)
