"""Packed projections for `--target ort` (issue 31 item 2): the MatMuls that read one activation
with constant weights (an LLM's q / k / v projections, its gate / up projections) become one
MatMul over the weights concatenated, split back (`pack_siblings`); a GroupQueryAttention whose
query, key and value are the three outputs of such a split, in order, takes the packed tensor as
its query with no key / value (normexport.llm.gqa_rule.packed_qkv: onnxruntime's packed-QKV form,
as onnxruntime-genai's builder writes it).

Both are exact in real arithmetic (each output column is the same dot product); the caller checks
the packed file against the unpacked one in onnxruntime (normexport.llm.verify.compare) and by
greedy generation. The concatenated weights are onnx-ir lazy tensors: built from the original
tensors when the file is serialised or written, never held beside them.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np
import onnx_ir as ir

from ..io import CONCAT_MEMBERS


def _weight(node: ir.Node) -> ir.Value | None:
    """The constant 2-D weight of a plain MatMul (an initializer of the main graph), else None."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    w = node.inputs[1]
    if w is None or w.const_value is None or not w.is_initializer() or w.shape is None or len(w.shape) != 2:
        return None
    return w


def _concat(tensors: list) -> ir.LazyTensor:
    dtype = tensors[0].dtype
    k = tensors[0].shape[0]
    n = sum(t.shape[1] for t in tensors)

    def build():
        return ir.Tensor(np.concatenate([t.numpy() for t in tensors], axis=1), dtype=dtype)

    lazy = ir.LazyTensor(build, dtype=dtype, shape=ir.Shape([k, n]))
    setattr(lazy, CONCAT_MEMBERS, list(tensors))  # the writer streams the members in place (normexport.io)
    return lazy


def pack_siblings(model: ir.Model, *, min_group: int = 2) -> list[dict]:
    """MatMuls of the main graph reading the same value with constant [K, N_i] weights of one dtype
    become one MatMul over [K, sum N_i] and a Split on the last axis, in place. Returns one entry per
    packed group: {"matmuls": [names], "split": [N_i]}. A weight another node also reads, or a
    MatMul output that is a graph output, leaves its group as it is."""
    graph = model.graph
    outputs = {id(v) for v in graph.outputs}
    groups: dict[int, list[ir.Node]] = defaultdict(list)
    for node in graph:
        w = _weight(node)
        if w is not None and len(w.uses()) == 1 and id(node.outputs[0]) not in outputs:
            groups[id(node.inputs[0])].append(node)
    done = []
    for nodes in groups.values():
        by_kind: dict[tuple, list[ir.Node]] = defaultdict(list)
        for n in nodes:
            w = n.inputs[1]
            by_kind[(w.shape[0], w.const_value.dtype)].append(n)
        for members in by_kind.values():
            if len(members) < min_group:
                continue
            done.append(_pack(graph, members))
    return done


def _pack(graph: ir.Graph, members: list[ir.Node]) -> dict:
    x = members[0].inputs[0]
    weights = [n.inputs[1] for n in members]
    sizes = [int(w.shape[1]) for w in weights]
    base = members[0].name or members[0].outputs[0].name
    packed_w = ir.Value(name=f"{base}.packed_weight", type=weights[0].type,
                        shape=ir.Shape([weights[0].shape[0], sum(sizes)]),
                        const_value=_concat([w.const_value for w in weights]))
    split_sizes = ir.Value(name=f"{base}.packed_split", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([len(sizes)]),
                           const_value=ir.tensor(np.array(sizes, dtype=np.int64)))
    graph.register_initializer(packed_w)
    graph.register_initializer(split_sizes)
    old_outs = [n.outputs[0] for n in members]
    shape = old_outs[0].shape
    out_shape = ir.Shape(list(shape[:-1]) + [sum(sizes)]) if shape is not None else None
    mm = ir.Node("", "MatMul", [x, packed_w], name=f"{base}.packed", num_outputs=1)
    mm.outputs[0].name, mm.outputs[0].type, mm.outputs[0].shape = f"{base}.packed_out", old_outs[0].type, out_shape
    split = ir.Node("", "Split", [mm.outputs[0], split_sizes], attributes=[ir.AttrInt64("axis", -1)],
                    name=f"{base}.packed_split", num_outputs=len(members))
    for new, old in zip(split.outputs, old_outs):
        new.type, new.shape = old.type, old.shape
    graph.insert_before(members[0], [mm, split])
    for new, old in zip(split.outputs, old_outs):
        ir.convenience.replace_all_uses_with(old, new)
        new_name = old.name
        old.name = None
        new.name = new_name
    names = [n.name for n in members]
    for n in members:
        graph.remove(n, safe=True)
    for w in weights:
        if not w.uses():
            graph.initializers.pop(w.name, None)
    return {"matmuls": names, "split": sizes}


@dataclasses.dataclass
class Packing:
    """The outcome of `for_convert`: `model` is the packed copy (None where not packed) and `reason` why not."""

    model: ir.Model | None
    groups: list = dataclasses.field(default_factory=list)
    packed_qkv: int = 0
    nodes_before: int = 0
    nodes_after: int = 0
    local: dict = dataclasses.field(default_factory=dict)
    reason: str | None = None

    def to_dict(self) -> dict:
        return {"packed": self.model is not None, "groups": len(self.groups), "packed_qkv": self.packed_qkv,
                "splits": [g["split"] for g in self.groups], "nodes_before": self.nodes_before,
                "nodes_after": self.nodes_after, "local_check": self.local, "reason": self.reason}


def for_convert(model: ir.Model) -> Packing:
    """The packed copy of a (GroupQueryAttention-fused) KV-cache file, checked locally: the packed and
    the unpacked file in onnxruntime on the same prefill + decode feeds (normexport.llm.verify.compare,
    docs/design.md §7's tolerance), and where the unpacked file's past / present may share one buffer, the
    packed one run that way too (else the flag is dropped). `model` itself is left as it is."""
    from .gqa_rule import packed_qkv
    from .share_buffer import SHARE_BUFFER_KEY, share_buffer_check
    from .verify import compare

    before = sum(1 for _ in model.graph)
    packed = model.clone()  # the graph copied, the tensors shared
    groups = pack_siblings(packed)
    if not groups:
        return Packing(None, nodes_before=before, nodes_after=before,
                       reason="no MatMuls read one input with constant weights")
    qkv = packed_qkv(packed)
    result = Packing(packed, groups, qkv, before, sum(1 for _ in packed.graph))
    result.local = compare(model, packed)
    if not result.local.get("passed"):
        result.model, result.reason = None, f"local check FAILED: {result.local.get('reason')}"
        return result
    if packed.metadata_props.get(SHARE_BUFFER_KEY):
        ok, why = share_buffer_check(packed)
        if not ok:
            packed.metadata_props.pop(SHARE_BUFFER_KEY, None)
            result.reason = f"past/present share buffer not verified on the packed file ({why})"
    return result


def line(p: Packing) -> str:
    """convert's line on the packing: done (groups, node counts, how verified) or why not."""
    if p.model is None:
        return f"  projections: not packed ({p.reason})"
    qkv = f", {p.packed_qkv} as GroupQueryAttention's packed query" if p.packed_qkv else ""
    return (f"  projections: {len(p.groups)} group(s) of MatMuls on one input packed into one MatMul + Split each"
            f"{qkv}, {p.nodes_before} -> {p.nodes_after} nodes; local check PASSED (packed vs unpacked in "
            f"onnxruntime, prefill + {p.local.get('decode_steps')} decode steps, max_abs_err "
            f"{p.local.get('max_abs_err', 0):.3g})" + (f"; {p.reason}" if p.reason else ""))


def line_by_path(p: Packing) -> str:
    """convert's line for a file over the in-memory limit: packed before the attention fusion, verified
    with it (its local check: the fused file, packed, against eager; and the generation check against eager)."""
    if not p.groups:
        return "  projections: not packed (no MatMuls read one input with constant weights)"
    return (f"  projections: {len(p.groups)} group(s) of MatMuls on one input packed into one MatMul + Split each "
            f"before the attention fusion, {p.nodes_before} -> {p.nodes_after} nodes; verified with it: the fused "
            "file against eager (its local check, float32) and the generation check (file over the in-memory "
            "limit: no separate packed-vs-unpacked run)")
