"""An ONNX file checked before anything works on it (docs/design.md §14): a damaged or invalid file is a
UsageError of one line naming what is wrong, never an internal error later, nor an output that
onnx's checker refuses.

The graph's wiring is checked here first (dangling names, cycles, names produced twice, graph
outputs nothing produces, opset versions, negative dims), each with its own message; then
onnx.checker (full check: strict shape inference), whose refusal is the generic "damaged" line
with the checker's own reason. External weights stay on disk."""

from __future__ import annotations

import os
import re
from pathlib import Path

import onnx
import onnx.defs

from .errors import UsageError

_FIX = "re-export the model or repair the file"


def _one_line(text: str, limit: int = 240) -> str:
    """The checker's message on one line: the context block folded in, whitespace collapsed."""
    text = text.replace("==> Context:", "; at").replace("Bad node spec for node.", "")
    text = re.sub(r"\s+", " ", text).strip(" ;")
    return text[:limit] + ("..." if len(text) > limit else "")


def _node_name(n: onnx.NodeProto, i: int) -> str:
    return f"'{n.name}' ({n.op_type})" if n.name else f"#{i} ({n.op_type})"


def check_wiring(path: str | os.PathLike, model: onnx.ModelProto) -> None:
    """The main graph's values: each node input produced by a graph input, an initializer or a
    node (no dangling names), each value produced once, no cycle, every graph output produced."""
    g = model.graph
    if not g.output:
        what = "has no nodes and no outputs (an empty or truncated file parses as an empty model)" if not g.node else \
            "has no outputs (nothing it computes leaves it)"
        raise UsageError(f"'{path}' is damaged: the graph {what}: {_FIX}")
    given = {v.name for v in g.input} | {t.name for t in g.initializer} | {t.values.name for t in g.sparse_initializer}
    producer: dict[str, int] = {}
    for i, n in enumerate(g.node):
        for o in n.output:
            if not o:
                continue
            if o in producer:
                raise UsageError(f"'{path}' is damaged: value '{o}' is produced twice (nodes {_node_name(g.node[producer[o]], producer[o])} "
                                 f"and {_node_name(n, i)}); ONNX value names are unique: {_FIX}")
            if o in given:
                raise UsageError(f"'{path}' is damaged: node {_node_name(n, i)} writes '{o}', which is also a graph input or "
                                 f"initializer; ONNX value names are unique: {_FIX}")
            producer[o] = i
    for i, n in enumerate(g.node):
        for x in n.input:
            if x and x not in given and x not in producer:
                raise UsageError(f"'{path}' is damaged: node {_node_name(n, i)} reads '{x}', which no node, graph input or "
                                 f"initializer produces (a dangling name; a node dropped?): {_FIX}")
    for v in g.output:
        if v.name not in given and v.name not in producer:
            raise UsageError(f"'{path}' is damaged: graph output '{v.name}' is produced by no node (a node dropped?): {_FIX}")
    # a cycle: depth-first over the producers of each node's inputs (iterative: deep graphs)
    state = [0] * len(g.node)  # 0 new, 1 on the stack, 2 done
    for start in range(len(g.node)):
        if state[start]:
            continue
        stack = [(start, iter([producer[x] for x in g.node[start].input if x in producer]))]
        state[start] = 1
        while stack:
            i, deps = stack[-1]
            j = next(deps, None)
            if j is None:
                state[i] = 2
                stack.pop()
            elif state[j] == 1:
                raise UsageError(f"'{path}' is damaged: the graph has a cycle through node {_node_name(g.node[j], j)} "
                                 f"(it depends on its own output): {_FIX}")
            elif state[j] == 0:
                state[j] = 1
                stack.append((j, iter([producer[x] for x in g.node[j].input if x in producer])))


def check_opsets(path: str | os.PathLike, model: onnx.ModelProto) -> None:
    """The default domain's opset is one this onnx knows; every node's domain is imported."""
    known = onnx.defs.onnx_opset_version()
    imported = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    v = imported.get("ai.onnx")
    if v is not None and not 1 <= v <= known:
        raise UsageError(f"'{path}': ai.onnx opset {v} is not a version onnx {onnx.__version__} knows (1 to {known}): "
                         "pass a model exported at a known opset")
    for i, n in enumerate(model.graph.node):
        if (n.domain or "ai.onnx") not in imported:
            raise UsageError(f"'{path}' is damaged: node {_node_name(n, i)} is in domain '{n.domain}', which the model "
                             f"does not import (no opset_import entry): {_FIX}")


def check_dims(path: str | os.PathLike, model: onnx.ModelProto) -> None:
    """Graph inputs and outputs: no dim below -1 (a dim is a size >= 0, a name, or -1: dynamic, as
    Paddle2ONNX writes it and onnxruntime reads it)."""
    for kind, values in (("input", model.graph.input), ("output", model.graph.output)):
        for v in values:
            if not v.type.HasField("tensor_type") or not v.type.tensor_type.HasField("shape"):
                continue
            for axis, d in enumerate(v.type.tensor_type.shape.dim):
                if d.HasField("dim_value") and d.dim_value < -1:  # -1: dynamic (Paddle2ONNX writes it)
                    raise UsageError(f"'{path}' is damaged: graph {kind} '{v.name}' has dim {d.dim_value} at axis {axis} "
                                     f"(a dim is a size >= 0, a name or -1): {_FIX}")


def check_text(path: str | os.PathLike, model: onnx.ModelProto) -> None:
    """Every text field (names, op types, metadata) is UTF-8: protobuf parses ONNX's proto2 strings
    without decoding them, and hands out bytes where they are not (corrupt bytes), which onnx-ir
    fails on only when it writes the model."""
    from google.protobuf.descriptor import FieldDescriptor

    string, message = FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE
    stack = [(model, "model")]
    while stack:
        msg, where = stack.pop()
        for field, value in msg.ListFields():
            if field.type == string:
                for i, text in enumerate(value if field.is_repeated else (value,)):
                    if isinstance(text, bytes):
                        raise UsageError(f"'{path}' is damaged: {where}.{field.name} is not valid UTF-8 text "
                                         f"({text[:40]!r}; corrupt bytes?): {_FIX}")
            elif field.type == message:
                if field.is_repeated:
                    stack.extend((m, f"{where}.{field.name}[{i}]") for i, m in enumerate(value))
                else:
                    stack.append((value, f"{where}.{field.name}"))


def tensors(model: onnx.ModelProto):
    """Every TensorProto of a model: initializers, sparse ones, Constant / attribute tensors, in the
    main graph, its subgraphs (If / Loop / Scan bodies) and the functions."""
    def graph(g):
        yield from g.initializer
        for sp in g.sparse_initializer:
            yield sp.values
            yield sp.indices
        yield from nodes(g.node)

    def nodes(ns):
        for n in ns:
            for a in n.attribute:
                if a.HasField("t"):
                    yield a.t
                yield from a.tensors
                if a.HasField("g"):
                    yield from graph(a.g)
                for sub in a.graphs:
                    yield from graph(sub)

    yield from graph(model.graph)
    for f in model.functions:
        yield from nodes(f.node)


def _without_external(path: Path, model: onnx.ModelProto) -> onnx.ModelProto | str:
    """What the checker reads: the file by path when all weights are inside it (the C++ checker
    reads it: no copy of embedded weights serialised from Python); else `model` with its
    initializers kept in external data as graph inputs of their type and shape
    (io.check_external_data checked their files, links inside the folder allowed; the checker
    would look for them from the current folder, and refuses any link)."""
    if not any(t.data_location == onnx.TensorProto.EXTERNAL for t in tensors(model)):
        return str(path)
    ext = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    names = {t.name for t in ext}
    inputs = {v.name for v in copy.graph.input}
    kept = [t for t in copy.graph.initializer if t.name not in names]
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(kept)
    copy.graph.input.extend(_typed_input(t) for t in ext if t.name not in inputs)
    return copy


def run_checker(source: str | onnx.ModelProto, model: onnx.ModelProto | None = None) -> None:
    """onnx.checker's full check of a file (by path) or a proto. A graph input or output with a
    type but no shape (unknown rank: real converters write it, onnxruntime runs it, the checker's
    value-info rule refuses it) is not damage: such a model is checked as a copy whose shapeless
    inputs / outputs say rank 0, without the strict shape inference that claim would upset."""
    if isinstance(source, onnx.ModelProto):
        model = source
    elif model is None:  # (the caller's proto, when it has one: no second copy of embedded weights)
        model = onnx.load(str(source), load_external_data=False)
    io = list(model.graph.input) + list(model.graph.output)
    if not any(v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape") for v in io):
        onnx.checker.check_model(source if isinstance(source, onnx.ModelProto) else str(source), full_check=True)
        return
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for v in list(copy.graph.input) + list(copy.graph.output):
        if v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape"):
            v.type.tensor_type.shape.SetInParent()
    onnx.checker.check_model(copy, full_check=False)


def _typed_input(t: onnx.TensorProto) -> onnx.ValueInfoProto:
    """A graph input of the tensor's type and shape; a scalar's shape is set present with no dims
    (make_tensor_value_info leaves a rank-0 shape absent, which the checker refuses)."""
    vi = onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
    vi.type.tensor_type.shape.SetInParent()
    return vi


def check_file(path: str | os.PathLike, model: onnx.ModelProto) -> dict[str, list | None]:
    """All of the above, then onnx.checker's full check of `model`: the file's proto without its
    external data (which stays on disk). A refusal caused only by declared shapes (graph outputs,
    value_info) the graph does not compute is not damage: those declarations are corrected in
    `model` and returned ({value name: inferred dims or None}; see annotation_line), else {}."""
    path = Path(path)
    check_text(path, model)
    check_opsets(path, model)
    check_wiring(path, model)
    check_dims(path, model)
    try:
        run_checker(_without_external(path, model), model)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        fixes = _annotation_fixes(model)
        if fixes:  # declared shapes the graph does not produce: an annotation, corrected (onnxruntime overrides it)
            fixed = onnx.ModelProto()
            fixed.CopyFrom(model)
            apply_annotation_fixes(fixed, fixes)
            source = _without_external(path, fixed)
            try:
                run_checker(fixed if isinstance(source, str) else source, fixed)
            except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError):
                fixes = {}
        if not fixes:
            raise UsageError(f"'{path}' is damaged: onnx.checker refuses it: {_one_line(str(e))}: {_FIX}") from None
        apply_annotation_fixes(model, fixes)
        return fixes
    return {}


def _shape(t: onnx.TypeProto) -> list | None:
    """A tensor type's dims (an int, a name or None each), None when it has no shape."""
    if not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.tensor_type.shape.dim]


def _conflict(declared: list | None, inferred: list | None) -> bool:
    if declared is None or inferred is None:
        return False
    if len(declared) != len(inferred):
        return True
    return any(isinstance(a, int) and isinstance(b, int) and a >= 0 and b >= 0 and a != b
               for a, b in zip(declared, inferred))


def _annotation_fixes(model: onnx.ModelProto) -> dict[str, list | None]:
    """The declared shapes (graph outputs, value_info) that contradict what the graph computes:
    {value name: the inferred dims for a graph output (None: no shape), None for a value_info
    entry (dropped)}. Inferred on a copy with those declarations removed; only shapes are judged
    (a declared type, a dangling name, a size of an initializer stay the checker's to refuse)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.graph.value_info[:]
    for v in copy.graph.output:
        if v.type.HasField("tensor_type"):
            v.type.tensor_type.ClearField("shape")
    try:
        inferred = onnx.shape_inference.infer_shapes(copy, strict_mode=False)
    except Exception:  # noqa: BLE001 - inference itself fails: not an annotation
        return {}
    known = {v.name: _shape(v.type) for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    known = {k: None if d is None else [None if isinstance(x, str) and x.startswith("unk__") else x for x in d]
             for k, d in known.items()}  # onnx's invented names for unknown dims: left unnamed
    fixes: dict[str, list | None] = {}
    for v in model.graph.value_info:
        if v.name in known and _conflict(_shape(v.type), known[v.name]):
            fixes[v.name] = None
    for v in model.graph.output:
        if _conflict(_shape(v.type), known.get(v.name)):
            fixes[v.name] = known[v.name]
    return fixes


def apply_annotation_fixes(model: onnx.ModelProto, fixes: dict[str, list | None]) -> None:
    """The wrong declarations of `fixes` (from check_file) corrected in `model`: a graph output
    takes the inferred shape, a value_info entry is dropped."""
    outputs = {v.name for v in model.graph.output}
    kept = [v for v in model.graph.value_info if v.name not in fixes or v.name in outputs]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)
    for v in model.graph.output:
        if v.name in fixes and v.type.HasField("tensor_type"):
            v.type.tensor_type.ClearField("shape")
            if fixes[v.name] is not None:
                shape = v.type.tensor_type.shape
                shape.SetInParent()
                for d in fixes[v.name]:
                    dim = shape.dim.add()
                    if isinstance(d, int):
                        dim.dim_value = d
                    elif d:
                        dim.dim_param = d


def annotation_line(path, model: onnx.ModelProto, fixes: dict) -> str:
    """The terminal line saying what was corrected."""
    outputs = {v.name for v in model.graph.output}
    outs = [n for n in fixes if n in outputs]
    infos = [n for n in fixes if n not in outputs]
    parts = []
    if outs:
        parts.append("graph output(s) " + ", ".join(f"'{n}' now {_dims(fixes[n])}" for n in outs[:3]))
    if infos:
        parts.append(f"{len(infos)} value_info entr{'y' if len(infos) == 1 else 'ies'} dropped (first '{infos[0]}')")
    return (f"normexport: note: '{path}' declares shapes its graph does not compute (an annotation onnxruntime "
            f"overrides, not damage): {'; '.join(parts)}; corrected in what is written")


def _dims(dims: list | None) -> str:
    return "without a declared shape" if dims is None else "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"
