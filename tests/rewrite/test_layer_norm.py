"""rules/layer_norm.py: decomposed LayerNorm -> LayerNormalization (opset >= 17)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from normexport.rewriter import RewriteReport, rewrite
from normexport.rewriter.rules._common import INV_FORMS

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


@pytest.mark.parametrize("form", INV_FORMS)
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
    expect = {"axis": "failed check: mean over axes [1]", "eps_input": "failed check: epsilon is not a constant",
              "other_sub": "pattern near-miss", "extra_use": "failed check: an intermediate value is used"}[kind]
    assert any(r.startswith(expect) for r in reasons), reasons


def test_ort_and_onnx_targets_use_layernormalization():
    for target in ("ort", "onnx"):
        out, _ = _fused(G.ln_graph(opset=13), target=target)
        assert G.op_types(out) == ["LayerNormalization"]
        assert not out.functions
        _check(out)
