"""rules/layer_norm.py: decomposed LayerNorm -> LayerNormalization (opset >= 17)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from normexport.rewriter import RewriteReport, rewrite
from normexport.rewriter.rules._common import INV_SPELLINGS

sys.path.insert(0, os.path.dirname(__file__))
import _graphs as G  # noqa: E402


def _fused(model, target="trt", **kw):
    report = RewriteReport()
    return rewrite(model, target=target, report=report, **kw), report


def _check(out, w=G.WEIGHT, b=G.BIAS, eps=1e-5, **feeds):
    x = G.xin(2, 3, G.H)
    (y,) = G.run(out, x=x, **feeds)
    G.assert_close(y, G.ln_ref(x, w, b, eps), "rewritten vs fp64 formula")


def _ln_attrs(model):
    node = next(n for n in model.graph.node if n.op_type == "LayerNormalization")
    return {a.name: (a.f if a.type == a.FLOAT else a.i) for a in node.attribute}


@pytest.mark.parametrize("opset", [11, 14, 16])
def test_legacy_nn_layernorm(opset):
    model = G.legacy_export(G.torch_layer_norm(), opset)
    out, rep = _fused(model)
    assert G.op_types(out) == ["LayerNormalization"]
    assert rep.opset_after == 17
    attrs = _ln_attrs(out)
    assert attrs["axis"] == -1 and attrs["stash_type"] == 1 and abs(attrs["epsilon"] - 1e-5) < 1e-12
    _check(out)


@pytest.mark.parametrize("opset", [11, 16])
def test_legacy_manual_layernorm(opset):
    model = G.legacy_export(G.ManualLayerNorm(), opset)
    out, _ = _fused(model)
    assert G.op_types(out) == ["LayerNormalization"]
    _check(out)


def test_legacy_no_affine_gets_unit_scale():
    model = G.legacy_export(G.torch_layer_norm(affine=False), 14)
    out, _ = _fused(model)
    assert G.op_types(out) == ["LayerNormalization"]
    scale = next(i for i in out.graph.initializer if i.name == out.graph.node[0].input[1])
    assert np.all(__import__("onnx").numpy_helper.to_array(scale) == 1)
    _check(out, w=None, b=None)


def test_legacy_stack_of_three():
    model = G.legacy_export(G.Stack(G.torch_layer_norm, n=3), 13)
    out, _ = _fused(model)
    assert G.count(out, "LayerNormalization") == 3 and G.count(out, "ReduceMean") == 0
    x = G.xin(2, 3, G.H)
    G.assert_close(G.run(out, x=x)[0], G.run(model, x=x)[0], "stack")


@pytest.mark.parametrize("form", INV_SPELLINGS)  # canonical forms first: every spelling fuses
def test_helper_inverse_forms(form):
    model = G.ln_graph(form=form, square="mul")
    out, _ = _fused(model)
    assert G.op_types(out) == ["LayerNormalization"]
    _check(out)


@pytest.mark.parametrize("affine", ["both", "weight", "none"])
@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("opset", [13, 18])
def test_helper_affine_orders_axes_forms(affine, left, opset):
    model = G.ln_graph(opset=opset, affine=affine, left=left)
    out, _ = _fused(model)
    assert G.op_types(out) == ["LayerNormalization"]
    assert len(out.graph.node[0].input) == (3 if affine == "both" else 2)
    _check(out, w=None if affine == "none" else G.WEIGHT, b=G.BIAS if affine == "both" else None)


def test_helper_casts():
    model = G.ln_graph(cast=True, form="pow")
    out, _ = _fused(model)
    assert G.op_types(out) == ["LayerNormalization"]
    _check(out)


@pytest.mark.parametrize("kind", ["axis", "eps_input", "other_sub", "extra_use"])
def test_near_misses_untouched(kind):
    kw = {"axis": dict(axes=(1,)), "eps_input": dict(eps_input=True), "other_sub": dict(other_sub=True),
          "extra_use": dict(extra_use=True)}[kind]
    model = G.ln_graph(**kw)
    out, rep = _fused(model)
    assert G.count(out, "LayerNormalization") == 0 and G.count(out, "RMSNorm") == 0
    assert out == model
    reasons = [r["reason"] for rec in rep.rules.values() for r in rec.rejected]
    # axis: normalized over S with a weight along H (not a LayerNorm over S)
    expect = {"axis": "failed check: 'w", "eps_input": "failed check: epsilon is not a constant",
              "other_sub": "pattern near-miss", "extra_use": "failed check: an intermediate value is used"}[kind]
    assert any(r.startswith(expect) for r in reasons), reasons
    if kind == "axis":
        assert any("varies along a dim that is not normalized" in r for r in reasons), reasons


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("shape", [(2, 16, 5), (2, 8, 3, 4)])
def test_channel_axis_fused_with_transposes(opset, shape):
    """LayerNorm over axis 1 ([N, C, L] or channels-first [N, C, H, W], weight / bias [C, 1(, 1)]):
    Transpose C last, LayerNormalization, Transpose back; vs float64 on rows of mixed scales."""
    from onnx import TensorProto, helper

    rank, c_ = len(shape), shape[1]
    g = G.G(opset)
    g.inputs[0] = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    rng = np.random.default_rng(2)
    pshape = [c_] + [1] * (rank - 2)
    w = (rng.standard_normal(pshape) * 0.5 + 1.3).astype(np.float32)
    b = (rng.standard_normal(pshape) * 0.3 + 0.2).astype(np.float32)
    m = g.reduce_mean("x", [1])
    d = g.node("Sub", "x", m)
    v = g.node("Add", g.reduce_mean(g.node("Mul", d, d), [1]), g.init(np.array(1e-5, np.float32), "eps"))
    y = g.node("Add", g.node("Mul", g.node("Div", d, g.node("Sqrt", v)), g.init(w, "w")), g.init(b, "b"))
    out, rep = _fused(g.model(y))
    assert sorted(G.op_types(out)) == ["LayerNormalization", "Transpose", "Transpose"], rep.summary()
    sc = 10.0 ** rng.uniform(-3, 1, size=(shape[0], 1) + shape[2:])[:, :, None].reshape((shape[0], 1) + shape[2:])
    x = ((rng.standard_normal(shape) + 0.5) * sc).astype(np.float32)
    x64 = x.astype(np.float64)
    mu = x64.mean(1, keepdims=True)
    ref = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(1, keepdims=True) + 1e-5) * w + b
    G.assert_close(G.run(out, x=x)[0], ref, "transposed LayerNormalization vs float64")


def test_ort_and_onnx_targets_use_layernormalization():
    for target in ("ort", "onnx"):
        out, _ = _fused(G.ln_graph(opset=13), target=target)
        assert G.op_types(out) == ["LayerNormalization"]
        assert not out.functions
        _check(out)
