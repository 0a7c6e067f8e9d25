"""Local verification (docs/design.md §8): each fusion's matched subgraph against its replacement, both vs
float64. Planted wrong fusions (epsilon, axis, a dropped weight) must be rejected; correct
fusions downstream of huge activations and upstream of an op onnxruntime lacks must be applied."""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
import pytest

from normexport import ops
from normexport.rewriter import RewriteReport, rewrite
from normexport.rewriter.rules import rms_norm

sys.path.insert(0, os.path.dirname(__file__))
import _graphs as G  # noqa: E402


class _Planted(rms_norm.RMSNormFusion):
    """The RMSNorm rule with one planted mistake in what it writes."""

    plant = ""

    def check(self, context, **kw):
        r = super().check(context, **kw)
        if r and self.plant == "eps":
            self._eps = self._eps * 10  # 1e-6 -> 1e-5: invisible on unit-variance rows
        if r and self.plant == "eps4":
            self._eps = self._eps * 4  # 1e-6 -> 4e-6: a 1.5e-6 relative change on rows of unit scale
        if r and self.plant == "nan":
            self._eps = -1.0  # sqrt of a negative on low-variance rows: NaN where float64 has numbers
        return r

    def rewrite(self, op, x, scale=None, **kw):
        if self.plant == "axis":  # normalize over the last two dims (S=3, H) instead of the last one
            wide = op.Expand(scale, op.Constant(value_ints=[3, G.H]))
            return op.RMSNorm(self._src, wide, _domain="normexport", _version=1, epsilon=self._eps, axis=-2)
        if self.plant == "weight":  # the weight dropped (a unit scale)
            return op.RMSNorm(self._src, op.Constant(value=onnx.numpy_helper.from_array(np.ones(G.H, np.float32))),
                              _domain="normexport", _version=1, epsilon=self._eps, axis=-1)
        if self.plant == "gain":  # the output 0.3 % too large: 1.5x float16's tolerance
            y = super().rewrite(op, x, scale=scale, **kw)
            return op.Mul(y, op.Constant(value=onnx.numpy_helper.from_array(np.array(1.003, np.float16))))
        return super().rewrite(op, x, scale=scale, **kw)


def _with_plant(monkeypatch, plant):
    cls = type(f"Planted_{plant}", (_Planted,), {"plant": plant})
    monkeypatch.setattr(rms_norm, "rules_for", lambda target: [cls.rule("rms_norm_scale_right", root="scale")])


def _static(shape):
    return G.rms_graph(x_shape=list(shape))


@pytest.mark.parametrize("plant", ["eps", "axis", "weight", "nan"])
def test_planted_wrong_fusion_is_rejected(monkeypatch, plant):
    _with_plant(monkeypatch, plant)
    model = _static([2, 3, G.H])
    rep = RewriteReport()
    out = rewrite(model, report=rep)
    rec = rep.rules["rms_norm_scale_right"]
    assert rec.matched == 1 and rec.applied == 0 and G.count(out, "RMSNorm", "normexport") == 0, rep.summary()
    assert rec.rejected[0]["reason"].startswith("local verification: max abs err"), rec.rejected
    (check,) = rep.local.checks
    assert not check.passed and check.err_fused > check.tolerance and check.err_original <= check.tolerance
    if plant == "nan":
        assert check.err_fused == float("inf")
    assert "NOT APPLIED: 1 fusion(s) failed local verification" in rep.summary()


def test_unplanted_rule_passes_the_same_check(monkeypatch):
    """The control: the same subclass without a plant fuses (the rejections above are the plants)."""
    _with_plant(monkeypatch, "")
    rep = RewriteReport()
    out = rewrite(_static([2, 3, G.H]), report=rep)
    assert G.count(out, "RMSNorm", "normexport") == 1, rep.summary()
    assert rep.local.checks[0].passed


def test_eps_plant_is_invisible_to_unit_variance_data(monkeypatch):
    """Why the local inputs have rows of tiny variance: on unit-variance rows (what a whole model's
    random input gives) the eps plant is within fp32 tolerance of the float64 formula."""
    x = G.xin(2, 3, G.H)
    assert np.abs(G.rms_ref(x, G.WEIGHT, 1e-5) - G.rms_ref(x, G.WEIGHT, 1e-6)).max() < 1e-5 * np.abs(G.rms_ref(x, G.WEIGHT)).max()


def test_correct_fusion_downstream_of_large_activations_is_applied():
    """An RMSNorm after a MatMul that blows activations up to ~1e4, then an amplifying MatMul: the
    whole-model comparison drowns in the fp32 error of the big MatMuls; the local check sees the
    RMSNorm alone and accepts it."""
    rng = np.random.default_rng(3)
    g = G.G(18)
    g.inputs[0] = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 16, 64])
    h = g.node("MatMul", "x", g.init((rng.standard_normal((64, G.H)) * 300).astype(np.float32), "w_up"))
    ms = g.reduce_mean(g.node("Mul", h, h), [-1])
    n = g.node("Div", h, g.node("Sqrt", g.node("Add", ms, g.init(np.array(1e-6, np.float32), "eps"))))
    y = g.node("Mul", n, g.init(G.WEIGHT, "w"))
    out_big = g.node("MatMul", y, g.init((rng.standard_normal((G.H, 256)) * 1e3).astype(np.float32), "w_amp"))
    model = g.model(out_big)
    rep = RewriteReport()
    out = rewrite(model, report=rep)
    assert G.count(out, "RMSNorm", "normexport") == 1 and rep.applied == 1, rep.summary()
    assert rep.local.checks[0].passed
    x = rng.standard_normal((2, 16, 64)).astype(np.float32)
    w_up = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name.startswith("w_up")))
    w_amp = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name.startswith("w_amp")))
    ref = G.rms_ref(x.astype(np.float64) @ w_up, G.WEIGHT) @ w_amp.astype(np.float64)
    got = G.run(out, x=x)[0]
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_correct_fusion_upstream_of_an_op_onnxruntime_lacks_is_applied():
    """A node of a private domain after the RMSNorm: onnxruntime cannot run the model as a whole
    (the extra says so), the fusion is verified locally and applied."""
    g = G.G(18)
    ms = g.reduce_mean(g.node("Mul", "x", "x"), [-1])
    n = g.node("Div", "x", g.node("Sqrt", g.node("Add", ms, g.init(np.array(1e-6, np.float32), "eps"))))
    y = g.node("Mul", n, g.init(G.WEIGHT, "w"))
    g.nodes.append(onnx.helper.make_node("Mystery", [y], ["z"], domain="com.example"))
    m = onnx.helper.make_model(onnx.helper.make_graph(
        g.nodes, "g", g.inputs, [onnx.helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None)], g.inits),
        opset_imports=[onnx.helper.make_opsetid("", 18), onnx.helper.make_opsetid("com.example", 1)])
    m.ir_version = 8
    rep = RewriteReport()
    out = rewrite(m, report=rep)
    assert G.count(out, "RMSNorm", "normexport") == 1 and rep.applied == 1, rep.summary()
    assert rep.whole_model.startswith("not run"), rep.whole_model
    (node,) = [n for n in out.graph.node if n.op_type == "Mystery"]
    (fused,) = ops.custom_nodes(out)
    assert node.input[0] == fused.output[0]


def test_identical_subgraphs_are_verified_once():
    """Two RMSNorms with the same weight and eps at the same shapes: one run, two applied."""
    g = G.G(18)
    x = "x"
    for _ in range(2):
        ms = g.reduce_mean(g.node("Mul", x, x), [-1])
        n = g.node("Div", x, g.node("Sqrt", g.node("Add", ms, g.init(np.array(1e-6, np.float32), "eps"))))
        x = g.node("Mul", n, g.init(G.WEIGHT, "w"))
    rep = RewriteReport()
    out = rewrite(g.model(x), report=rep)
    assert G.count(out, "RMSNorm", "normexport") == 2
    assert [c.reused for c in rep.local.checks] == [False, True] and rep.local.summary()["distinct"] == 1


def test_bfloat16_fusion_is_verified_widened():
    """bfloat16: onnxruntime's CPU provider lacks bf16 Mul; the subgraphs run widened to float32
    there (said in the report) and the fusion is applied."""
    model = G.to_dtype(_static([2, 3, G.H]), onnx.TensorProto.BFLOAT16)
    rep = RewriteReport()
    out = rewrite(model, report=rep)
    assert G.count(out, "RMSNorm", "normexport") == 1, rep.summary()
    (check,) = rep.local.checks
    assert check.passed and check.widened and check.dtype == "bfloat16"
    assert "bfloat16 widened to float32" in rep.summary()


def test_an_embedding_table_stays_out_of_the_local_check():
    """An RMSNorm on Cast(Gather(embedding table)) (the HF upcast right after the embedding): the
    replacement reads the Gather's output, the matched subgraph the Cast's; the Cast is pulled into
    the check, never the Gather and its multi-MiB table (a 1.1 GB vocabulary made the check of a
    LLaMA hold 20 GiB): the check's inputs are the [B, S, H] activations."""
    g = G.G(18)
    g.inputs[0] = onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [2, 5])
    table = np.random.default_rng(4).standard_normal((100_000, G.H)).astype(np.float16)  # 1.5 MiB
    h = g.node("Gather", g.init(table, "embed"), "ids")
    x = g.node("Cast", h, to=onnx.TensorProto.FLOAT)
    ms = g.reduce_mean(g.node("Mul", x, x), [-1])
    n = g.node("Div", x, g.node("Sqrt", g.node("Add", ms, g.init(np.array(1e-6, np.float32), "eps"))))
    model = g.model(g.node("Mul", n, g.init(G.WEIGHT, "w")))
    rep = RewriteReport()
    out = rewrite(model, report=rep)
    assert G.count(out, "RMSNorm", "normexport") == 1, rep.summary()
    (check,) = rep.local.checks
    assert check.passed and list(check.shapes.values()) == [[2, 5, G.H]], check.shapes


def test_rows_of_small_scale_are_what_catches_a_changed_epsilon(monkeypatch):
    """The local inputs must have rows of very different scales (std 1e-3 .. 10): an epsilon 4x too
    large changes a row of unit scale by ~1e-6 relative (inside float32's tolerance, the next
    assertion proves it on the same kind of rows), a row of scale 1e-3 by a factor. A check that fed
    rows of one scale (scale 1.0) would apply this fusion."""
    x = np.random.default_rng(5).standard_normal((4, 16, 64)) + np.random.default_rng(6).standard_normal((4, 16, 1))
    w = np.ones(64)
    assert np.abs(G.rms_ref(x, w, 4e-6) - G.rms_ref(x, w, 1e-6)).max() < 1e-5 * np.abs(G.rms_ref(x, w)).max()
    _with_plant(monkeypatch, "eps4")
    model = G.rms_graph(x_shape=[4, 16, 64], w=(np.random.default_rng(7).standard_normal(64) * 0.5 + 1.3).astype(np.float32))
    rep = RewriteReport()
    out = rewrite(model, report=rep)
    assert G.count(out, "RMSNorm", "normexport") == 0, rep.summary()
    (check,) = rep.local.checks
    assert not check.passed and check.err_fused > 10 * check.tolerance, check


def test_limit_is_twice_the_subgraphs_own_error(monkeypatch):
    """float16: the matched subgraph's own error vs float64 (every op rounded to float16) is a
    sizeable part of the tolerance (more than 1/20 of it). A fusion 0.3 % off (1.5x float16's 2e-3
    tolerance, more than 2x the subgraph's own error, less than 20x) must be rejected: the limit
    max(tolerance, 2 x own error) is the tolerance here; a limit of 20x the subgraph's own error
    would be above the tolerance and let it through (planted: this test fails)."""
    _with_plant(monkeypatch, "gain")
    model = G.to_dtype(G.rms_graph(x_shape=[4, 16, 64], w=(np.random.default_rng(8).standard_normal(64) * 0.5 + 1.3).astype(np.float32)),
                       onnx.TensorProto.FLOAT16)
    rep = RewriteReport()
    out = rewrite(model, report=rep)
    (check,) = rep.local.checks
    assert check.dtype == "float16"
    assert 2 * check.err_original < check.err_fused <= 20 * check.err_original, check  # the case the factor decides
    assert check.err_fused > check.tolerance, check
    assert not check.passed and G.count(out, "RMSNorm", "normexport") == 0, rep.summary()
    assert "the matched subgraph's own error" in rep.rules["rms_norm_scale_right"].rejected[0]["reason"]


def test_float16_fusion_without_the_plant_is_applied(monkeypatch):
    """The control for the test above: the same float16 graph, no plant, fuses."""
    _with_plant(monkeypatch, "")
    model = G.to_dtype(G.rms_graph(x_shape=[4, 16, 64], w=(np.random.default_rng(8).standard_normal(64) * 0.5 + 1.3).astype(np.float32)),
                       onnx.TensorProto.FLOAT16)
    rep = RewriteReport()
    out = rewrite(model, report=rep)
    assert G.count(out, "RMSNorm", "normexport") == 1 and rep.local.checks[0].passed, rep.summary()
