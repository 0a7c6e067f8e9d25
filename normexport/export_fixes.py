"""Exact fixes to what torch.onnx's dynamo exporter writes, so that the file is valid ONNX in every
dtype and runs in onnxruntime (in place on the onnx-ir model, before anything else reads it):

- `einsum_permutations_as_transpose`: a one-input Einsum that only permutes axes ("nhwpqc->nchpwq",
  diffusers' unpatchify) is the Transpose it names. ONNX's Einsum has no bfloat16 form.
- `noop_squeezes`: `x.squeeze(d)` is a no-op in torch when dim d is not 1 (PixArt's
  `hidden_states.squeeze(1)` on [B, tokens, C]); the exporter writes an ONNX Squeeze, which
  requires a 1 there. Axes whose dim is a known size other than 1, or symbolic (torch.export
  specialises sizes 0 and 1, so a symbolic size is >= 2), are dropped; no axis left: Identity.
- `int64_indices`: GatherND / ScatterND take int64 indices only (ONNX), but the exporter writes
  the index tensor's own dtype: advanced indexing with int32 positions (`x[idx[:, 0], idx[:, 1]]`
  after `nonzero().int()`, ZImage's transformer) was an invalid graph ("Type 'tensor(int32)' of
  input parameter ... of operator (GatherND) ... is invalid"). A Cast to int64 goes in front.
- `bool_where`: Where over bool values (`masked_fill` on a bool mask, HunyuanVideo) is
  Or(And(c, x), And(Not(c), y)): onnxruntime's CPU provider has no bool Where kernel.

Each returns how many nodes it changed; `apply_all` runs them all and returns {name: count}.
"""

from __future__ import annotations

import onnx_ir as ir

_ONNX = ("", "ai.onnx")


def _replace(graph: ir.Graph, old: ir.Node, new_nodes: list[ir.Node], outputs: list[ir.Value]) -> None:
    ir.convenience.replace_nodes_and_values(graph, old, [old], new_nodes, old.outputs, outputs)


def einsum_permutations_as_transpose(model: ir.Model) -> int:
    done = 0
    for node in list(model.graph):
        if node.op_type != "Einsum" or node.domain not in _ONNX or len(node.inputs) != 1:
            continue
        eq = node.attributes.get("equation")
        lhs, _, rhs = (eq.as_string() if eq is not None else "").replace(" ", "").partition("->")
        if not lhs.isalpha() or not rhs.isalpha() or sorted(lhs) != sorted(rhs) or len(set(lhs)) != len(lhs):
            continue
        t = ir.Node("", "Transpose", [node.inputs[0]], [ir.AttrInt64s("perm", [lhs.index(c) for c in rhs])],
                    name=(node.name or "einsum") + "_as_transpose")
        _replace(model.graph, node, [t], list(t.outputs))
        done += 1
    return done


def noop_squeezes(model: ir.Model) -> int:
    done = 0
    for node in list(model.graph):
        if node.op_type != "Squeeze" or node.domain not in _ONNX or len(node.inputs) < 2 or node.inputs[1] is None:
            continue
        x, axes_v = node.inputs[0], node.inputs[1]
        if x is None or x.shape is None or axes_v.const_value is None:
            continue
        rank = len(x.shape)
        axes = [int(a) % rank for a in axes_v.const_value.numpy().reshape(-1)]
        keep = [a for a in axes if x.shape[a] == 1]  # only a dim known to be 1 is squeezed
        if len(keep) == len(axes):
            continue
        if keep:
            const = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(keep, dtype=ir.DataType.INT64))])
            new = ir.Node("", "Squeeze", [x, const.outputs[0]], name=node.name)
            _replace(model.graph, node, [const, new], list(new.outputs))
        else:
            new = ir.Node("", "Identity", [x], name=(node.name or "squeeze") + "_noop")
            _replace(model.graph, node, [new], list(new.outputs))
        done += 1
    return done


def bool_where(model: ir.Model) -> int:
    done = 0
    for node in list(model.graph):
        if node.op_type != "Where" or node.domain not in _ONNX or len(node.inputs) != 3:
            continue
        c, x, y = node.inputs
        if not (x is not None and y is not None and x.dtype == ir.DataType.BOOL and y.dtype == ir.DataType.BOOL):
            continue
        a = ir.Node("", "And", [c, x])
        not_c = ir.Node("", "Not", [c])
        b = ir.Node("", "And", [not_c.outputs[0], y])
        o = ir.Node("", "Or", [a.outputs[0], b.outputs[0]], name=node.name)
        _replace(model.graph, node, [a, not_c, b, o], list(o.outputs))
        done += 1
    return done


def int64_indices(model: ir.Model) -> int:
    done = 0
    for node in list(model.graph):
        if node.op_type not in ("GatherND", "ScatterND") or node.domain not in _ONNX or len(node.inputs) < 2:
            continue
        idx = node.inputs[1]
        if idx is None or idx.dtype != ir.DataType.INT32:
            continue
        cast = ir.Node("", "Cast", [idx], [ir.AttrInt64("to", ir.DataType.INT64)], name=(node.name or "indices") + "_int64")
        cast.outputs[0].dtype, cast.outputs[0].shape = ir.DataType.INT64, idx.shape
        model.graph.insert_before(node, cast)
        node.replace_input_with(1, cast.outputs[0])
        done += 1
    return done


def apply_all(model: ir.Model) -> dict[str, int]:
    counts = {f.__name__: f(model) for f in (einsum_permutations_as_transpose, noop_squeezes, int64_indices,
                                             bool_where)}
    return {k: v for k, v in counts.items() if v}
