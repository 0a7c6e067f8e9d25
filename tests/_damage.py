"""Seeded damage of real ONNX files (docs/design.md §14), for tests/test_fuzz_damaged.py.

A case is (source file, damage kind, seed); `damage(case, folder)` writes the damaged copy as
`folder/model.onnx` (and, for the external-data kinds, its data file beside it) and returns a
short description. The same case always gives the same bytes.

`corpus(tmp)` is the real files: the bundled reference models (normexport.models: LLaMA, DiT,
BERT, Conv-BN, norm-heavy) exported plain (decomposed norms, what `rewrite` fuses) and fused
(`--target trt`: normexport ops), plus the ONNX files that installed wheels ship (onnxruntime's
datasets, onnx's backend test models exported by PyTorch).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import random
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

KINDS = (
    "truncate", "flip_bytes", "drop_node", "dangling_input", "cycle", "opset_99", "init_dims",
    "init_dtype", "attr_range", "no_outputs", "duplicate_name", "nan_weights", "zero_dim",
    "unknown_domain", "external_missing", "external_outside",
)


@dataclasses.dataclass(frozen=True)
class Case:
    source: Path
    kind: str
    seed: int

    @property
    def id(self) -> str:
        return f"{self.source.parent.name}-{self.source.stem}-{self.kind}-{self.seed}"


def cases(sources: list[Path], n: int, seed: int = 0) -> list[Case]:
    """`n` cases, every kind in turn (so any n >= len(KINDS) covers them all), sources and seeds
    drawn from one seeded generator."""
    rng = random.Random(seed)
    return [Case(sources[rng.randrange(len(sources))], KINDS[i % len(KINDS)], rng.randrange(1 << 30)) for i in range(n)]


# ------------------------------------------------------------------------------------------------
# the corpus
# ------------------------------------------------------------------------------------------------
#: (name, factory) of the reference models exported into the corpus
REFERENCE = (("conv_bn", "normexport.models.conv_bn:tiny"), ("bert", "normexport.models.bert:tiny"),
             ("llama", "normexport.models.llama:tiny"), ("dit", "normexport.models.dit:tiny"),
             ("norm_heavy", "normexport.models.norm_heavy:tiny"))

#: ONNX files shipped inside installed wheels (relative to site-packages)
SHIPPED = ("onnxruntime/datasets/logreg_iris.onnx", "onnxruntime/datasets/mul_1.onnx",
           "onnxruntime/datasets/sigmoid.onnx",
           *(f"onnx/backend/test/data/pytorch-operator/test_operator_{n}/model.onnx"
             for n in ("conv", "convtranspose", "maxpool", "addmm", "permute2", "chunk", "concat2", "pad",
                       "reduced_mean_keepdim", "params", "flatten", "view")))


def shipped_files() -> list[Path]:
    site = Path(onnx.__file__).parent.parent
    return [site / rel for rel in SHIPPED if (site / rel).is_file()]


def export_reference(folder: Path) -> list[Path]:
    """The reference models exported plain (target onnx, norms left decomposed: what `rewrite`
    fuses) and fused for TensorRT (normexport ops in the graph), into `folder`."""
    from normexport import io
    from normexport.export import convert_module

    out = []
    for name, factory in REFERENCE:
        mod_name, _, attr = factory.partition(":")
        module = getattr(importlib.import_module(mod_name), attr)().eval()
        kw = dict(input_names=module.input_names, output_names=module.output_names, dynamic_axes=module.dynamic_axes)
        inputs = module.example_inputs()
        plain = convert_module(module, inputs, target="onnx", fold_bn=False, swap_norms=False, rewrite=False, **kw)
        p = folder / name / "plain.onnx"
        p.parent.mkdir(parents=True, exist_ok=True)
        io.save_onnx(plain, p, external_data=False)
        out.append(p)
        if name in ("bert", "dit"):  # two with normexport ops are enough
            fused = convert_module(module, inputs, target="trt", **kw)
            p = folder / name / "trt.onnx"
            io.save_onnx(fused, p, external_data=False)
            out.append(p)
    return out


# ------------------------------------------------------------------------------------------------
# the damage (each changes the proto `m` in place, or returns raw bytes; returns a description)
# ------------------------------------------------------------------------------------------------
def _nodes(m: onnx.ModelProto):
    return list(m.graph.node)


def _produced(m: onnx.ModelProto) -> list[str]:
    return [o for n in m.graph.node for o in n.output if o]


def _truncate(rng, raw: bytes):
    cut = rng.randrange(1, max(2, len(raw)))
    return raw[:cut], f"truncated to {cut} of {len(raw)} bytes"


def _flip_bytes(rng, raw: bytes):
    b = bytearray(raw)
    k = rng.choice((1, 2, 4, 16))
    for _ in range(k):
        i = rng.randrange(len(b))
        b[i] ^= rng.randrange(1, 256)
    return bytes(b), f"{k} byte(s) flipped"


def _drop_node(rng, m):
    i = rng.randrange(len(m.graph.node))
    n = m.graph.node[i]
    del m.graph.node[i]
    return f"node {n.name or i} ({n.op_type}) dropped"


def _dangling_input(rng, m):
    n = rng.choice(_nodes(m))
    ghost = f"ghost_{rng.randrange(1000)}"
    if n.input and rng.random() < 0.7:
        j = rng.randrange(len(n.input))
        n.input[j] = ghost
    else:
        n.input.append(ghost)
    return f"{n.op_type} reads '{ghost}', which nothing produces"


def _cycle(rng, m):
    nodes = _nodes(m)
    if len(nodes) < 2:  # a node that reads its own output
        n = nodes[0]
        n.input.append(n.output[0]) if not n.input else n.input.__setitem__(0, n.output[0])
        return f"{n.op_type} reads its own output"
    i = rng.randrange(len(nodes) - 1)
    j = rng.randrange(i + 1, len(nodes))
    a, b = nodes[i], nodes[j]  # a (earlier) now reads b's output: a cycle whenever b depends on a
    if a.input:
        a.input[rng.randrange(len(a.input))] = b.output[0]
    else:
        a.input.append(b.output[0])
    if not a.output or a.output[0] not in b.input:  # make sure: b reads a
        b.input[:] = [a.output[0]] + list(b.input[1:]) if b.input else [a.output[0]]
    return f"{a.op_type} and {b.op_type} read each other"


def _opset_99(rng, m):
    for o in m.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = rng.choice((99, 0, 1000))
            return f"ai.onnx opset {o.version}"
    m.opset_import.add(domain="", version=99)
    return "ai.onnx opset 99 added"


def _inits(m):
    return [t for t in m.graph.initializer if t.dims or t.raw_data]


def _init_dims(rng, m):
    ts = _inits(m) or list(m.graph.initializer)
    if not ts:
        return _nan_weights(rng, m)
    t = rng.choice(ts)
    if t.dims and rng.random() < 0.6:
        t.dims[rng.randrange(len(t.dims))] += rng.choice((1, 3, 7))
    else:
        t.dims.append(rng.choice((2, 5)))
    return f"initializer '{t.name}' dims {list(t.dims)} (its data is not that size)"


def _init_dtype(rng, m):
    ts = list(m.graph.initializer)
    if not ts:
        return _nan_weights(rng, m)
    t = rng.choice(ts)
    old = t.data_type
    choices = [TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.INT8, TensorProto.INT64, TensorProto.BOOL,
               TensorProto.STRING, 9999]
    t.data_type = rng.choice([c for c in choices if c != old])
    return f"initializer '{t.name}' data_type {old} -> {t.data_type}"


#: (op type, attribute, out-of-range values)
_RANGES = {
    "LayerNormalization": ("axis", (7, -9)), "Transpose": ("perm", None), "Softmax": ("axis", (9, -12)),
    "Concat": ("axis", (11, -11)), "Gather": ("axis", (8,)), "Flatten": ("axis", (17,)),
    "Conv": ("group", (0, -1, 1000)), "Gemm": ("transA", (5,)), "ReduceMean": ("axes", None),
    "Split": ("axis", (9,)), "BatchNormalization": ("epsilon", None), "Cast": ("to", (9999,)),
}


def _attr_range(rng, m):
    hits = [n for n in m.graph.node if n.op_type in _RANGES]
    if not hits:
        n = rng.choice(_nodes(m))
        n.attribute.append(helper.make_attribute("axis", 7))
        return f"{n.op_type} given an attribute axis=7 it does not have"
    n = rng.choice(hits)
    name, values = _RANGES[n.op_type]
    for a in list(n.attribute):
        if a.name == name:
            n.attribute.remove(a)
    if name == "perm":
        value = rng.choice(([0, 0, 1], [5, 1, 0], [0], [3, 2, 1, 0, 4, 9]))
    elif name == "axes":
        value = [rng.choice((7, -9))]
    elif name == "epsilon":
        value = rng.choice((-1.0, float("nan")))
    else:
        value = rng.choice(values)
    n.attribute.append(helper.make_attribute(name, value))
    return f"{n.op_type} {name}={value}"


def _no_outputs(rng, m):
    del m.graph.output[:]
    return "graph outputs removed"


def _duplicate_name(rng, m):
    produced = _produced(m)
    nodes = [n for n in m.graph.node if n.output]
    n = rng.choice(nodes)
    other = rng.choice([p for p in produced if p != n.output[0]] or [i.name for i in m.graph.input] or produced)
    if rng.random() < 0.5 or not m.graph.initializer:
        n.output[0], old = other, n.output[0]
        return f"{n.op_type} output '{old}' renamed to '{other}', produced twice"
    t = rng.choice(list(m.graph.initializer))
    old, t.name = t.name, other
    return f"initializer '{old}' renamed '{other}', which a node also produces"


def _nan_weights(rng, m):
    floats = [t for t in m.graph.initializer if t.data_type == TensorProto.FLOAT]
    if not floats:
        n = rng.choice(_nodes(m))  # no float weight: a Constant of NaN in front of an output
        return f"(no float weight) {n.op_type} untouched"
    t = rng.choice(floats)
    a = numpy_helper.to_array(t).copy()
    flat = a.reshape(-1)
    if flat.size:
        k = max(1, int(flat.size * rng.choice((0.01, 0.5, 1.0))))
        flat[rng.sample(range(flat.size), min(k, flat.size))] = rng.choice((np.nan, np.inf, -np.inf))
    t.CopyFrom(numpy_helper.from_array(a, t.name))
    return f"initializer '{t.name}' holds NaN/inf"


def _zero_dim(rng, m):
    ins = [v for v in m.graph.input if v.type.HasField("tensor_type") and v.type.tensor_type.shape.dim]
    inits = {t.name for t in m.graph.initializer}
    ins = [v for v in ins if v.name not in inits] or ins
    if not ins:
        return _init_dims(rng, m)
    v = rng.choice(ins)
    d = v.type.tensor_type.shape.dim[rng.randrange(len(v.type.tensor_type.shape.dim))]
    d.Clear()
    d.dim_value = rng.choice((0, 0, -1))
    return f"input '{v.name}' has a dim of {d.dim_value}"


def _unknown_domain(rng, m):
    n = rng.choice(_nodes(m))
    dom = rng.choice(("com.example.unknown", "ai.onnx.ml.bogus", "normexport.bogus"))
    n.domain = dom
    if rng.random() < 0.5:
        m.opset_import.add(domain=dom, version=1)
    return f"{n.op_type} moved to domain {dom}"


def _external(rng, m, folder: Path, kind: str):
    big = [t for t in m.graph.initializer if t.data_type != TensorProto.STRING]
    if not big:
        return None
    from onnx.external_data_helper import convert_model_to_external_data

    whole = onnx.ModelProto()
    whole.CopyFrom(m)
    convert_model_to_external_data(m, all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=0)
    onnx.save_model(m, str(folder / "model.onnx"))
    if not (folder / "model.onnx.data").exists():  # weights in typed fields onnx keeps inside
        m.CopyFrom(whole)
        return None
    ext = [t for t in m.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    if kind == "external_missing":
        how = rng.choice(("deleted", "truncated", "renamed"))
        data = folder / "model.onnx.data"
        if how == "deleted":
            data.unlink()
        elif how == "truncated":
            raw = data.read_bytes()
            data.write_bytes(raw[: rng.randrange(max(1, len(raw)))])
        else:
            t = rng.choice(ext)
            for e in t.external_data:
                if e.key == "location":
                    e.value = "elsewhere.bin"
            onnx.save_model(m, str(folder / "model.onnx"))
        return f"external data {how}"
    t = rng.choice(ext)
    loc = rng.choice(("../../etc/passwd", "/etc/passwd", "../model.onnx.data", "sub/../../x.data"))
    for e in t.external_data:
        if e.key == "location":
            e.value = loc
    onnx.save_model(m, str(folder / "model.onnx"))
    return f"tensor '{t.name}' data at '{loc}'"


_PROTO = {"drop_node": _drop_node, "dangling_input": _dangling_input, "cycle": _cycle, "opset_99": _opset_99,
          "init_dims": _init_dims, "init_dtype": _init_dtype, "attr_range": _attr_range, "no_outputs": _no_outputs,
          "duplicate_name": _duplicate_name, "nan_weights": _nan_weights, "zero_dim": _zero_dim,
          "unknown_domain": _unknown_domain}


def damage(case: Case, folder: Path) -> str:
    """Write `case`'s damaged copy of its source as `folder/model.onnx`; return what was done."""
    rng = random.Random(f"{case.source.name}/{case.kind}/{case.seed}")
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / "model.onnx"
    raw = case.source.read_bytes()
    if case.kind in ("truncate", "flip_bytes"):
        data, what = (_truncate if case.kind == "truncate" else _flip_bytes)(rng, raw)
        dest.write_bytes(data)
        return what
    m = onnx.load_from_string(raw)
    if case.kind in ("external_missing", "external_outside"):
        what = _external(rng, m, folder, case.kind)
        if what is not None:
            return what
        what = _opset_99(rng, m)  # no weights to move out
    else:
        what = _PROTO[case.kind](rng, m)
    dest.write_bytes(m.SerializeToString())
    return what
