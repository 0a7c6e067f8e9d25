"""Epsilon where it decides: every rewriter rule and every normexport op that takes an epsilon, run on
rows of near-constant values (variance ~1e-8, below epsilon), where an epsilon that is lost, replaced
by a default or moved changes the output by a factor, not by a rounding. On inputs of unit
variance (the rest of the suite) epsilon is nearly irrelevant: 1e-6 against 1 is a 5e-7 relative
change, inside the float32 tolerance.

Each case is judged against a float64 numpy formula written here (not normexport's own `reference`
functions, not its verdict), within docs/design.md §7's float32 tolerance; the same inputs with unit
variance are checked too. The rewriter's own fusion-time verification runs on random inputs of
unit variance, so it cannot be what catches a lost epsilon.
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from normexport import ops
from normexport.rewriter import RewriteReport, rewrite

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "rewrite"))
import _graphs as G  # noqa: E402

H = G.H


# ---- inputs and float64 formulas ---------------------------------------------------------------------
def low_variance(*shape, seed=0, center=0.02, spread=1e-4):
    """Rows of near-constant values: a per-row constant in [-center, center] plus spread x N(0, 1)
    (variance ~spread^2 = 1e-8); the last row has unit variance, as a control. The constants are
    small so that float32's x - mean is exact to ~1e-5 relative."""
    rng = np.random.default_rng(seed)
    const = rng.uniform(-center, center, shape[:-1] + (1,))
    x = const + spread * rng.standard_normal(shape)
    x.reshape(-1, shape[-1])[-1] = rng.standard_normal(shape[-1]) * 1.3 + 0.2
    return x.astype(np.float32)


def rms64(x, w, eps, axes=(-1,)):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps) * np.asarray(w, np.float64)


def ln64(x, w, b, eps, axes=(-1,)):
    x = np.asarray(x, np.float64)
    d = x - x.mean(axis=axes, keepdims=True)
    y = d / np.sqrt((d * d).mean(axis=axes, keepdims=True) + eps)
    y = y * (1.0 if w is None else np.asarray(w, np.float64))
    return y + (0.0 if b is None else np.asarray(b, np.float64))


def assert_f32(got, ref, what):
    """docs/design.md §7 float32: max abs err <= 1e-5 x max|ref| + 1e-6."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    tol = 1e-5 * np.abs(ref).max() + 1e-6
    err = np.abs(got - ref).max()
    assert err <= tol, f"{what}: max abs err {err:.3g} > {tol:.3g} (float64 formula with the file's epsilon)"


def eps_matters(x, eps, rms=False):
    """The facts: on the near-constant rows the (mean-square or) variance is far below epsilon."""
    x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])[:-1]
    v = (x * x).mean(-1) if rms else x.var(-1)
    assert v.max() < eps / 20, (v.max(), eps)


def ort_run(model: onnx.ModelProto, **feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def fused(model, target, op_type, domain, verify=True):
    """rewrite() for `target`; with verify=False the rule's own output, without the fusion-time
    verification that would reject (and so hide) a wrong fusion."""
    report = RewriteReport()
    out = rewrite(model, target=target, verify=verify, report=report)
    nodes = [n for n in out.graph.node if n.op_type == op_type and n.domain == domain]
    return out, nodes


def attr(node, name):
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


# ---- rewriter rules -----------------------------------------------------------------------------------
VERIFY = pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])


@pytest.mark.parametrize("eps", [1e-6, 1e-3])
@pytest.mark.parametrize("target, op_type, domain", [("trt", "RMSNorm", "normexport"),
                                                     ("onnx", "RMSNormalization", "")])
@VERIFY
def test_rms_norm_rule(eps, target, op_type, domain, verify):
    model = G.rms_graph(eps=eps, opset=23 if target == "onnx" else 18)  # RMSNormalization needs opset 23
    out, nodes = fused(model, target, op_type, domain, verify)
    assert len(nodes) == 1, [n.op_type for n in out.graph.node]
    assert attr(nodes[0], "epsilon") == pytest.approx(eps, rel=1e-6)
    x = 1e-4 * np.random.default_rng(1).standard_normal((2, 3, H)).astype(np.float32)  # mean square 1e-8
    x[-1, -1] = G.xin(H)
    eps_matters(x, eps, rms=True)
    (y,) = ort_run(out, x=x)
    assert_f32(y, rms64(x, G.WEIGHT, eps), f"rms_norm rule, target {target}, eps {eps}")


@pytest.mark.parametrize("eps", [1e-6, 1e-3])
@pytest.mark.parametrize("target", ["trt", "onnx"])
@VERIFY
def test_layer_norm_rule(eps, target, verify):
    model = G.ln_graph(eps=eps)
    out, nodes = fused(model, target, "LayerNormalization", "", verify)
    assert len(nodes) == 1, [n.op_type for n in out.graph.node]
    assert attr(nodes[0], "epsilon") == pytest.approx(eps, rel=1e-6)
    x = low_variance(2, 3, H, seed=2)
    eps_matters(x, eps)
    (y,) = ort_run(out, x=x)
    assert_f32(y, ln64(x, G.WEIGHT, G.BIAS, eps), f"layer_norm rule, target {target}, eps {eps}")


@pytest.mark.parametrize("eps", [1e-6, 1e-3])
@pytest.mark.parametrize("axis", [-1, 1])
@VERIFY
def test_layer_norm_one_pass_rule(eps, axis, verify):
    """tf2onnx's Flax spelling (E[x²] − E[x]², Max(0, ·), Sqrt + Reciprocal), over the last axis and
    over axis 1 of [N, C, L] (Transposes around LayerNormalization)."""
    from test_layer_norm_one_pass import one_pass_ln

    shape = (2, 3, H) if axis == -1 else (2, H, 3)
    model, w, b = one_pass_ln(13, shape=shape, axis=axis, eps=eps)
    out, nodes = fused(model, "trt", "LayerNormalization", "", verify)
    assert len(nodes) == 1, [n.op_type for n in out.graph.node]
    assert attr(nodes[0], "epsilon") == pytest.approx(eps, rel=1e-6)
    x = low_variance(2, 3, H, seed=7)
    if axis == 1:
        x = np.ascontiguousarray(x.transpose(0, 2, 1))  # the near-constant rows along axis 1
    eps_matters(np.moveaxis(x, axis, -1), eps)
    (y,) = ort_run(out, x=x)
    assert_f32(y, ln64(x, w, b, eps, axes=(axis,)), f"layer_norm_one_pass rule, axis {axis}, eps {eps}")


def _mods(batch, seed=3):
    rng = np.random.default_rng(seed)
    return (0.3 * rng.standard_normal((batch, H))).astype(np.float32), (0.3 * rng.standard_normal((batch, H))).astype(np.float32)


@pytest.mark.parametrize("eps", [1e-6, 1e-3])
@VERIFY
def test_adaln_rule(eps, verify):
    model = G.adaln_graph(eps=eps, affine="both")
    out, nodes = fused(model, "trt", "AdaLNZero", "normexport", verify)
    assert len(nodes) == 1, [n.op_type for n in out.graph.node]
    x = low_variance(2, 3, H, seed=4)
    eps_matters(x, eps)
    shift, scale = _mods(2)
    (y,) = ort_run(out, x=x, shift=shift, scale=scale)
    ref = ln64(x, G.WEIGHT, G.BIAS, eps) * (1 + scale[:, None].astype(np.float64)) + shift[:, None]
    assert_f32(y, ref, f"adaln rule, eps {eps}")


class Continuous(torch.nn.Module):
    """diffusers' AdaLayerNormContinuous: LayerNorm(x) * (1 + scale)[:, None, :] + shift[:, None, :],
    scale and shift from a Linear of c."""

    def __init__(self, eps):
        super().__init__()
        torch.manual_seed(0)
        self.ln = torch.nn.LayerNorm(H, eps=eps)
        with torch.no_grad():
            self.ln.weight.copy_(torch.from_numpy(G.WEIGHT))
            self.ln.bias.copy_(torch.from_numpy(G.BIAS))
        self.lin = torch.nn.Linear(H, 2 * H)

    def forward(self, x, c):
        scale, shift = self.lin(c).chunk(2, dim=1)
        return self.ln(x) * (1 + scale)[:, None, :] + shift[:, None, :]


@functools.lru_cache(maxsize=None)
def _continuous_file(eps):
    """Continuous(eps) exported by torch.onnx's dynamo exporter."""
    import logging
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        prog = torch.onnx.export(Continuous(eps).eval(), (torch.randn(2, 3, H), torch.randn(2, H)), dynamo=True,
                                 opset_version=18, input_names=["x", "c"], verbose=False)
    return prog.model_proto


@pytest.mark.parametrize("eps", [1e-6, 1e-3])
@VERIFY
def test_adaln_continuous_rule(eps, verify):
    m = Continuous(eps).eval()
    out, nodes = fused(_continuous_file(eps), "trt", "AdaLNZero", "normexport", verify)
    assert len(nodes) == 1, [n.op_type for n in out.graph.node]
    x = low_variance(2, 3, H, seed=5)
    eps_matters(x, eps)
    c = np.random.default_rng(6).standard_normal((2, H)).astype(np.float32)
    (y,) = ort_run(out, x=x, c=c)
    w = m.lin.weight.detach().double().numpy()
    b = m.lin.bias.detach().double().numpy()
    mod = c.astype(np.float64) @ w.T + b
    scale, shift = mod[:, :H], mod[:, H:]
    ref = ln64(x, G.WEIGHT, G.BIAS, eps) * (1 + scale[:, None]) + shift[:, None]
    assert_f32(y, ref, f"adaln_continuous rule, eps {eps}")


@pytest.fixture
def skip_rms_on(monkeypatch):
    """skip_rms_norm enabled for target ort (after rms_norm) and for small graphs."""
    import normexport.rewriter as rw
    from normexport.rewriter.rules import skip_rms_norm as mod

    if "skip_rms_norm" not in rw.RULE_MODULES:
        mods = list(rw.RULE_MODULES)
        mods.insert(mods.index("rms_norm") + 1, "skip_rms_norm")
        monkeypatch.setattr(rw, "RULE_MODULES", tuple(mods))
    monkeypatch.setattr(mod, "TARGETS", frozenset(mod.TARGETS | {"ort"}))
    monkeypatch.setattr(mod, "MIN_HIDDEN", 1)
    monkeypatch.setattr(mod, "MIN_ELEMENTS", 1)


@pytest.mark.parametrize("eps", [1e-6, 1e-3])
@VERIFY
def test_skip_rms_norm_rule(skip_rms_on, eps, verify):
    nodes = [helper.make_node("Add", ["x", "r"], ["s"]),
             helper.make_node("RMSNormalization", ["s", "w"], ["y"], epsilon=eps),
             helper.make_node("Add", ["y", "s"], ["z"])]
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "S", H])  # noqa: E731
    g = helper.make_graph(nodes, "g", [vi("x"), vi("r")], [vi("z")], [numpy_helper.from_array(G.WEIGHT, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    out, found = fused(onnx.shape_inference.infer_shapes(model), "ort", "SkipSimplifiedLayerNormalization",
                       "com.microsoft", verify)
    assert len(found) == 1, [n.op_type for n in out.graph.node]
    rng = np.random.default_rng(7)
    x = (1e-4 * rng.standard_normal((2, 3, H))).astype(np.float32)
    r = (1e-4 * rng.standard_normal((2, 3, H))).astype(np.float32)
    x[-1, -1] = G.xin(H)
    eps_matters(x + r, eps, rms=True)
    (z,) = ort_run(out, x=x, r=r)
    s = x.astype(np.float64) + r
    assert_f32(z, rms64(s, G.WEIGHT, eps) + s, f"skip_rms_norm rule, eps {eps}")


def _bn_model(eps, conv: bool):
    """[Conv ->] BatchNormalization with running variances far below epsilon in half the channels."""
    c = 4
    rng = np.random.default_rng(8)
    var = np.array([1e-7, 3e-8, 0.8, 1.7], np.float32)
    inits = {"gamma": rng.uniform(0.5, 1.5, c), "beta": rng.standard_normal(c) * 0.2,
             "mean": rng.standard_normal(c) * 0.01, "var": var}
    nodes, src = [], "x"
    if conv:
        inits["cw"] = rng.standard_normal((c, c, 1, 1)) * 0.5
        inits["cb"] = rng.standard_normal(c) * 0.01
        nodes.append(helper.make_node("Conv", ["x", "cw", "cb"], ["h"]))
        src = "h"
    nodes.append(helper.make_node("BatchNormalization", [src, "gamma", "beta", "mean", "var"], ["y"], epsilon=eps))
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, c, 3, 3])  # noqa: E731
    g = helper.make_graph(nodes, "g", [vi("x")], [vi("y")],
                          [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, {k: np.asarray(v, np.float32).astype(np.float64) for k, v in inits.items()}


def _bn64(h, p, eps):
    sh = (1, -1, 1, 1)
    return (h - p["mean"].reshape(sh)) / np.sqrt(p["var"].reshape(sh) + eps) * p["gamma"].reshape(sh) + p["beta"].reshape(sh)


@pytest.mark.parametrize("eps", [1e-5, 1e-3])
@pytest.mark.parametrize("conv", [False, True], ids=["bn_affine", "bn_fold"])
@VERIFY
def test_batch_norm_rules(eps, conv, verify):
    """bn_fold (into the Conv) and bn_affine (a lone BatchNormalization -> Mul + Add): channels whose
    running variance is far below epsilon."""
    model, p = _bn_model(eps, conv)
    report = RewriteReport()
    out = rewrite(model, target="trt", verify=verify, report=report)
    assert not [n for n in out.graph.node if n.op_type == "BatchNormalization"], [n.op_type for n in out.graph.node]
    x = (np.random.default_rng(9).standard_normal((2, 4, 3, 3)) * 1e-2).astype(np.float32)
    h = x.astype(np.float64)
    if conv:
        h = np.einsum("oi,bihw->bohw", p["cw"][:, :, 0, 0], h) + p["cb"].reshape(1, -1, 1, 1)
    (y,) = ort_run(out, x=x)
    assert_f32(y, _bn64(h, p, eps), f"{'bn_fold' if conv else 'bn_affine'}, eps {eps}")


# ---- the ops: torch custom ops (eager), ONNX function bodies (onnxruntime), export -------------------
@pytest.mark.parametrize("eps", [1e-6, 1e-3])
def test_rms_norm_op(eps):
    x = 1e-4 * np.random.default_rng(10).standard_normal((2, 3, H)).astype(np.float32)
    x[-1, -1] = G.xin(H)
    eps_matters(x, eps, rms=True)
    w = G.WEIGHT
    ref = rms64(x, w, eps)
    eager = torch.ops.normexport.rms_norm(torch.from_numpy(x), torch.from_numpy(w), eps, -1)
    assert_f32(eager.numpy(), ref, f"torch.ops.normexport.rms_norm, eps {eps}")
    node = helper.make_node("RMSNorm", ["x", "w"], ["y"], domain=ops.DOMAIN, epsilon=eps, axis=-1)
    vi = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", H])
    g = helper.make_graph([node], "g", [vi], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", H])],
                          [numpy_helper.from_array(w, "w")])
    model = ops.attach_functions(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18),
                                                                     helper.make_opsetid(ops.DOMAIN, 1)]))
    (y,) = ort_run(model, x=x)
    assert_f32(y, ref, f"RMSNorm function body, eps {eps}")


@pytest.mark.parametrize("eps", [1e-6, 1e-3])
def test_adaln_zero_op(eps):
    x = low_variance(2, 3, H, seed=11)
    eps_matters(x, eps)
    shift, scale = _mods(2, seed=12)
    w, b = G.WEIGHT, G.BIAS
    ref = ln64(x, w, b, eps) * (1 + scale[:, None].astype(np.float64)) + shift[:, None]
    t = torch.from_numpy
    eager = torch.ops.normexport.adaln_zero(t(x), t(shift), t(scale), t(w), t(b), eps)
    assert_f32(eager.numpy(), ref, f"torch.ops.normexport.adaln_zero, eps {eps}")
    node = helper.make_node("AdaLNZero", ["x", "shift", "scale", "w", "b"], ["y"], domain=ops.DOMAIN, epsilon=eps)
    vis = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", H]),
           helper.make_tensor_value_info("shift", TensorProto.FLOAT, ["B", H]),
           helper.make_tensor_value_info("scale", TensorProto.FLOAT, ["B", H])]
    g = helper.make_graph([node], "g", vis, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", H])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = ops.attach_functions(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18),
                                                                     helper.make_opsetid(ops.DOMAIN, 1)]))
    (y,) = ort_run(model, x=x, shift=shift, scale=scale)
    assert_f32(y, ref, f"AdaLNZero function body, eps {eps}")


class _OpModule(torch.nn.Module):
    def __init__(self, eps):
        super().__init__()
        self.eps = eps
        self.w = torch.nn.Parameter(torch.from_numpy(G.WEIGHT.copy()))

    def forward(self, x, shift, scale):
        y = torch.ops.normexport.rms_norm(x, self.w, self.eps, -1)
        return torch.ops.normexport.adaln_zero(y, shift, scale, None, None, self.eps)


@pytest.mark.parametrize("eps", [1e-6, 1e-3])
def test_ops_exported_keep_epsilon(eps):
    """Both torch ops through torch.onnx (normexport's translation table): the nodes carry the
    module's epsilon and the file matches the float64 formula on near-constant rows."""
    import logging
    import warnings

    m = _OpModule(eps).eval()
    x = 1e-4 * np.random.default_rng(13).standard_normal((2, 3, H)).astype(np.float32)
    x[-1, -1] = G.xin(H)
    shift, scale = _mods(2, seed=14)
    t = torch.from_numpy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        prog = torch.onnx.export(m, (t(x), t(shift), t(scale)), dynamo=True, verbose=False,
                                 custom_translation_table=ops.TRANSLATION_TABLE, input_names=["x", "shift", "scale"])
    model = ops.attach_functions(prog.model_proto)
    found = {n.op_type: attr(n, "epsilon") for n in model.graph.node if n.domain == ops.DOMAIN}
    assert found == {"RMSNorm": pytest.approx(eps, rel=1e-6), "AdaLNZero": pytest.approx(eps, rel=1e-6)}
    (y,) = ort_run(model, x=x, shift=shift, scale=scale)
    r = rms64(x, G.WEIGHT, eps)
    eps_matters(x, eps, rms=True)  # RMSNorm's rows; AdaLNZero sees RMSNorm's output
    ref = ln64(r, None, None, eps) * (1 + scale[:, None].astype(np.float64)) + shift[:, None]
    assert_f32(y, ref, f"exported RMSNorm -> AdaLNZero, eps {eps}")
