"""Local verification of one fusion (docs/design.md §8): the subgraph a rule matched, with its own
constants, against the nodes that replace it, on random inputs of the shapes it sees; both are
compared with a float64 evaluation of the matched subgraph (onnx's reference evaluator).

Why local: the check scales with the fusion, not the model (an 8 B LLM's RMSNorm is verified on
one [1, 16, 4096] activation), cannot be drowned by downstream amplification, and works where the
whole model cannot run (an op onnxruntime lacks downstream, weights that do not fit twice).

How one check goes:
- the subgraph's boundary values are its inputs: constants (initializers, folded Constants) go in
  with their values; integer values computed from runtime shapes pull their producers in too
  (shared "context" nodes); the other float / integer values become graph inputs, their
  dims from shape inference with the graph inputs at concrete sizes (the --input sizes, else
  the first normexport.sizes tries), else a symbol's size from those inputs, else 3;
- float inputs are random rows of very different scales (std 1e-3 .. 10, non-zero mean), so that
  epsilon, mean subtraction and the normalized axis all matter;
- the original subgraph and the replacement run in onnxruntime (CPU) in their dtype; bfloat16
  graphs are widened to float32 there (onnxruntime's CPU provider has no bfloat16 Mul / MatMul);
  the float64 reference is the original with every float type widened to double;
- pass (docs/design.md §7 single-op rule): err(fused) <= max(tolerance, 2 x err(original)), both against
  float64, tolerance = rel x max|ref| + abs of the output's dtype; non-finite values must agree.
Identical subgraphs (same structure, shapes and constant bytes) are verified once."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Iterable

import numpy as np
import onnx
import onnx_ir as ir

from normexport import ops as _ops
from normexport.dtypes import FLOAT_TYPES as _FLOATS
from normexport.errors import first_line

from . import _verify

#: a symbolic dim nothing names gets this size (odd and > 1: broadcasting mistakes show)
DEFAULT_DIM = 3
#: integer values computed from shapes: at most this many producer nodes pulled in as context
_MAX_CONTEXT = 64
#: a producer with a constant input larger than this is never pulled in as context
_MAX_CONTEXT_CONST = 1 << 20


@dataclasses.dataclass
class LocalCheck:
    """One verified (or rejected) fusion, as the report lists it."""

    rule: str
    node: str
    shapes: dict[str, list[int]]
    dtype: str
    err_fused: float
    err_original: float
    tolerance: float
    passed: bool
    widened: bool
    reused: bool = False  # an identical subgraph was verified before: its result
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class LocalVerifier:
    """Verifies fusions one at a time (`verify(rule_name, where, delta)`), caching by structure."""

    def __init__(self, model: ir.Model, dims: dict[str, int] | None = None, seed: int = 0,
                 concrete: dict[str, list[int]] | None = None, types: dict[str, int] | None = None,
                 probe_note: str = "", prober=None) -> None:
        self.model = model
        self.dims = dict(dims or {})
        # {value name: dims} inferred with the inputs at concrete sizes, or read off a probe run
        self.concrete = dict(concrete or {})
        self.types = dict(types or {})  # {value name: ONNX element type} where shape inference had none
        self.probe_note = probe_note  # why no probe run gave the sizes shape inference left unknown
        # prober(model) -> ({name: dims}, {name: elem type}, why-not): run once, at the first fusion
        # whose boundary shape inference did not reach (large models: no run unless one needs it)
        self.prober = prober
        self.seed = seed
        self.checks: list[LocalCheck] = []
        self._cache: dict[str, LocalCheck] = {}

    # -- public -------------------------------------------------------------------------------
    def verify(self, rule: str, where: str, delta) -> str | None:
        """None when the replacement in `delta` (onnxscript ReplacementSubgraph) computes what the
        matched nodes compute, else the reason (one line)."""
        try:
            try:
                built = _Local(self, delta)
            except _Unknown:
                if self.prober is None:
                    raise
                prober, self.prober = self.prober, None
                dims, types, self.probe_note = prober(self.model)
                for k, d in dims.items():
                    self.concrete.setdefault(k, d)
                self.types.update(types)
                built = _Local(self, delta)
        except _Unverifiable as e:
            self.checks.append(LocalCheck(rule, where, {}, "", float("nan"), float("nan"), float("nan"),
                                          False, False, why=str(e)))
            return f"cannot verify locally: {e}"
        key = built.key()
        if key in self._cache:
            prev = self._cache[key]
            self.checks.append(dataclasses.replace(prev, rule=rule, node=where, reused=True))
            return None if prev.passed else prev.why
        check = built.run(rule, where, self.seed + len(self._cache))
        self._cache[key] = check
        self.checks.append(check)
        return None if check.passed else check.why

    def summary(self) -> dict[str, Any]:
        return {
            "checked": len(self.checks),
            "distinct": sum(1 for c in self.checks if not c.reused and c.dtype),  # subgraphs built and run
            "passed": sum(1 for c in self.checks if c.passed),
            "widened_bf16": any(c.widened for c in self.checks),
        }


class _Unverifiable(Exception):
    pass


class _Unknown(_Unverifiable):
    """A boundary value whose shape or type shape inference did not reach (a probe run can tell)."""


def _topo(nodes: Iterable[ir.Node]) -> list[ir.Node]:
    """`nodes` in an order where producers come first (among themselves)."""
    nodes = list(dict.fromkeys(nodes))
    members = set(nodes)
    done: set[ir.Node] = set()
    out: list[ir.Node] = []

    def visit(n: ir.Node, depth: int = 0) -> None:
        if n in done:
            return
        if depth > 10_000:
            raise _Unverifiable("subgraph too deep")
        done.add(n)
        for v in n.inputs:
            p = v.producer() if v is not None else None
            if p is not None and p in members:
                visit(p, depth + 1)
        out.append(n)

    for n in nodes:
        visit(n)
    return out


def _is_const(v: ir.Value) -> bool:
    return v.const_value is not None and not v.is_graph_input()


class _Local:
    """The two local models of one fusion (original, replacement) plus what is needed to run them."""

    def __init__(self, owner: LocalVerifier, delta) -> None:
        self.owner = owner
        match = delta.match
        orig_nodes = list(match.nodes)
        new_nodes = list(delta.new_nodes)
        self.outputs_orig = list(match.outputs)
        self.outputs_new = list(delta.new_outputs)
        new_inits = {id(v) for v in delta.new_initializers}

        def boundary(nodes):
            made = {id(o) for n in nodes for o in n.outputs}
            seen: dict[int, ir.Value] = {}
            for n in nodes:
                for v in n.inputs:
                    if v is not None and id(v) not in made:
                        seen.setdefault(id(v), v)
            return list(seen.values())

        b_orig, b_new = boundary(orig_nodes), boundary(new_nodes)
        # shared context, pulled in before both: the producers of integer values computed at run
        # time (shapes), and of a value only the matched subgraph reads (a replacement that reads
        # the input of a Cast the match started from: the Cast goes in, its input is what both
        # read). Never a producer with a large constant input (an embedding Gather): the check
        # stays the size of the fusion.
        only_orig = {id(v) for v in b_orig} - {id(v) for v in b_new}
        context: list[ir.Node] = []
        todo = [(v, id(v) in only_orig) for v in b_orig + b_new if not _is_const(v) and id(v) not in new_inits]
        seen_ctx: set[int] = set()
        while todo:
            v, lopsided = todo.pop()
            p = v.producer()
            if p is None or _is_const(v) or (self._elem(v) in _FLOATS and not lopsided) or id(p) in seen_ctx:
                continue
            if p in orig_nodes or any(x is not None and _is_const(x) and _nbytes(x) > _MAX_CONTEXT_CONST for x in p.inputs):
                continue
            seen_ctx.add(id(p))
            context.append(p)
            if len(context) > _MAX_CONTEXT:
                raise _Unverifiable("the subgraph's integer inputs come from a long computation")
            todo.extend((x, False) for x in p.inputs if x is not None)
        self.context = _topo(context)
        self.orig = _topo(orig_nodes)
        self.new = _topo(new_nodes)
        ctx_made = {id(o) for n in self.context for o in n.outputs}
        # the local models' inputs: every boundary value not made by the context
        ins: dict[int, ir.Value] = {}
        for v in boundary(self.context) + b_orig + b_new:
            if id(v) not in ctx_made:
                ins.setdefault(id(v), v)
        self.consts = [v for v in ins.values() if _is_const(v) or id(v) in new_inits]
        self.runtime = [v for v in ins.values() if not (_is_const(v) or id(v) in new_inits)]
        for v in self.runtime:
            if (v.shape is None and (v.name or "") not in self.owner.concrete) or not self._elem(v):
                raise _Unknown(f"shape or type of {v.name!r} unknown (shape inference did not reach it"
                                    f"{'; ' + self.owner.probe_note if self.owner.probe_note else ''})")
        for v in self.outputs_orig:
            if not self._elem(v):
                raise _Unknown(f"type of output {v.name!r} unknown")
        # local names, in a deterministic order (structure -> the same names -> the same bytes)
        self.names: dict[int, str] = {}
        for i, v in enumerate(self.runtime):
            self.names[id(v)] = f"in{i}"
        for i, v in enumerate(self.consts):
            self.names[id(v)] = f"c{i}"
        counter = 0
        for n in self.context + self.orig + self.new:
            for o in n.outputs:
                if id(o) not in self.names:
                    self.names[id(o)] = f"t{counter}"
                    counter += 1
        self.shapes = {self.names[id(v)]: self._dims(v) for v in self.runtime}
        self.dtype_name = ir.DataType(self._elem(self.outputs_orig[0])).name.lower()
        self._protos = {"orig": self._model(self.orig, self.outputs_orig), "new": self._model(self.new, self.outputs_new)}

    # -- building -----------------------------------------------------------------------------
    def _elem(self, v: ir.Value) -> int:
        """The ONNX element type of `v`: shape inference's, else the probe run's (0: unknown)."""
        return _elem(v) or self.owner.types.get(v.name or "", 0)

    def _dims(self, v: ir.Value) -> list[int]:
        known = self.owner.concrete.get(v.name or "")
        if known is not None and (v.shape is None or len(known) == len(v.shape)):
            return list(known)
        out = []
        for d in v.shape:
            if isinstance(d, int):
                out.append(d)
            else:
                sym = getattr(d, "value", None)
                out.append(self.owner.dims.get(sym, DEFAULT_DIM) if sym else DEFAULT_DIM)
        return out

    def _node_proto(self, n: ir.Node) -> onnx.NodeProto:
        renamed = []
        for v in list(n.inputs) + list(n.outputs):
            if v is not None and not v.name:
                v.name = "_normexport_tmp"
                renamed.append(v)
        try:
            p = ir.serde.serialize_node(n)
        finally:
            for v in renamed:
                v.name = None
        for i, v in enumerate(n.inputs):
            p.input[i] = self.names[id(v)] if v is not None else ""
        for i, v in enumerate(n.outputs):
            p.output[i] = self.names.get(id(v), "")
        p.name = ""
        p.doc_string = ""
        del p.metadata_props[:]
        return p

    def _model(self, nodes: list[ir.Node], outputs: list[ir.Value]) -> onnx.ModelProto:
        used = {i for n in self.context + nodes for i in (self.names.get(id(v)) for v in n.inputs if v is not None)}
        inputs = [onnx.helper.make_tensor_value_info(self.names[id(v)], self._elem(v), self._dims(v))
                  for v in self.runtime if self.names[id(v)] in used]
        inits = []
        for v in self.consts:
            name = self.names[id(v)]
            if name not in used:
                continue
            t = onnx.numpy_helper.from_array(np.asarray(v.const_value.numpy()), name)
            inits.append(t)
        outs = [onnx.helper.make_tensor_value_info(self.names[id(v)], self._elem(v) or self._elem(o), None)
                for v, o in zip(outputs, self.outputs_orig)]
        graph = onnx.helper.make_graph([self._node_proto(n) for n in self.context + nodes], "local", inputs, outs, inits)
        opsets = [onnx.helper.make_opsetid(d, v) for d, v in self.owner.model.opset_imports.items()]
        model = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=min(self.owner.model.ir_version or 10, 10))
        if any(n.domain == _ops.DOMAIN for n in model.graph.node):
            _ops.attach_functions(model)
        return model

    def key(self) -> str:
        h = hashlib.sha1()
        for k in ("orig", "new"):
            h.update(self._protos[k].SerializeToString(deterministic=True))
        h.update(repr(sorted(self.shapes.items())).encode())
        return h.hexdigest()

    # -- running ------------------------------------------------------------------------------
    def _feeds(self, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        feeds = {}
        for v in self.runtime:
            name, dims, elem = self.names[id(v)], self._dims(v), self._elem(v)
            if elem in _FLOATS:
                rows = dims[:-1] + [1] if dims else []
                scale = 10.0 ** rng.uniform(-3, 1, size=rows) if dims else 1.0
                mean = rng.standard_normal(rows) if dims else 0.0
                a = (rng.standard_normal(dims) + mean) * scale
                feeds[name] = a.astype(_verify.np_dtype(elem))
            elif elem == onnx.TensorProto.BOOL:
                feeds[name] = rng.integers(0, 2, size=dims).astype(bool)
            else:
                dt = _verify.np_dtype(elem)
                if dt is None:
                    raise _Unverifiable(f"input {v.name!r} has a type onnxruntime cannot feed")
                feeds[name] = rng.integers(0, 3, size=dims).astype(dt)
        return feeds

    def run(self, rule: str, where: str, seed: int) -> LocalCheck:
        feeds = self._feeds(seed)
        widened = any(self._elem(v) == onnx.TensorProto.BFLOAT16 for v in self.runtime + self.consts + self.outputs_orig) or \
            any(_mentions(p, onnx.TensorProto.BFLOAT16) for p in self._protos.values())
        try:
            ref = _reference(_retype(self._protos["orig"], _FLOATS - {onnx.TensorProto.DOUBLE}, onnx.TensorProto.DOUBLE),
                             {k: _widen(a, np.float64) for k, a in feeds.items()})
        except Exception as e:  # noqa: BLE001
            return self._fail(rule, where, widened, f"cannot verify locally: the float64 reference failed ({first_line(e, 160)})")
        runs = {}
        for k, proto in self._protos.items():
            if widened:
                proto = _retype(proto, {onnx.TensorProto.BFLOAT16}, onnx.TensorProto.FLOAT)
            want = {i.name for i in proto.graph.input}
            f = {n: (_widen(a, np.float32) if widened and a.dtype == _verify.BF16 else a)
                 for n, a in feeds.items() if n in want}
            try:
                runs[k] = _verify.run(proto, f)
            except Exception as e:  # noqa: BLE001
                which = "the matched subgraph" if k == "orig" else "the fused node(s)"
                return self._fail(rule, where, widened, f"{which} did not run in onnxruntime ({first_line(e, 160)})")
        errs = {"orig": 0.0, "new": 0.0}
        tol = 0.0
        ok = True
        worst = ""
        for o_orig, o_new in zip(self.outputs_orig, self.outputs_new):
            name_o, name_n = self.names[id(o_orig)], self.names[id(o_new)]
            r = np.asarray(ref[name_o], dtype=np.float64)
            eo, en = _err(r, runs["orig"][name_o]), _err(r, runs["new"][name_n])
            rel, ab = _verify._TOL.get(_verify.np_dtype(self._elem(o_orig)), _verify.BF16_TOL)
            finite = np.isfinite(r)
            t = rel * (float(np.abs(r[finite]).max()) if finite.any() else 0.0) + ab
            limit = max(t, 2.0 * eo) if np.isfinite(eo) else t  # a broken original excuses nothing
            good = en <= limit
            if not good and not worst:
                worst = (f"max abs err {en:.3g} vs float64 > limit {limit:.3g} "
                         f"(tolerance {t:.3g}, the matched subgraph's own error {eo:.3g})")
            ok &= good
            errs["orig"], errs["new"], tol = max(errs["orig"], eo), max(errs["new"], en), max(tol, t)
        return LocalCheck(rule, where, dict(self.shapes), self.dtype_name, errs["new"], errs["orig"], tol, ok, widened,
                          why="" if ok else worst)

    def _fail(self, rule, where, widened, why) -> LocalCheck:
        return LocalCheck(rule, where, dict(self.shapes), self.dtype_name, float("nan"), float("nan"), float("nan"),
                          False, widened, why=why)


def _nbytes(v: ir.Value) -> int:
    try:
        return int(v.const_value.nbytes)
    except Exception:  # noqa: BLE001 - a tensor without a size
        return 0


def _elem(v: ir.Value) -> int:
    return int(v.dtype.value) if v.dtype is not None else 0


def _widen(a: np.ndarray, dt) -> np.ndarray:
    return a.astype(dt) if a.dtype.kind == "f" or a.dtype == _verify.BF16 else a


def _err(ref: np.ndarray, got: np.ndarray) -> float:
    """max |got - ref| over the finite reference values; inf when non-finite values disagree
    (a NaN where the reference has a number, or the other way round)."""
    g = np.asarray(got).astype(np.float64)
    if g.shape != ref.shape:
        return float("inf")
    finite = np.isfinite(ref)
    if not np.array_equal(np.isnan(ref), np.isnan(g)) or not np.array_equal(ref[~finite & ~np.isnan(ref)],
                                                                                g[~finite & ~np.isnan(ref)]):
        return float("inf")
    if not finite.any():
        return 0.0
    d = np.abs(g[finite] - ref[finite])
    return float("inf") if not np.isfinite(d).all() else float(d.max())


def _mentions(model: onnx.ModelProto, elem: int) -> bool:
    for n in model.graph.node:
        for a in n.attribute:
            if a.name == "to" and a.i == elem:
                return True
    return False


def _retype(model: onnx.ModelProto, src: set[int], dst: int) -> onnx.ModelProto:
    """A copy of `model` with every tensor type in `src` replaced by `dst`: inputs, outputs,
    initializers, Cast targets, Constant values (functions are retyped by onnx itself: they are
    polymorphic, their internal Casts follow CastLike / the input types)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.tensor_type.elem_type in src:
            vi.type.tensor_type.elem_type = dst
    np_dst = onnx.helper.tensor_dtype_to_np_dtype(dst)
    for i, t in enumerate(g.initializer):
        if t.data_type in src:
            arr = onnx.numpy_helper.to_array(t).astype(np_dst)
            g.initializer[i].CopyFrom(onnx.numpy_helper.from_array(arr, t.name))
    for n in list(g.node) + [n for f in out.functions for n in f.node]:
        for a in n.attribute:
            if a.name == "to" and a.type == onnx.AttributeProto.INT and a.i in src:
                a.i = dst  # (stash_type stays: onnx's evaluator computes in the input's dtype)
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type in src:
                arr = onnx.numpy_helper.to_array(a.t).astype(np_dst)
                a.t.CopyFrom(onnx.numpy_helper.from_array(arr, a.t.name))
    return out


def _reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    sess = ReferenceEvaluator(model)
    names = [o.name for o in model.graph.output]
    want = {i.name for i in model.graph.input}
    return dict(zip(names, sess.run(names, {k: v for k, v in feeds.items() if k in want})))


def concrete_shapes(model: ir.Model, sizes: dict[str, list[int]]) -> dict[str, list[int]]:
    """{value name: dims} from onnx shape inference run with the graph inputs fixed to `sizes`
    (on the model without its weights; the model itself keeps its symbolic shapes)."""
    from onnx_ir.passes.common import _c_api_utils

    def infer(proto: onnx.ModelProto) -> dict[str, list[int]]:
        for vi in proto.graph.input:
            dims = sizes.get(vi.name)
            if dims is None:
                continue
            shape = vi.type.tensor_type.shape
            del shape.dim[:]
            for d in dims:
                shape.dim.add().dim_value = int(d)
        inferred = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)
        out = {}
        for vi in list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input):
            tt = vi.type.tensor_type
            if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
                out[vi.name] = [d.dim_value for d in tt.shape.dim]
        return out

    if not sizes:
        return {}
    try:
        return _c_api_utils.call_onnx_api(infer, model)
    except Exception:  # noqa: BLE001 - then symbols and defaults decide
        return {}


def probe_shapes(proto: onnx.ModelProto, model: ir.Model, concrete: dict[str, list[int]],
                 given: dict[str, list[int]] | None,
                 external_folder: str | None = None) -> tuple[dict[str, list[int]], dict[str, int], str]:
    """Where ONNX shape inference stops (an op of a domain it does not know, a Reshape to a shape
    computed at run time, a Loop / If): the dims and element types of the values it left unknown,
    read off one onnxruntime run of the model (at the --input sizes, else sizes normexport.sizes
    finds) with those values as extra graph outputs. `proto` is the model as a ModelProto: the
    outputs are added to it for the run and removed after (no copy of its weights); only the
    outputs' shapes and types are kept, the arrays are dropped.
    Returns ({value name: dims}, {value name: ONNX element type}, "" or why the probe did not run)."""
    from normexport import sizes as _sizes

    graph_outputs = {o.name for o in proto.graph.output}
    # values of `proto` only: the model may have new ones (canonical forms, docs/design.md §11) the proto has not
    written = {o for n in proto.graph.node for o in n.output}
    missing = []
    for n in model.graph:
        for v in n.outputs:
            if v.name and v.name in written and (v.name not in concrete or v.dtype is None):
                missing.append(v)
    if not missing:
        return {}, {}, ""
    # an output of unknown type is named only (onnxruntime refuses element type 0, takes no type)
    added = [onnx.helper.make_tensor_value_info(v.name, _elem(v), None) if v.dtype is not None else onnx.ValueInfoProto(name=v.name)
             for v in missing if v.name not in graph_outputs]
    n_before = len(proto.graph.output)
    proto.graph.output.extend(added)
    try:
        found = _sizes.find(proto, given, external_folder=external_folder)
    except Exception as e:  # noqa: BLE001
        return {}, {}, f"the probe run failed: {first_line(e, 200)}"
    finally:
        del proto.graph.output[n_before:]
    dims, types = {}, {}
    for v in missing:
        arr = found.outputs.get(v.name)
        if arr is None:
            continue
        dims[v.name] = list(np.shape(arr))
        if v.dtype is None:
            elem = _np_to_elem(np.asarray(arr).dtype)
            if elem:
                types[v.name] = elem
    found.outputs.clear()
    return dims, types, ""


def _np_to_elem(dt: np.dtype) -> int:
    if dt == _verify.BF16:
        return onnx.TensorProto.BFLOAT16
    try:
        return int(onnx.helper.np_dtype_to_tensor_dtype(dt))
    except Exception:  # noqa: BLE001 - strings, objects
        return 0


def probe_ir(model: ir.Model, concrete: dict[str, list[int]],
             given: dict[str, list[int]] | None) -> tuple[dict[str, list[int]], dict[str, int], str]:
    """probe_shapes for a model too large to hold as a proto beside itself: serialised with its
    external tensors as references (no weight bytes read or copied: onnxruntime reads them from
    their folder); in-memory weights (the fused ones, a model without external data) are copied."""
    import os

    folders = {os.fspath(v.const_value.base_dir) for v in model.graph.initializers.values()
               if isinstance(v.const_value, ir.ExternalTensor)}
    if len(folders) > 1:
        return {}, {}, "no probe run: the weights lie in several folders"
    try:
        proto = ir.serde.serialize_model(model)
    except Exception as e:  # noqa: BLE001
        return {}, {}, f"no probe run: the model does not serialise ({first_line(e, 160)})"
    return probe_shapes(proto, model, concrete, given, external_folder=folders.pop() if folders else None)
