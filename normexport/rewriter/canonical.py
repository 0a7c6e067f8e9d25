"""Canonical forms before the rules (docs/design.md §11): the driver brings the graph to one spelling of each
piece a norm is made of, so that every rule is written once, over the canonical form.

Each step is semantics-preserving (the same values, up to the rounding of one Mul against one Div)
and general (not tied to a norm):
    constants      Constant nodes -> initializers (copies: a caller's proto is never changed)
    fold           constant folding (onnxscript.optimizer.fold_constants) under a size cap: a folded
                   constant holds at most FOLD_LIMIT elements (shapes, scalars, per-channel
                   vectors), so a file is never inflated by an Expand / ConstantOfShape written out;
                   it also removes Identity nodes and Casts to the type a value has
    broadcast      Expand / Reshape whose output has its input's shape removed; Expand before
                   broadcasting ops whose other operand has the expanded shape removed; Unsqueeze of
                   leading axes before such ops removed (the consumer broadcasts anyway)
    keepdims       a reduction with keepdims=0 whose result (through elementwise ops with scalars)
                   is only broadcast back to the keepdims=1 shape (Reshape to a run-time shape,
                   Unsqueeze of the reduced axes) -> keepdims=1, the Reshape / Unsqueeze removed
    div_constant   Div(x, c), c a constant -> Mul(x, 1/c)
    sum_to_mean    ReduceSum(x, axes) · 1/n (n the reduced element count) -> ReduceMean(x, axes)
    gap_to_mean    GlobalAveragePool(x) -> ReduceMean(x, axes=[2, .., rank-1], keepdims=1)
    inverse_root   Pow(v, -0.5) and Div(1, Sqrt(v)) -> Reciprocal(Sqrt(v))
    conv_bias      Conv / ConvTranspose followed by Add of a per-channel constant -> the Conv's bias
    conv_affine    Conv / ConvTranspose followed by Mul (and Add) of per-channel constants ->
                   BatchNormalization (mean 0, var 1, epsilon 0: exactly y·s + t), which bn_fold then
                   folds into the Conv (verified); one left unfolded is turned back (restore)

Only the main graph is rewritten by the own steps (functions and subgraphs keep their spelling).
Where no rule applies, the driver's callers keep the original file (rewrite(): the proto as it
came; rewrite_file: the input's bytes), so a canonical form is seen only beside a fusion.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir
import onnxscript.optimizer

from normexport.dtypes import FLOAT_TYPES
from normexport.ir_utils import ONNX_DOMAINS as _ONNX, constant_array, constant_node_array, rank_of, same_dim, same_shape

#: the largest constant (elements) a fold writes
FOLD_LIMIT = 4096

#: the constant behind a value (initializer or Constant node; normexport.ir_utils.constant_array): an
#: initializer of more than FOLD_LIMIT elements is not read (weights stay where they lie, docs/design.md §8);
#: max_size=None reads any size
_const = functools.partial(constant_array, max_size=FOLD_LIMIT)

_BROADCAST = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"})
#: elementwise ops a statistic passes through (one value per reduced row in, one out)
_ELEMENTWISE = _BROADCAST | frozenset({"Sqrt", "Reciprocal", "Neg", "Abs", "Exp", "Log", "Relu", "Identity"})
_REDUCTIONS = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"})
#: name prefixes that mark nodes to turn back (restore) when no rule took them: the BatchNormalization
#: conv_affine wrote (no fold), the ReduceMean gap_to_mean wrote (-> GlobalAveragePool)
_AFFINE_KEY = "normexport_canonical_conv_affine"
_GAP_KEY = "normexport_canonical_gap_to_mean"


def canonicalize(model: ir.Model, notes: list[str] | None = None) -> dict[str, int]:
    """Bring `model` (in place) to canonical forms; returns {step: how many places it changed}.
    `notes` gets a line for what a step saw but left (e.g. a ReduceSum whose factor is not 1/n)."""
    notes = notes if notes is not None else []
    done: dict[str, int] = {}
    for name, step in STEPS:
        n = step(model, notes)
        if n:
            done[name] = n
            onnxscript.optimizer.remove_unused_nodes(model)  # the next step counts readers: no dead ones
    return done


def restore(model: ir.Model) -> int:
    """After the rules: each BatchNormalization that conv_affine wrote and no rule folded goes back to
    a Mul / Add, each ReduceMean gap_to_mean wrote and no rule took back to GlobalAveragePool (the
    file keeps its spelling where nothing was fused there). The nodes are known by their names (an
    opset conversion keeps names, not node metadata)."""
    graph = model.graph
    n = 0
    for node in list(graph):
        name = node.name or ""
        if name.startswith(_GAP_KEY) and node.op_type == "ReduceMean":
            gap = ir.Node("", "GlobalAveragePool", [node.inputs[0]], num_outputs=1)
            graph.insert_before(node, gap)
            _replace(node.outputs[0], gap.outputs[0], fresh=True)
            n += 1
            continue
        if node.op_type != "BatchNormalization" or not name.startswith(_AFFINE_KEY):
            continue
        y, s, t = node.inputs[0], _const(node.inputs[1], max_size=None), _const(node.inputs[2], max_size=None)
        conv = y.producer()
        rank = rank_of(conv.inputs[1]) if conv is not None and len(conv.inputs) > 1 else None
        if s is None or t is None or rank is None:
            continue
        shape = [-1] + [1] * (rank - 2)  # one value per channel, broadcast along axis 1
        mul = ir.Node("", "Mul", [y, _initializer(graph, s.reshape(shape), f"{name}_scale")], num_outputs=1)
        graph.insert_before(node, mul)
        out = mul.outputs[0]
        if np.any(t != 0):
            add = ir.Node("", "Add", [out, _initializer(graph, t.reshape(shape), f"{name}_shift")], num_outputs=1)
            graph.insert_before(node, add)
            out = add.outputs[0]
        _replace(node.outputs[0], out, fresh=True)
        n += 1
    if n:
        onnxscript.optimizer.remove_unused_nodes(model)
    return n


# ---- helpers ------------------------------------------------------------------------------------


def _is_const(v: ir.Value | None) -> bool:
    """Whether `v` is a constant (initializer that is not a graph input, or a Constant node), unread."""
    if v is None or v.is_graph_input():
        return False
    p = v.producer()
    return v.const_value is not None or (p is not None and p.op_type == "Constant" and p.domain in _ONNX)


def _scalar(v: ir.Value | None) -> float | None:
    a = _const(v)
    if a is None or a.size != 1 or a.dtype.kind != "f":
        return None
    return float(a.reshape(()))


def _opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))


def _initializer(graph: ir.Graph, array: np.ndarray, base: str) -> ir.Value:
    array = np.array(array, order="C")  # (not ascontiguousarray: it makes a 0-d array 1-d)
    taken = set(graph.initializers) | {v.name for v in graph.inputs}
    name, i = base or "canonical", 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    v = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                 const_value=ir.tensor(array, name=name))
    graph.register_initializer(v)
    return v


def _replace(old: ir.Value, new: ir.Value, fresh: bool = False) -> None:
    """Every reader of `old` reads `new`. A graph output keeps its name; so does a value a step made
    (`fresh`): the same values under the same names, which the local verifier's probe of the
    original model then sizes."""
    if old.is_graph_output():
        name = old.name
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        old.name = None
        new.name = name
    else:
        ir.convenience.replace_all_uses_with(old, new)
        if fresh and old.name:
            name = old.name
            old.name = None
            new.name = name


def _axes(node: ir.Node) -> list[int] | None:
    """The constant axes of a Reduce* node (attribute or input), None when absent / not constant."""
    a = node.attributes.get("axes")
    if a is not None:
        return list(a.as_ints())
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        arr = _const(node.inputs[1])
        return None if arr is None else [int(x) for x in np.asarray(arr).reshape(-1)]
    return None


def _keepdims(node: ir.Node) -> int:
    k = node.attributes.get("keepdims")
    return 1 if k is None else k.as_int()


def _reduce_mean(graph: ir.Graph, model: ir.Model, before: ir.Node, x: ir.Value, axes: list[int],
                 keepdims: int = 1) -> ir.Node:
    """A ReduceMean(x, axes, keepdims) node inserted before `before` (axes as an attribute before
    opset 18, as an input from 18)."""
    if _opset(model) >= 18:
        av = _initializer(graph, np.asarray(axes, np.int64), "canonical_axes")
        node = ir.Node("", "ReduceMean", [x, av], [ir.AttrInt64("keepdims", keepdims)], num_outputs=1)
    else:
        node = ir.Node("", "ReduceMean", [x], [ir.AttrInt64s("axes", axes), ir.AttrInt64("keepdims", keepdims)],
                       num_outputs=1)
    graph.insert_before(before, node)
    return node


def _main_nodes(model: ir.Model, op_type: str):
    return [n for n in model.graph if n.op_type == op_type and n.domain in _ONNX]


# ---- steps --------------------------------------------------------------------------------------


def _lift_constants(model: ir.Model, notes) -> int:
    """Constant nodes (a `value` tensor or value_float(s) / value_int(s)) -> initializers of their
    graph, subgraphs included. The values are copied: a model deserialized from a caller's proto
    shares its tensors, and the caller's proto is never changed."""
    n = 0
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        if node.op_type != "Constant" or node.domain not in _ONNX or len(node.attributes) != 1:
            continue
        graph = node.graph
        out = node.outputs[0]
        if not isinstance(graph, ir.Graph) or out.is_graph_output():
            continue
        array = constant_node_array(node)
        if array is None or array.dtype.kind not in "fiub":
            continue
        taken = set(graph.initializers) | {v.name for v in graph.inputs}
        name = out.name if out.name and out.name not in taken else None
        if name is None:
            continue
        value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                         const_value=ir.tensor(array, name=name))
        out.const_value = None  # (renaming a value renames its const tensor: the caller's, shared)
        out.name = None
        ir.convenience.replace_all_uses_with(out, value)
        graph.remove(node, safe=True)
        graph.register_initializer(value)
        n += 1
    return n


def _should_fold(node: ir.Node) -> bool | None:
    """The size cap: nothing with an input over FOLD_LIMIT elements folds, and an op that writes a
    tensor from a shape (ConstantOfShape, Expand) folds only when what it writes is at most
    FOLD_LIMIT elements (Tile, Range: never)."""
    if node.domain not in _ONNX:
        return None
    for x in node.inputs:  # a weight is never read for a fold (onnxscript folds a lone Transpose of one)
        t = x.const_value if x is not None else None
        try:
            if t is not None and t.size > FOLD_LIMIT:
                return False
        except Exception:  # noqa: BLE001 - a tensor without a size
            return False
    if node.op_type in ("ConstantOfShape", "Expand"):
        shape = _const(node.inputs[-1] if node.op_type == "Expand" else node.inputs[0])
        if shape is None:
            return False
        n = int(np.prod(np.asarray(shape).reshape(-1))) if np.asarray(shape).size else 1
        if node.op_type == "Expand":
            src = _const(node.inputs[0])
            if src is None:
                return False
            try:
                n = int(np.prod(np.broadcast_shapes(src.shape, tuple(int(d) for d in np.asarray(shape).reshape(-1)))))
            except ValueError:
                return False
        return n <= FOLD_LIMIT
    if node.op_type in ("Tile", "Range"):
        return False
    return None


def _fold(model: ir.Model, notes) -> int:
    before = sum(1 for _ in ir.traversal.RecursiveGraphIterator(model.graph))
    onnxscript.optimizer.fold_constants(model, input_size_limit=FOLD_LIMIT, output_size_limit=FOLD_LIMIT,
                                        should_fold=_should_fold)
    onnxscript.optimizer.remove_unused_nodes(model)
    return before - sum(1 for _ in ir.traversal.RecursiveGraphIterator(model.graph))


def _broadcast(model: ir.Model, notes) -> int:
    n = 0
    for node in list(model.graph):
        if node.domain not in _ONNX or node.op_type not in ("Expand", "Reshape", "Unsqueeze") or not node.inputs:
            continue
        x, out = node.inputs[0], node.outputs[0]
        if x is None:
            continue
        if node.op_type in ("Expand", "Reshape") and same_shape(x.shape, out.shape):
            _replace(out, x)  # the identity
            n += 1
            continue
        if out.is_graph_output() or not out.uses():
            continue
        uses = list(out.uses())
        if not all(u.domain in _ONNX and u.op_type in _BROADCAST and len(u.inputs) == 2
                   and u.inputs[0] is not u.inputs[1] for u, _ in uses):
            continue  # (Mul(e, e) would lose its shape)
        if node.op_type == "Expand":
            ok = all(same_shape(u.inputs[1 - i].shape, out.shape) for u, i in uses if len(u.inputs) == 2)
        elif node.op_type == "Unsqueeze":
            axes = _axes(node)
            r = rank_of(out)
            ok = (axes is not None and r is not None and sorted(a % r for a in axes) == list(range(len(axes)))
                  and all(len(u.inputs) == 2 and (rank_of(u.inputs[1 - i]) or -1) >= r for u, i in uses))
        else:
            ok = False
        if ok and all(len(u.inputs) == 2 for u, _ in uses):
            for u, i in uses:
                u.replace_input_with(i, x)
            n += 1
    return n


def _keepdims_region(red: ir.Node, axes: list[int], rank: int):
    """For a keepdims=0 reduction: (the reductions, the region's nodes, the frontier Reshape /
    Unsqueeze nodes) when every use of the statistic, through elementwise ops with scalars or with
    other such reductions over the same axes, ends in a broadcast back to the keepdims=1 shape; else None."""
    norm = sorted(a % rank for a in axes)
    red_rank = rank - len(axes)
    reds, region, frontier, todo = set(), set(), set(), []

    def peer(p) -> bool:
        return (p is not None and p.domain in _ONNX and p.op_type in _REDUCTIONS and _keepdims(p) == 0
                and rank_of(p.inputs[0]) == rank and _axes(p) is not None and sorted(a % rank for a in _axes(p)) == norm)

    def add_red(p) -> None:
        if p not in reds:
            reds.add(p)
            todo.append(p.outputs[0])

    def upstream(v: ir.Value, depth: int = 0) -> bool:
        """Whether `v` is a scalar constant or computed from such reductions by elementwise ops."""
        a = _const(v)
        if a is not None:
            return a.size == 1 and a.ndim <= red_rank
        p = v.producer()
        if p is None or depth > 16:
            return False
        if p in reds or p in region:
            return True
        if peer(p):
            add_red(p)
            return True
        if p.domain not in _ONNX or p.op_type not in _ELEMENTWISE:
            return False
        if all(upstream(x, depth + 1) for x in p.inputs if x is not None):
            region.add(p)
            todo.extend(p.outputs)
            return True
        return False

    add_red(red)
    seen: set[int] = set()
    while todo:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if v.is_graph_output():
            return None
        for user, idx in list(v.uses()):
            if user.domain not in _ONNX:
                return None
            if user.op_type in ("Reshape", "Unsqueeze") and idx == 0:
                if user.op_type == "Unsqueeze":
                    ua = _axes(user)
                    if ua is None or sorted(a % rank for a in ua) != norm:
                        return None
                elif not _reshape_is_keepdims(user, v, axes, rank):
                    return None
                frontier.add(user)
                continue
            if user.op_type not in _ELEMENTWISE:
                return None
            if user not in region:
                if not all(upstream(x) for j, x in enumerate(user.inputs) if x is not None and j != idx):
                    return None
                region.add(user)
                todo.extend(user.outputs)
    return reds, region, frontier


def _reshape_is_keepdims(node: ir.Node, v: ir.Value, axes: list[int], rank: int) -> bool:
    """Whether Reshape(v) (v of the keepdims=0 shape) only re-inserts the reduced axes as 1s: its
    output (shape inference, run-time shapes propagated) has rank `rank`, 1 on the reduced axes,
    and v's dims elsewhere, all but at most one known equal (the element count fixes that one)."""
    out = node.outputs[0].shape
    if out is None:
        out = _shape_value(node.inputs[1])
    if out is None or v.shape is None or len(out) != rank or len(v.shape) != rank - len(axes):
        return False
    norm = sorted(a % rank for a in axes)
    if any(not (isinstance(out[a], int) and out[a] == 1) for a in norm):
        return False
    rest = [out[i] for i in range(rank) if i not in norm]
    unknown = sum(1 for a, b in zip(rest, v.shape) if not same_dim(a, b))
    if unknown > 1:
        return False
    known_different = any(isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(rest, v.shape))
    return not known_different


def _shape_value(v: ir.Value | None, depth: int = 0) -> list | None:
    """The dims a 1-D int64 shape tensor holds, where shape inference did not propagate them: ints
    from constants, the input's (symbolic) dims from Shape(t), through Slice / Concat / Cast /
    Gather / Unsqueeze / Squeeze; None for a dim it cannot tell (-1, 0: what Reshape infers / copies)."""
    if v is None or depth > 12:
        return None
    a = _const(v)
    if a is not None:
        if a.dtype.kind not in "iu" or a.ndim > 1:
            return None
        return [int(d) if d > 0 else None for d in np.asarray(a).reshape(-1)]
    p = v.producer()
    if p is None or p.domain not in _ONNX:
        return None
    if p.op_type == "Shape":
        t = p.inputs[0]
        if t is None or t.shape is None:
            return None
        dims = list(t.shape)
        start, end = p.attributes.get("start"), p.attributes.get("end")
        return dims[start.as_int() if start is not None else 0:end.as_int() if end is not None else None]
    if p.op_type in ("Cast", "Identity", "Squeeze", "Unsqueeze"):
        inner = _shape_value(p.inputs[0], depth + 1)
        return inner if inner is not None and len(inner) <= 1 or p.op_type in ("Cast", "Identity") else None
    if p.op_type == "Concat":
        parts = [_shape_value(x, depth + 1) for x in p.inputs]
        return None if any(q is None for q in parts) else [d for q in parts for d in q]
    if p.op_type == "Slice":
        src = _shape_value(p.inputs[0], depth + 1)
        starts, ends = _const(p.inputs[1]), _const(p.inputs[2])
        axes = _const(p.inputs[3]) if len(p.inputs) > 3 and p.inputs[3] is not None else None
        steps = _const(p.inputs[4]) if len(p.inputs) > 4 and p.inputs[4] is not None else None
        if src is None or starts is None or ends is None or starts.size != 1 or ends.size != 1:
            return None
        if (axes is not None and int(axes.reshape(-1)[0]) not in (0, -1)) or (steps is not None and int(steps.reshape(-1)[0]) != 1):
            return None
        n = len(src)
        lo, hi = int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])
        lo, hi = max(0, min(n, lo + n if lo < 0 else lo)), max(0, min(n, hi + n if hi < 0 else hi))
        return src[lo:hi]
    if p.op_type == "Gather":
        src, idx = _shape_value(p.inputs[0], depth + 1), _const(p.inputs[1])
        if src is None or idx is None:
            return None
        try:
            return [src[int(i)] for i in np.asarray(idx).reshape(-1)]
        except IndexError:
            return None
    return None


def _keepdims0(model: ir.Model, notes) -> int:
    n = 0
    done: set = set()
    for node in list(model.graph):
        if node in done or node.op_type not in _REDUCTIONS or node.domain not in _ONNX or _keepdims(node) != 0:
            continue
        axes, rank = _axes(node), rank_of(node.inputs[0])
        if not axes or rank is None:
            continue
        found = _keepdims_region(node, axes, rank)
        if found is None:
            continue
        reds, region, frontier = found
        if not frontier:
            continue
        for r in reds:
            r.attributes["keepdims"] = ir.AttrInt64("keepdims", 1)
            r.outputs[0].shape = None
            done.add(r)
        for r in region:
            for o in r.outputs:
                o.shape = None
        for f in frontier:
            if f.op_type == "Reshape":  # Expand(Reshape(v, s), s) is Reshape(v, s): the Expand goes too
                for user, _ in list(f.outputs[0].uses()):
                    if user.op_type == "Expand" and user.domain in _ONNX and user.inputs[1] is f.inputs[1] \
                            and not user.outputs[0].is_graph_output():
                        _replace(user.outputs[0], f.outputs[0])
            _replace(f.outputs[0], f.inputs[0])
        n += len(reds)
    return n


def _div_constant(model: ir.Model, notes) -> int:
    n = 0
    for node in _main_nodes(model, "Div"):
        c = _const(node.inputs[1])
        if c is None or c.dtype.kind != "f" or c.size > FOLD_LIMIT or not np.all(c != 0) \
                or _const(node.inputs[0]) is not None:
            continue
        inv = _initializer(model.graph, (1.0 / c.astype(np.float64)).astype(c.dtype), f"{node.inputs[1].name}_reciprocal")
        mul = ir.Node("", "Mul", [node.inputs[0], inv], num_outputs=1)
        model.graph.insert_before(node, mul)
        _replace(node.outputs[0], mul.outputs[0], fresh=True)
        n += 1
    return n


_N_RTOL = {np.dtype(np.float32): 1e-6, np.dtype(np.float64): 1e-12, np.dtype(np.float16): 1e-3}


def _sum_to_mean(model: ir.Model, notes) -> int:
    n = 0
    for node in _main_nodes(model, "ReduceSum"):
        s = node.outputs[0]
        uses = list(s.uses())
        if len(uses) != 1 or s.is_graph_output() or uses[0][0].op_type != "Mul" or uses[0][0].domain not in _ONNX:
            continue
        mul, idx = uses[0]
        k = _const(mul.inputs[1 - idx])
        x, axes, rank = node.inputs[0], _axes(node), rank_of(node.inputs[0])
        if k is None or k.size != 1 or k.dtype.kind != "f" or not axes or rank is None:
            continue
        dims = [x.shape[a % rank] for a in axes]
        if not all(isinstance(d, int) for d in dims):
            continue
        count = float(np.prod(dims))
        val = float(k.reshape(()))
        if abs(val - 1.0 / count) > _N_RTOL.get(k.dtype, 8e-3) / count:
            notes.append(f"canonical: ReduceSum {node.name or s.name!r} · {val:.9g}: the factor is not 1/n = "
                         f"{1.0 / count:.9g} for {int(count)} reduced elements (not a mean)")
            continue
        mean = _reduce_mean(model.graph, model, node, x, [a % rank for a in axes], _keepdims(node))
        _replace(mul.outputs[0], mean.outputs[0], fresh=True)
        n += 1
    return n


def _gap_to_mean(model: ir.Model, notes) -> int:
    n = 0
    for node in _main_nodes(model, "GlobalAveragePool"):
        rank = rank_of(node.inputs[0])
        if rank is None or rank < 3:
            continue
        mean = _reduce_mean(model.graph, model, node, node.inputs[0], list(range(2, rank)))
        mean.name = f"{_GAP_KEY}/{node.name or n}"
        _replace(node.outputs[0], mean.outputs[0], fresh=True)
        n += 1
    return n


def _inverse_root(model: ir.Model, notes) -> int:
    n = 0
    for node in list(model.graph):
        if node.domain not in _ONNX:
            continue
        if node.op_type == "Pow" and _scalar(node.inputs[1]) == -0.5 and node.inputs[0] is not None \
                and (node.inputs[0].dtype is None or node.inputs[0].dtype in FLOAT_TYPES):
            sqrt = ir.Node("", "Sqrt", [node.inputs[0]], num_outputs=1)
        elif node.op_type == "Div" and _scalar(node.inputs[0]) == 1.0 and node.inputs[1] is not None \
                and node.inputs[1].producer() is not None and node.inputs[1].producer().op_type == "Sqrt":
            sqrt = None
        else:
            continue
        if sqrt is not None:
            model.graph.insert_before(node, sqrt)
            root = sqrt.outputs[0]
        else:
            root = node.inputs[1]
        rec = ir.Node("", "Reciprocal", [root], num_outputs=1)
        model.graph.insert_before(node, rec)
        _replace(node.outputs[0], rec.outputs[0], fresh=True)
        n += 1
    return n


def _channels(node: ir.Node) -> int | None:
    w = node.inputs[1] if len(node.inputs) > 1 else None
    if w is None or w.shape is None or len(w.shape) < 3 or not all(isinstance(d, int) for d in w.shape[:2]):
        return None
    if node.op_type == "Conv":
        return int(w.shape[0])
    g = node.attributes.get("group")
    return int(w.shape[1]) * (g.as_int() if g is not None else 1)


def _per_channel(a: np.ndarray | None, channels: int, rank: int) -> np.ndarray | None:
    """`a` as one value per channel (axis 1 of a rank-`rank` tensor) when it broadcasts that way."""
    if a is None or a.dtype.kind != "f" or a.ndim > rank:
        return None
    if a.size == 1:
        return np.full(channels, a.reshape(()), a.dtype)
    dims = [1] * (rank - a.ndim) + list(a.shape)
    if dims[1] != channels or any(d != 1 for i, d in enumerate(dims) if i != 1):
        return None
    return a.reshape(channels)


def _conv_chain(node: ir.Node):
    """(channels, rank, the single reader of the conv's output) or None."""
    if node.domain not in _ONNX or node.op_type not in ("Conv", "ConvTranspose"):
        return None
    c, y = _channels(node), node.outputs[0]
    rank = rank_of(node.inputs[1])
    uses = list(y.uses())
    if c is None or rank is None or len(uses) != 1 or y.is_graph_output():
        return None
    return c, rank, uses[0]


def _conv_bias(model: ir.Model, notes) -> int:
    n = 0
    for node in list(model.graph):
        chain = _conv_chain(node)
        if chain is None:
            continue
        c, rank, (add, idx) = chain
        if add.op_type != "Add" or add.domain not in _ONNX:
            continue
        t = _per_channel(_const(add.inputs[1 - idx]), c, rank)
        b = node.inputs[2] if len(node.inputs) > 2 else None
        b0 = _const(b, max_size=None) if b is not None else np.zeros(c, t.dtype if t is not None else np.float32)
        if t is None or b0 is None or b0.shape != (c,):
            continue
        bias = _initializer(model.graph, (b0.astype(np.float64) + t.astype(np.float64)).astype(b0.dtype),
                            f"{node.name or 'conv'}_bias")
        conv = ir.Node("", node.op_type, [node.inputs[0], node.inputs[1], bias], list(node.attributes.values()),
                       num_outputs=1, name=node.name)
        model.graph.insert_before(node, conv)
        _replace(add.outputs[0], conv.outputs[0], fresh=True)
        n += 1
    return n


def _conv_affine(model: ir.Model, notes) -> int:
    if _opset(model) < 9:
        return 0
    n = 0
    for node in list(model.graph):
        chain = _conv_chain(node)
        if chain is None:
            continue
        c, rank, (mul, idx) = chain
        if mul.op_type != "Mul" or mul.domain not in _ONNX or not _is_const(node.inputs[1]) \
                or (len(node.inputs) > 2 and node.inputs[2] is not None and not _is_const(node.inputs[2])):
            continue  # only where bn_fold can fold it: a constant weight and bias
        sa = _const(mul.inputs[1 - idx])
        s = _per_channel(sa, c, rank)
        if s is None:
            continue
        out, t = mul.outputs[0], np.zeros(c, s.dtype)
        uses = list(out.uses())
        if len(uses) == 1 and not out.is_graph_output() and uses[0][0].op_type == "Add" and uses[0][0].domain in _ONNX:
            add, j = uses[0]
            ta = _per_channel(_const(add.inputs[1 - j]), c, rank)
            if ta is not None and ta.dtype == s.dtype and np.asarray(_const(add.inputs[1 - j])).shape == np.asarray(sa).shape:
                t, out = ta, add.outputs[0]
        g = model.graph
        params = [_initializer(g, s, f"{node.name or 'conv'}_affine_scale"),
                  _initializer(g, t, f"{node.name or 'conv'}_affine_shift"),
                  _initializer(g, np.zeros(c, s.dtype), f"{node.name or 'conv'}_affine_mean"),
                  _initializer(g, np.ones(c, s.dtype), f"{node.name or 'conv'}_affine_var")]
        bn = ir.Node("", "BatchNormalization", [node.outputs[0], *params], [ir.AttrFloat32("epsilon", 0.0)],
                     num_outputs=1, name=f"{_AFFINE_KEY}/{node.name or n}")
        g.insert_before(mul, bn)
        _replace(out, bn.outputs[0], fresh=True)
        n += 1
    return n


STEPS = (
    ("constants", _lift_constants),
    ("fold", _fold),
    ("broadcast", _broadcast),
    ("keepdims", _keepdims0),
    ("div_constant", _div_constant),
    ("sum_to_mean", _sum_to_mean),
    ("gap_to_mean", _gap_to_mean),
    ("inverse_root", _inverse_root),
    ("conv_bias", _conv_bias),
    ("conv_affine", _conv_affine),
)
