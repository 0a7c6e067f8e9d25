"""rules/skip_rms_norm_trt.py: residual Add -> normexport::RMSNorm -> normexport::SkipRMSNorm (target trt).

Graphs: the decomposed RMSNorm of a residual sum (the rms_norm rule makes the normexport::RMSNorm
first, then this rule fuses the Add), and hand-built normexport::RMSNorm graphs. Results are
compared with float64 formulas; every fusion passes the rewriter's local verification."""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from normexport import ops
from normexport.errors import UsageError
from normexport.rewriter import RewriteReport, rewrite
from normexport.rewriter import switches
from normexport.rewriter.rules import skip_rms_norm_trt as mod

sys.path.insert(0, os.path.dirname(__file__))
import _graphs as G  # noqa: E402

H = G.H


@pytest.fixture(autouse=True)
def residual_fusion_default(monkeypatch):
    """The rule is on by default for target trt: these tests run without NORMEXPORT_RESIDUAL_FUSION."""
    monkeypatch.delenv(switches.ENV, raising=False)


def _decomposed(residual=True, elem=TensorProto.FLOAT, r_shape=("B", "S", H), eps=1e-6, sum_output=False):
    """s = Add(x, r); y = s / sqrt(mean(s^2) + eps) * w; z = Add(y, s) (residual) or y."""
    np_dt = helper.tensor_dtype_to_np_dtype(elem)
    inits = [numpy_helper.from_array(G.WEIGHT.astype(np_dt), "w"),
             numpy_helper.from_array(np.array(2.0, np_dt), "two"),
             numpy_helper.from_array(np.array(eps, np_dt), "eps"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    nodes = [helper.make_node("Add", ["x", "r"], ["s"]),
             helper.make_node("Pow", ["s", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["v"]),
             helper.make_node("Sqrt", ["v"], ["rt"]),
             helper.make_node("Div", ["s", "rt"], ["n"]),
             helper.make_node("Mul", ["n", "w"], ["y"])]
    outs = ["y"]
    if residual:
        nodes.append(helper.make_node("Add", ["y", "s"], ["z"]))
        outs = ["z"]
    if sum_output:
        outs.append("s")
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, ["B", "S", H]),
                                       helper.make_tensor_value_info("r", elem, list(r_shape))],
                          [helper.make_tensor_value_info(o, elem, None) for o in outs], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    return onnx.shape_inference.infer_shapes(m)


def _ref(x, r, residual=True, eps=1e-6):
    s = x.astype(np.float64) + r.astype(np.float64)
    y = G.rms_ref(s, G.WEIGHT, eps)
    return y + s if residual else y


def _inputs(shape=(2, 3, H), dtype=np.float32):
    return G.xin(*shape, seed=1).astype(dtype), G.xin(*shape, seed=2).astype(dtype)


def _fused(model, off=None):
    report = RewriteReport()
    return rewrite(model, target="trt", report=report, off=off), report


def _skip_nodes(m):
    return [n for n in m.graph.node if n.domain == ops.DOMAIN and n.op_type == "SkipRMSNorm"]


def test_residual_add_and_rmsnorm_fuse():
    out, rep = _fused(_decomposed())
    (node,) = _skip_nodes(out)
    assert G.op_types(out) == ["SkipRMSNorm", "Add"], G.op_types(out)
    assert list(node.input[:2]) == ["x", "r"] and len(node.output) == 2
    assert out.graph.node[1].input[1] == node.output[1]  # the residual reads the fused Sum
    assert rep.rules["skip_rms_norm_trt_residual"].applied == 1 and not rep.unverified()
    onnx.checker.check_model(out, full_check=True)
    x, r = _inputs()
    (z,) = G.run(out, x=x, r=r)
    G.assert_close(z, _ref(x, r), "fused vs fp64 formula")


def test_sum_read_only_by_the_norm():
    out, rep = _fused(_decomposed(residual=False))
    (node,) = _skip_nodes(out)
    assert G.op_types(out) == ["SkipRMSNorm"]
    assert rep.rules["skip_rms_norm_trt"].applied == 1
    x, r = _inputs()
    G.assert_close(G.run(out, x=x, r=r)[0], _ref(x, r, residual=False))


def test_fp16():
    out, rep = _fused(_decomposed(elem=TensorProto.FLOAT16))
    assert len(_skip_nodes(out)) == 1 and not rep.unverified()
    x, r = _inputs(dtype=np.float16)
    (z,) = G.run(out, x=x, r=r)
    ref = _ref(x, r)
    assert np.abs(z.astype(np.float64) - ref).max() <= 2e-3 * np.abs(ref).max()


@pytest.mark.parametrize("kw, reason", [
    ({"r_shape": (1, 1, H)}, "not known to have the sum's shape"),
    ({"sum_output": True}, "graph output"),
])
def test_near_misses_untouched(kw, reason):
    out, rep = _fused(_decomposed(**kw))
    assert not _skip_nodes(out) and G.op_types(out).count("RMSNorm") == 1
    reasons = [r["reason"] for rec in rep.rules.values() for r in rec.rejected]
    assert any(reason in why for why in reasons), reasons


def test_not_for_other_targets():
    out = rewrite(_decomposed(), target="ort")
    assert not _skip_nodes(out)


def test_off_with_the_flag():
    """--no-residual-fusion: the plain normexport::RMSNorm and the Add stay, and the report says the
    rules are off and which flag did it (never silent)."""
    out, rep = _fused(_decomposed(), off=switches.from_flags(no_residual_fusion=True))
    assert not _skip_nodes(out) and G.op_types(out) == ["Add", "RMSNorm", "Add"], G.op_types(out)
    assert rep.modules["skip_rms_norm_trt"] == "off (--no-residual-fusion)"
    assert "module skip_rms_norm_trt: off (--no-residual-fusion)" in rep.summary()
    d = rep.to_dict()
    assert d["residual_fusion"] is False and d["fusion_off"]["skip_rms_norm_trt"] == "--no-residual-fusion"
    assert rep.norm_nodes == {"normexport::RMSNorm": 1}
    x, r = _inputs()
    (z,) = G.run(out, x=x, r=r)
    G.assert_close(z, _ref(x, r), "unfused vs fp64 formula")


def test_off_by_module_name():
    """--no-fuse skip_rms_norm_trt turns that module alone off; a wrong name is refused naming the modules."""
    out, rep = _fused(_decomposed(), off=switches.from_flags(no_fuse=["skip_rms_norm_trt"]))
    assert not _skip_nodes(out)
    assert rep.modules["skip_rms_norm_trt"] == "off (--no-fuse skip_rms_norm_trt)"
    assert rep.modules["gated_adaln"] != "off (--no-fuse skip_rms_norm_trt)"
    with pytest.raises(UsageError, match="--no-fuse skip_rms: no such rule module; use one of bn_fold, "):
        switches.from_flags(no_fuse=["skip_rms"])


def test_deprecated_environment_variable_still_works(monkeypatch):
    """NORMEXPORT_RESIDUAL_FUSION=0 keeps working one release, with a reason that points to the flag."""
    monkeypatch.setenv(switches.ENV, "0")
    out, rep = _fused(_decomposed())
    assert not _skip_nodes(out)
    assert rep.modules["skip_rms_norm_trt"] == ("off (NORMEXPORT_RESIDUAL_FUSION=0 in the environment; deprecated, "
                                                "use --no-residual-fusion)")
    assert rep.to_dict()["residual_fusion"] is False


def test_default_report_counts_the_fused_node():
    out, rep = _fused(_decomposed())
    assert rep.modules["skip_rms_norm_trt"] == "ok" and rep.norm_nodes == {"normexport::SkipRMSNorm": 1}
    assert rep.to_dict()["residual_fusion"] is True and rep.to_dict()["fusion_off"] == {}
    assert "  norm nodes: 1 normexport::SkipRMSNorm" in rep.summary().splitlines()


@pytest.mark.parametrize("value", ["yes", "2", "off"])
def test_other_environment_values_refused(monkeypatch, value):
    monkeypatch.setenv(switches.ENV, value)
    with pytest.raises(UsageError, match=f"NORMEXPORT_RESIDUAL_FUSION='{value}': the variable is deprecated; pass "
                                         "--no-residual-fusion"):
        rewrite(_decomposed(), target="trt")


def test_wrong_fusion_is_rejected_by_local_verification(monkeypatch):
    """A planted bug (the fused node gets epsilon x 1000) is caught by the local verification: the
    match is rejected, the graph keeps Add + RMSNorm."""
    class Planted(mod.SkipRMSNormTrtFusion):
        def check(self, *a, **k):
            r = super().check(*a, **k)
            self._eps = self._eps * 1000
            return r

    monkeypatch.setattr(mod, "RULES", [Planted.rule("skip_rms_norm_trt", residual=False),
                                       Planted.rule("skip_rms_norm_trt_residual", residual=True)])
    out, rep = _fused(_decomposed())
    assert not _skip_nodes(out)
    assert rep.unverified(), "the wrong fusion was not rejected"
