"""rules/rms_norm.py: decomposed RMSNorm -> normexport::RMSNorm (trt) / RMSNormalization (onnx, ort at 23)."""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
import pytest

from normexport.ops import rms_norm as rms_spec
from normexport.rewriter import RewriteReport, rewrite
from normexport.rewriter.rules._common import INV_SPELLINGS

sys.path.insert(0, os.path.dirname(__file__))
import _graphs as G  # noqa: E402


def _fused(model, target="trt", **kw):
    report = RewriteReport()
    out = rewrite(model, target=target, report=report, **kw)
    return out, report


def _check_rms(out, w=G.WEIGHT, eps=1e-6):
    x = G.xin(2, 3, G.H)
    (y,) = G.run(out, x=x)
    G.assert_close(y, G.rms_ref(x, w, eps), "rewritten vs fp64 formula")
    G.assert_close(y, rms_spec.reference(x, w if w is not None else np.ones(G.H), epsilon=eps), "vs op spec reference")


@pytest.mark.parametrize("opset", [11, 14, 16])
def test_legacy_llama_like_rmsnorm(opset):
    model = G.legacy_export(G.LlamaLikeRMSNorm(), opset)
    out, rep = _fused(model)
    assert G.count(out, "RMSNorm", "normexport") == 1
    assert G.op_types(out) == ["RMSNorm"]  # casts, Pow, ReduceMean, Add, Sqrt, Div, Mul, Mul all gone
    assert any(f.name == "RMSNorm" and f.domain == "normexport" for f in out.functions)
    assert rep.applied == 1 and rep.opset_after == 18
    _check_rms(out)


def test_legacy_manual_rmsnorm_stack():
    model = G.legacy_export(G.Stack(lambda: G.ManualRMSNorm(eps=1e-5), n=3), 14)
    out, rep = _fused(model)
    # 3 norms fused; the 2nd and 3rd read the residual sum x + lin(norm(x)): SkipRMSNorm (target trt)
    assert G.norms(out) == {"RMSNorm": 3} and G.count(out, "SkipRMSNorm", "normexport") == 2
    assert G.count(out, "ReduceMean") == 0 and G.count(out, "Sqrt") == 0
    x = G.xin(2, 3, G.H)
    G.assert_close(G.run(out, x=x)[0], G.run(model, x=x)[0], "stack")


def test_transformers_llama_rmsnorm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    mod = LlamaRMSNorm(G.H, eps=1e-6)
    with __import__("torch").no_grad():
        mod.weight.copy_(__import__("torch").from_numpy(G.WEIGHT))
    model = G.legacy_export(mod, 14)
    out, rep = _fused(model)
    assert G.count(out, "RMSNorm", "normexport") == 1 and len(out.graph.node) == 1
    _check_rms(out)


@pytest.mark.parametrize("form", INV_SPELLINGS)  # canonical forms first: every spelling fuses
@pytest.mark.parametrize("square", ["pow", "mul"])
def test_helper_forms_no_scale(form, square):
    model = G.rms_graph(form=form, square=square, scale=None)
    out, _ = _fused(model)
    assert G.op_types(out) == ["RMSNorm"]
    _check_rms(out, w=None)


@pytest.mark.parametrize("scale", ["left", "right"])
@pytest.mark.parametrize("cast", [False, True])
@pytest.mark.parametrize("opset", [13, 18])
def test_helper_scale_sides_and_casts(scale, cast, opset):
    model = G.rms_graph(opset=opset, form="recip", scale=scale, cast=cast)
    out, rep = _fused(model)
    assert G.op_types(out) == ["RMSNorm"]
    assert rep.opset_after == 18
    _check_rms(out)


def test_two_trailing_axes():
    w = (np.random.default_rng(5).standard_normal((3, G.H)) + 1.0).astype(np.float32)
    model = G.rms_graph(form="div", axes=(-2, -1), x_shape=["B", 3, G.H], w=w)
    out, _ = _fused(model)
    assert G.op_types(out) == ["RMSNorm"]
    assert [a.i for a in out.graph.node[0].attribute if a.name == "axis"] == [-2]
    x = G.xin(2, 3, G.H)
    G.assert_close(G.run(out, x=x)[0], G.rms_ref(x, w, 1e-6, k=2))


def test_two_trailing_axes_symbolic_dim_no_scale_rejected():
    model = G.rms_graph(form="div", axes=(-2, -1), scale=None)  # x [B, S, H]: no static unit scale
    out, rep = _fused(model)
    assert out == model
    reasons = [r["reason"] for rec in rep.rules.values() for r in rec.rejected]
    assert any("normalized dims not static" in r for r in reasons), reasons


@pytest.mark.parametrize("kind", ["axis", "eps_input", "extra_use", "graph_output"])
def test_near_misses_untouched(kind):
    kw = {"axis": dict(axes=(1,)), "eps_input": dict(eps_input=True), "extra_use": dict(extra_use=True),
          "graph_output": {}}[kind]
    model = G.rms_graph(**kw)
    if kind == "graph_output":  # an intermediate (the mean of squares) is itself a graph output
        ms = next(n.output[0] for n in model.graph.node if n.op_type == "ReduceMean")
        model.graph.output.add(name=ms)
    out, rep = _fused(model)
    assert G.count(out, "RMSNorm") == 0
    assert out == model  # untouched
    reasons = [r["reason"] for rec in rep.rules.values() for r in rec.rejected]
    expect = {"axis": "not the trailing dims", "eps_input": "epsilon is not a constant scalar",
              "extra_use": "used outside the pattern", "graph_output": "used outside the pattern"}[kind]
    assert any(expect in r and r.startswith("failed check: ") for r in reasons), reasons


def test_target_onnx_opset23_uses_rmsnormalization():
    model = G.rms_graph(opset=23, form="pow", scale="left")
    out, _ = _fused(model, target="onnx")
    assert G.op_types(out) == ["RMSNormalization"]
    assert not out.functions and all(o.domain in ("", "ai.onnx") for o in out.opset_import)
    _check_rms(out)


def test_target_onnx_below_23_keeps_decomposed():
    model = G.rms_graph(opset=18)
    out, rep = _fused(model, target="onnx")
    assert out == model
    reasons = [r["reason"] for rec in rep.rules.values() for r in rec.rejected]
    assert any("needs opset >= 23" in r for r in reasons), reasons


def test_target_ort_below_23_upgrades_to_rmsnormalization():
    """ort: RMSNormalization (measured faster in onnxruntime) is worth an opset upgrade."""
    model = G.rms_graph(opset=18)
    out, rep = _fused(model, target="ort")
    assert [n.op_type for n in out.graph.node].count("RMSNormalization") == 1
    assert next(o.version for o in out.opset_import if o.domain == "") == 23
    assert any("18 -> 23" in n for n in rep.notes), rep.notes
    _check_rms(out)


def test_fp16_llama_upcast_graph():
    """x fp16 -> Cast fp32 -> RMS -> Cast fp16 -> Mul(w fp16): one RMSNorm on the fp16 input."""
    from onnx import TensorProto as T
    from onnx import helper
    from onnx import numpy_helper as nh

    nodes = [helper.make_node("Cast", ["x"], ["xf"], to=T.FLOAT), helper.make_node("Mul", ["xf", "xf"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "ax"], ["ms"]), helper.make_node("Add", ["ms", "eps"], ["v"]),
             helper.make_node("Sqrt", ["v"], ["r"]), helper.make_node("Reciprocal", ["r"], ["ir"]),
             helper.make_node("Mul", ["xf", "ir"], ["n"]), helper.make_node("Cast", ["n"], ["nh"], to=T.FLOAT16),
             helper.make_node("Mul", ["w", "nh"], ["y"])]
    w16 = G.WEIGHT.astype(np.float16)
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT16, ["B", "S", G.H])],
                          [helper.make_tensor_value_info("y", T.FLOAT16, None)],
                          [nh.from_array(w16, "w"), nh.from_array(np.array([-1], np.int64), "ax"),
                           nh.from_array(np.array(1e-6, np.float32), "eps")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    out, _ = _fused(model)
    assert [(n.op_type, list(n.input)) for n in out.graph.node] == [("RMSNorm", ["x", "w"])]
    x = G.xin(2, 3, G.H).astype(np.float16)
    (y,) = G.run(out, x=x)
    assert y.dtype == np.float16
    ref = G.rms_ref(x, w16.astype(np.float64))
    assert np.abs(y - ref).max() <= 2e-3 * np.abs(ref).max()  # docs/design.md §7 fp16


def test_float64_graph_not_fused_into_custom_op_but_into_standard_op():
    """normexport::RMSNorm's schema has no float64 (docs/design.md §2): target trt keeps a double graph,
    target onnx at opset 23 fuses it into RMSNormalization, which takes double."""
    model = G.to_dtype(G.rms_graph(opset=23), onnx.TensorProto.DOUBLE)
    rep = RewriteReport()
    out = rewrite(model, target="trt", report=rep)
    assert G.count(out, "RMSNorm", "normexport") == 0
    reasons = [r["reason"] for rec in rep.rules.values() for r in rec.rejected]
    assert any("float32/float16/bfloat16" in r for r in reasons), reasons
    onnx.checker.check_model(out, full_check=True)
    out = rewrite(model, target="onnx")
    assert G.count(out, "RMSNormalization") == 1
    x = G.xin(2, 3, G.H).astype(np.float64)
    (y,) = G.run(out, x=x)
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, G.rms_ref(x, G.WEIGHT), rtol=1e-6, atol=1e-9)
