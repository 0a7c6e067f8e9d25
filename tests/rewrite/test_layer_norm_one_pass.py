"""rules/layer_norm_one_pass.py: the LayerNorm tf2onnx writes for Flax / Keras models (one-pass
variance E[x²] − E[x]²) -> LayerNormalization, over the last axis or over the middle axis of a
[N, C, L] tensor (Transposes around it). Graphs built with onnx.helper in the issue's spelling:
mean = ReduceSum(x)·(1/n), var = Max(0, ReduceSum(x·x)·(1/n) − mean²), + eps, Sqrt, Reciprocal,
· scale, (x − mean)·that + bias; ReduceSum's axes an attribute (opset 11 / 12) or an input (13+).
Judged against a float64 numpy LayerNorm on rows of very different scales (std 1e-3 .. 10), where
epsilon decides the small rows."""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from normexport.rewriter import RewriteReport, rewrite

sys.path.insert(0, os.path.dirname(__file__))
import _graphs as G  # noqa: E402

EPS = 1e-3  # Flax's default LayerNorm epsilon is 1e-6, Keras' 1e-3: both matter on the small rows


class TF2ONNX:
    """A graph in tf2onnx's spelling, node by node (names as tf2onnx would not matter)."""

    def __init__(self, opset, shape):
        self.opset, self.nodes, self.inits, self._n = opset, [], [], 0
        self.shape = shape
        self.inp = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)

    def c(self, arr):
        self._n += 1
        name = f"const_{self._n}"
        self.inits.append(numpy_helper.from_array(np.asarray(arr, np.float32 if np.asarray(arr).dtype.kind == "f" else None), name))
        return name

    def n(self, op, *ins, **attrs):
        self._n += 1
        out = f"{op}_{self._n}"
        self.nodes.append(helper.make_node(op, list(ins), [out], name=f"n{self._n}", **attrs))
        return out

    def reduce_sum(self, v, axes):
        if self.opset < 13:
            return self.n("ReduceSum", v, axes=list(axes), keepdims=1)
        self._n += 1
        ax = f"axes_{self._n}"
        self.inits.append(numpy_helper.from_array(np.array(axes, np.int64), ax))
        return self.n("ReduceSum", v, ax, keepdims=1)

    def reduce_mean(self, v, axes):
        if self.opset < 18:
            return self.n("ReduceMean", v, axes=list(axes), keepdims=1)
        self._n += 1
        ax = f"axes_{self._n}"
        self.inits.append(numpy_helper.from_array(np.array(axes, np.int64), ax))
        return self.n("ReduceMean", v, ax, keepdims=1)

    def mean(self, v, axes, form, count):
        if form == "reduce_mean":
            return self.reduce_mean(v, axes)
        s = self.reduce_sum(v, axes)
        if form == "div":
            return self.n("Div", s, self.c(np.float32(count)))
        return self.n("Mul", s, self.c(np.float32(1.0 / count)))

    def model(self, y):
        g = helper.make_graph(self.nodes, "tf2onnx", [self.inp], [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)],
                              self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)], producer_name="tf2onnx")
        m.ir_version = 7
        m = onnx.shape_inference.infer_shapes(m)
        onnx.checker.check_model(m, full_check=True)
        return m


def one_pass_ln(opset=13, shape=(2, 5, 16), axis=-1, clamp=True, inv="recip", mean_form="mul", scale=True, bias=True,
                keras=False, eps=EPS, count=None, w=None, b=None):
    """The issue's spelling; returns (model, weight, bias) with the parameters as broadcast in the graph."""
    t = TF2ONNX(opset, list(shape))
    rank = len(shape)
    ax = axis % rank
    n = count or shape[ax]
    bshape = [shape[i] if i == ax else 1 for i in range(rank)]
    while bshape and bshape[0] == 1:  # [H] for the last axis, [C, 1] for the middle one
        bshape = bshape[1:]
    rng = np.random.default_rng(11)
    w = (rng.standard_normal(bshape) * 0.5 + 1.3).astype(np.float32) if w is None else w
    b = (rng.standard_normal(bshape) * 0.3 + 0.2).astype(np.float32) if b is None else b
    mean = t.mean("x", [axis], mean_form, n)
    msq = t.mean(t.n("Mul", "x", "x"), [axis], mean_form, n)
    var = t.n("Sub", msq, t.n("Mul", mean, mean))
    if clamp:
        var = t.n("Max", t.c(np.float32(0.0)), var)
    v = t.n("Add", var, t.c(np.float32(eps)))
    if inv == "recip":
        r = t.n("Reciprocal", t.n("Sqrt", v))
    else:
        r = t.n("Pow", v, t.c(np.float32(-0.5)))
    a = t.n("Mul", r, t.c(w)) if scale else r
    if keras:  # tf.nn.batch_normalization: x·a + (bias − mean·a)
        y = t.n("Add", t.n("Mul", "x", a), t.n("Sub", t.c(b), t.n("Mul", mean, a)))
    else:
        y = t.n("Mul", t.n("Sub", "x", mean), a)
        if bias:
            y = t.n("Add", y, t.c(b))
    return t.model(y), (w if scale else None), (b if bias or keras else None)


def mixed_rows(shape, axis=-1, seed=0):
    """Rows (along `axis`) of std 1e-3 .. 10 and non-zero means: epsilon matters on the small ones."""
    rng = np.random.default_rng(seed)
    rows = list(shape)
    rows[axis] = 1
    scale = 10.0 ** rng.uniform(-3, 1, size=rows)
    return ((rng.standard_normal(shape) + rng.standard_normal(rows)) * scale).astype(np.float32)


def ln64(x, w, b, eps, axis):
    x = np.asarray(x, np.float64)
    m = x.mean(axis=axis, keepdims=True)
    y = (x - m) / np.sqrt(((x - m) ** 2).mean(axis=axis, keepdims=True) + eps)
    y = y * (1.0 if w is None else w.astype(np.float64))
    return y + (0.0 if b is None else b.astype(np.float64))


def _fuse(model):
    rep = RewriteReport()
    return rewrite(model, report=rep), rep


def _assert_ln(out, rep, w, b, shape, axis, eps=EPS):
    assert G.count(out, "LayerNormalization") == 1, rep.summary()
    assert set(G.op_types(out)) <= {"LayerNormalization", "Transpose"}, G.op_types(out)
    x = mixed_rows(shape, axis)
    (y,) = G.run(out, x=x)
    ref = ln64(x, w, b, eps, axis)
    G.assert_close(y, ref, "fused vs float64 LayerNorm")
    # epsilon decides here: the same formula with a 10x epsilon is far outside the tolerance
    assert np.abs(ln64(x, w, b, eps * 10, axis) - ref).max() > 100 * (1e-5 * np.abs(ref).max() + 1e-6)
    (check,) = [c for c in rep.local.checks if c.rule.startswith("layer_norm_one_pass")]
    assert check.passed and not check.reused


@pytest.mark.parametrize("opset", [11, 12, 13, 17, 18])
def test_issue_spelling_last_axis(opset):
    """ReduceSum·(1/n), Max(0, ·) clamp, Sqrt + Reciprocal, ·scale, (x − mean)·that + bias."""
    model, w, b = one_pass_ln(opset)
    out, rep = _fuse(model)
    _assert_ln(out, rep, w, b, (2, 5, 16), -1)
    node = next(n for n in out.graph.node if n.op_type == "LayerNormalization")
    attrs = {a.name: (a.f if a.type == a.FLOAT else a.i) for a in node.attribute}
    assert attrs["axis"] == -1 and abs(attrs["epsilon"] - EPS) < 1e-9 and attrs["stash_type"] == 1
    assert rep.opset_after >= 17


@pytest.mark.parametrize("opset", [11, 13])
def test_middle_axis_of_ncl_with_transposes(opset):
    """Over axis 1 of [N, C, L] (scale / bias [C, 1]): Transpose, LayerNormalization, Transpose."""
    model, w, b = one_pass_ln(opset, shape=(2, 16, 5), axis=1)
    out, rep = _fuse(model)
    _assert_ln(out, rep, w, b, (2, 16, 5), 1)
    assert G.op_types(out).count("Transpose") == 2, G.op_types(out)


def test_channel_axis_of_nchw_with_transposes():
    """Over axis 1 of [N, C, H, W] (a channels-first LayerNorm, ConvNeXt-style; scale [C, 1, 1]): the
    Transposes move C last and back ([0, 2, 3, 1], then [0, 3, 1, 2])."""
    model, w, b = one_pass_ln(13, shape=(2, 8, 3, 4), axis=1)
    out, rep = _fuse(model)
    _assert_ln(out, rep, w, b, (2, 8, 3, 4), 1)
    perms = [list(a.ints) for n in out.graph.node if n.op_type == "Transpose" for a in n.attribute if a.name == "perm"]
    assert perms == [[0, 2, 3, 1], [0, 3, 1, 2]], perms


@pytest.mark.parametrize("kw", [
    dict(clamp=False), dict(inv="pow"), dict(mean_form="div"), dict(mean_form="reduce_mean"),
    dict(scale=False), dict(bias=False), dict(scale=False, bias=False), dict(keras=True),
    dict(keras=True, scale=False, clamp=False),
])
def test_other_spellings(kw):
    model, w, b = one_pass_ln(13, **kw)
    out, rep = _fuse(model)
    _assert_ln(out, rep, w, b, (2, 5, 16), -1)


def test_unbiased_count_is_not_a_layer_norm():
    """Σx·1/(n−1): the variance of a different formula; left alone with the reason."""
    model, _, _ = one_pass_ln(13, count=15)
    out, rep = _fuse(model)
    assert G.count(out, "LayerNormalization") == 0
    assert "is not 1/n" in rep.summary(), rep.summary()


def test_a_planted_epsilon_is_rejected_by_local_verification(monkeypatch):
    """The rule's own check passes; a fusion with a wrong epsilon is stopped by the local check on
    rows where epsilon matters (mixed scales)."""
    from normexport.rewriter.rules import layer_norm_one_pass as mod

    class Planted(mod.OnePassLayerNormFusion):
        def check(self, context, **kw):
            r = super().check(context, **kw)
            if r:
                self._eps *= 3
            return r

    monkeypatch.setattr(mod, "RULES", [Planted.rule("layer_norm_one_pass_scale_bias", scaled=True, bias=True)])
    model, _, _ = one_pass_ln(13)
    out, rep = _fuse(model)
    assert G.count(out, "LayerNormalization") == 0, rep.summary()
    assert rep.rules["layer_norm_one_pass_scale_bias"].rejected[0]["reason"].startswith("local verification")


@pytest.mark.parametrize("form", ["keras", "flax_shared_sub", "flax_second_sub"])
def test_two_pass_variance_in_these_output_forms(form):
    """tf.nn.moments' variance, mean((x − mean)²) (Keras; Flax with use_fast_variance=False), with
    the outputs above: x·a + (bias − mean·a), or (x − mean)·a + bias with the Sub shared with the
    variance or written twice."""
    t = TF2ONNX(13, [2, 5, 16])
    rng = np.random.default_rng(1)
    w = (rng.standard_normal(16) * 0.5 + 1.3).astype(np.float32)
    b = (rng.standard_normal(16) * 0.3).astype(np.float32)
    mean = t.reduce_mean("x", [-1])
    d = t.n("Sub", "x", mean)
    var = t.reduce_mean(t.n("Mul", d, d), [-1])
    a = t.n("Mul", t.n("Reciprocal", t.n("Sqrt", t.n("Add", var, t.c(np.float32(EPS))))), t.c(w))
    if form == "keras":
        y = t.n("Add", t.n("Mul", "x", a), t.n("Sub", t.c(b), t.n("Mul", mean, a)))
    else:
        y = t.n("Add", t.n("Mul", d if form == "flax_shared_sub" else t.n("Sub", "x", mean), a), t.c(b))
    out, rep = _fuse(t.model(y))
    assert G.op_types(out) == ["LayerNormalization"], rep.summary()
    x = mixed_rows((2, 5, 16))
    G.assert_close(G.run(out, x=x)[0], ln64(x, w, b, EPS, -1), "fused vs float64 LayerNorm")
