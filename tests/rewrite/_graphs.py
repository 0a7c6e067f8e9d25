"""Graph builders and references for the rewrite tests (helpers, not tests)."""

from __future__ import annotations

import io
import warnings
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from _norm_counts import norm_ops  # tests/ (pytest puts it on sys.path)

H = 8
RNG = np.random.default_rng(1234)
WEIGHT = (RNG.standard_normal(H) * 0.5 + 1.3).astype(np.float32)  # never all ones
BIAS = (RNG.standard_normal(H) * 0.3 + 0.2).astype(np.float32)


# ---- numpy float64 references, written from the formulas -------------------------------------
def rms_ref(x, w=None, eps=1e-6, k=1):
    x = np.asarray(x, np.float64)
    axes = tuple(range(x.ndim - k, x.ndim))
    y = x / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + eps)
    return y * np.asarray(w, np.float64) if w is not None else y


def ln_ref(x, w=None, b=None, eps=1e-5, k=1):
    x = np.asarray(x, np.float64)
    axes = tuple(range(x.ndim - k, x.ndim))
    m = x.mean(axis=axes, keepdims=True)
    y = (x - m) / np.sqrt(((x - m) ** 2).mean(axis=axes, keepdims=True) + eps)
    if w is not None:
        y = y * np.asarray(w, np.float64)
    if b is not None:
        y = y + np.asarray(b, np.float64)
    return y


def assert_close(got, ref, what=""):
    """docs/design.md §7 fp32: max abs err <= 1e-5 * max|ref| + 1e-6."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    tol = 1e-5 * np.abs(ref).max() + 1e-6
    err = np.abs(got - ref).max()
    assert err <= tol, f"{what}: max abs err {err:.3g} > {tol:.3g}"


def xin(*shape, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 1.7 + 0.4
    assert np.all(x != 0)
    return x


# ---- running and counting ---------------------------------------------------------------------
def run(model: onnx.ModelProto, **feeds) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # run what is written
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def count(model: onnx.ModelProto, op_type: str, domain: str | None = None) -> int:
    return sum(1 for n in model.graph.node if n.op_type == op_type and (domain is None or n.domain == domain))


def norms(model: onnx.ModelProto) -> Counter:
    """normexport nodes by op type, a SkipRMSNorm / GatedAdaLNZero (residual Add fused in) counted as
    its RMSNorm / AdaLNZero: the norms fused (tests/_norm_counts.py)."""
    return norm_ops(model, "normexport")


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


# ---- torch modules with hand-written norms; legacy exporter ---------------------------------
class LlamaLikeRMSNorm(torch.nn.Module):
    """The HF LlamaRMSNorm formula: upcast, rsqrt, cast back, weight after the cast."""

    def __init__(self, h=H, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.from_numpy(WEIGHT.copy()))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.to(torch.float32)
        v = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(v + self.eps)
        return self.weight * x.to(dt)


class ManualRMSNorm(torch.nn.Module):
    """x / sqrt(mean(x*x) + eps) * w, no casts, weight on the right."""

    def __init__(self, eps=1e-5):
        super().__init__()
        self.w = torch.nn.Parameter(torch.from_numpy(WEIGHT.copy()))
        self.eps = eps

    def forward(self, x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.w


class ManualLayerNorm(torch.nn.Module):
    def __init__(self, eps=1e-5, affine=True):
        super().__init__()
        self.w = torch.nn.Parameter(torch.from_numpy(WEIGHT.copy())) if affine else None
        self.b = torch.nn.Parameter(torch.from_numpy(BIAS.copy())) if affine else None
        self.eps = eps

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        d = x - m
        y = d / torch.sqrt((d * d).mean(-1, keepdim=True) + self.eps)
        return y * self.w + self.b if self.w is not None else y


def torch_layer_norm(affine=True, eps=1e-5):
    ln = torch.nn.LayerNorm(H, eps=eps, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            ln.weight.copy_(torch.from_numpy(WEIGHT))
            ln.bias.copy_(torch.from_numpy(BIAS))
    return ln


class Stack(torch.nn.Module):
    """Linear -> norm, `n` times (LLaMA-ish residual stream)."""

    def __init__(self, norm_factory, n=2, h=H):
        super().__init__()
        torch.manual_seed(0)
        self.lins = torch.nn.ModuleList(torch.nn.Linear(h, h) for _ in range(n))
        self.norms = torch.nn.ModuleList(norm_factory() for _ in range(n))

    def forward(self, x):
        for lin, norm in zip(self.lins, self.norms):
            x = x + lin(norm(x))
        return x


def legacy_export(module: torch.nn.Module, opset: int, shape=(2, 3, H)) -> onnx.ModelProto:
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), (torch.randn(*shape),), f, dynamo=False, opset_version=opset,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "b", 1: "s"}})
    return onnx.load_from_string(f.getvalue())


# ---- onnx.helper builders ---------------------------------------------------------------------
class G:
    """A tiny graph builder: nodes, initializers, constants by value."""

    def __init__(self, opset: int):
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", H])]
        self.outputs: list[str] = []
        self._n = 0

    def name(self, prefix="t"):
        self._n += 1
        return f"{prefix}{self._n}"

    def init(self, arr, prefix="c"):
        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def node(self, op, *inputs, **attrs):
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, list(inputs), [out], **attrs))
        return out

    def reduce_mean(self, v, axes):
        if self.opset < 18:
            return self.node("ReduceMean", v, axes=list(axes), keepdims=1)
        return self.node("ReduceMean", v, self.init(np.array(axes, np.int64), "axes"), keepdims=1)

    def inv_sqrt(self, num, v, form):
        """num / sqrt(v) spelled `form` (see normexport.rewriter.rules._common.INV_SPELLINGS)."""
        if form == "div":
            return self.node("Div", num, self.node("Sqrt", v))
        if form.startswith("recip"):
            r = self.node("Reciprocal", self.node("Sqrt", v))
        elif form.startswith("div1"):
            r = self.node("Div", self.init(np.array(1.0, np.float32)), self.node("Sqrt", v))
        else:
            r = self.node("Pow", v, self.init(np.array(-0.5, np.float32)))
        return self.node("Mul", r, num) if form.endswith("_l") else self.node("Mul", num, r)

    def model(self, *outputs) -> onnx.ModelProto:
        outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
        g = helper.make_graph(self.nodes, "g", self.inputs, outs, self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)])
        m.ir_version = 8
        return onnx.shape_inference.infer_shapes(m)


def rms_graph(opset=18, form="div", square="pow", scale="right", cast=False, eps=1e-6, eps_input=False,
              axes=(-1,), extra_use=False, x_shape=None, w=None):
    g = G(opset)
    if x_shape is not None:
        g.inputs[0] = helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)
    x = "x"
    if cast:
        x = g.node("Cast", x, to=TensorProto.FLOAT)
    sq = g.node("Pow", x, g.init(np.array(2.0, np.float32))) if square == "pow" else g.node("Mul", x, x)
    ms = g.reduce_mean(sq, axes)
    if eps_input:
        g.inputs.append(helper.make_tensor_value_info("eps", TensorProto.FLOAT, []))
        e = "eps"
    else:
        e = g.init(np.array(eps, np.float32), "eps")
    v = g.node("Add", ms, e)
    n = g.inv_sqrt(x, v, form)
    if cast:
        n = g.node("Cast", n, to=TensorProto.FLOAT)
    w = g.init(WEIGHT if w is None else w, "w")
    y = {"right": lambda: g.node("Mul", n, w), "left": lambda: g.node("Mul", w, n), None: lambda: n}[scale]()
    outs = [y]
    if extra_use:
        outs.append(g.node("Neg", ms))
    return g.model(*outs)


def ln_graph(opset=13, form="div", square="pow", affine="both", left=False, cast=False, eps=1e-5,
             eps_input=False, axes=(-1,), other_sub=False, extra_use=False):
    g = G(opset)
    x = "x"
    if cast:
        x = g.node("Cast", x, to=TensorProto.FLOAT)
    m = g.reduce_mean(x, axes)
    src = x
    if other_sub:
        g.inputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["B", "S", H]))
        src = "z"
    d = g.node("Sub", src, m)
    dd = g.node("Pow", d, g.init(np.array(2.0, np.float32))) if square == "pow" else g.node("Mul", d, d)
    var = g.reduce_mean(dd, axes)
    if eps_input:
        g.inputs.append(helper.make_tensor_value_info("eps", TensorProto.FLOAT, []))
        e = "eps"
    else:
        e = g.init(np.array(eps, np.float32), "eps")
    v = g.node("Add", e, var) if left else g.node("Add", var, e)
    n = g.inv_sqrt(d, v, form)
    if cast:
        n = g.node("Cast", n, to=TensorProto.FLOAT)
    y = n
    if affine in ("both", "weight"):
        w = g.init(WEIGHT, "w")
        y = g.node("Mul", w, y) if left else g.node("Mul", y, w)
    if affine == "both":
        b = g.init(BIAS, "b")
        y = g.node("Add", b, y) if left else g.node("Add", y, b)
    outs = [y]
    if extra_use:
        outs.append(g.node("Neg", d))
    return g.model(*outs)


def adaln_graph(form="bh", affine="none", mul_left=False, add_left=False, one_left=False, eps=1e-6,
                rank=3, opset=18, ln_axis=-1, shift_shape=None, scale_shape=None, stash_type=None):
    """LayerNormalization -> Mul(1 + scale) -> Add(shift), hand-built (the dynamo form with
    form='bh', one_left=False). shift_shape / scale_shape override the shapes `form` implies."""
    g = G(opset)
    if rank == 4:
        g.inputs[0] = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 2, "S", H])
    mod_shape = {"bh": ["B", H], "full": ["B", "S", H] if rank == 3 else ["B", 2, "S", H],
                 "b1h": ["B", 1, H]}[form]
    shapes = {"shift": shift_shape or mod_shape, "scale": scale_shape or mod_shape}
    g.inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes[n]) for n in ("shift", "scale")]
    w = g.init(WEIGHT if affine != "none" else np.ones(H, np.float32), "w")
    ln_in = ["x", w] + ([g.init(BIAS, "b")] if affine == "both" else [])
    extra = {} if stash_type is None else {"stash_type": stash_type}
    ln = g.node("LayerNormalization", *ln_in, axis=ln_axis, epsilon=eps, **extra)
    sc, sh = "scale", "shift"
    if form == "bh":
        axes = g.init(np.arange(1, rank - 1, dtype=np.int64), "uaxes")
        sc, sh = g.node("Unsqueeze", sc, axes), g.node("Unsqueeze", sh, axes)
    one = g.init(np.array(1.0, np.float32), "one")
    op1 = g.node("Add", one, sc) if one_left else g.node("Add", sc, one)
    m = g.node("Mul", op1, ln) if mul_left else g.node("Mul", ln, op1)
    y = g.node("Add", sh, m) if add_left else g.node("Add", m, sh)
    return g.model(y)


def to_dtype(model: onnx.ModelProto, elem: int) -> onnx.ModelProto:
    """The same graph with every float32 input, output, initializer and Cast target as `elem`."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    np_dt = onnx.helper.tensor_dtype_to_np_dtype(elem)
    for vi in list(m.graph.input) + list(m.graph.output):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = elem
    for i, t in enumerate(m.graph.initializer):
        if t.data_type == TensorProto.FLOAT:
            m.graph.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np_dt), t.name))
    for n in m.graph.node:
        for a in n.attribute:
            if a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = elem
    del m.graph.value_info[:]
    return onnx.shape_inference.infer_shapes(m)
