"""rules/gated_adaln.py: x + gate * update, then normexport::AdaLNZero -> normexport::GatedAdaLNZero
(target trt). Hand-built DiT residual graphs (LayerNormalization + modulation, which the adaln rule
turns into normexport::AdaLNZero first); results against float64 formulas; local verification."""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from normexport import ops
from normexport.rewriter import RewriteReport, rewrite
from normexport.rewriter import switches
from normexport.rewriter.rules import gated_adaln as mod

sys.path.insert(0, os.path.dirname(__file__))
import _graphs as G  # noqa: E402

H = G.H


@pytest.fixture(autouse=True)
def residual_fusion_default(monkeypatch):
    """The rule is on by default for target trt: these tests run without NORMEXPORT_RESIDUAL_FUSION."""
    monkeypatch.delenv(switches.ENV, raising=False)


def _dit(gate_form="unsqueeze", residual=True, affine=True, elem=TensorProto.FLOAT, mul_left=False):
    """s = x + Unsqueeze(gate) * u; y = LN(s) * (1 + Unsqueeze(scale)) + Unsqueeze(shift);
    z = y + s (residual) or y. gate_form: 'unsqueeze' ([B, H] gate), 'b1h' ([B, 1, H] input), 'full'."""
    np_dt = helper.tensor_dtype_to_np_dtype(elem)
    inits = [numpy_helper.from_array(np.array([1], np.int64), "ax"),
             numpy_helper.from_array(np.array(1.0, np_dt), "one"),
             numpy_helper.from_array((G.WEIGHT if affine else np.ones(H, np.float32)).astype(np_dt), "w")]
    ln_in = ["s", "w"]
    if affine:
        inits.append(numpy_helper.from_array(G.BIAS.astype(np_dt), "b"))
        ln_in.append("b")
    gate_shape = {"unsqueeze": ["B", H], "b1h": ["B", 1, H], "full": ["B", "S", H]}[gate_form]
    g = "g" if gate_form != "unsqueeze" else "gu"
    nodes = []
    if gate_form == "unsqueeze":
        nodes.append(helper.make_node("Unsqueeze", ["gate", "ax"], ["gu"]))
    nodes += [helper.make_node("Mul", ["u", g] if mul_left else [g, "u"], ["gm"]),
              helper.make_node("Add", ["x", "gm"], ["s"]),
              helper.make_node("LayerNormalization", ln_in, ["ln"], axis=-1, epsilon=1e-6),
              helper.make_node("Unsqueeze", ["scale", "ax"], ["scu"]),
              helper.make_node("Unsqueeze", ["shift", "ax"], ["shu"]),
              helper.make_node("Add", ["scu", "one"], ["op1"]),
              helper.make_node("Mul", ["ln", "op1"], ["m"]),
              helper.make_node("Add", ["m", "shu"], ["y"])]
    outs = ["y"]
    if residual:
        nodes.append(helper.make_node("Add", ["y", "s"], ["z"]))
        outs = ["z"]
    ins = [helper.make_tensor_value_info("x", elem, ["B", "S", H]), helper.make_tensor_value_info("u", elem, ["B", "S", H]),
           helper.make_tensor_value_info("gate" if gate_form == "unsqueeze" else "g", elem, gate_shape),
           helper.make_tensor_value_info("shift", elem, ["B", H]), helper.make_tensor_value_info("scale", elem, ["B", H])]
    graph = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info(o, elem, None) for o in outs], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    return onnx.shape_inference.infer_shapes(m)


def _feeds(gate_form="unsqueeze", dtype=np.float32):
    rng = np.random.default_rng(3)
    b, s = 2, 3
    gate_shape = {"unsqueeze": (b, H), "b1h": (b, 1, H), "full": (b, s, H)}[gate_form]
    f = {"x": G.xin(b, s, H, seed=4), "u": G.xin(b, s, H, seed=5),
         "gate" if gate_form == "unsqueeze" else "g": rng.standard_normal(gate_shape).astype(np.float32) + 0.5,
         "shift": rng.standard_normal((b, H)).astype(np.float32), "scale": rng.standard_normal((b, H)).astype(np.float32)}
    return {k: v.astype(dtype) for k, v in f.items()}


def _ref(f, residual=True, affine=True):
    g = f.get("gate", f.get("g")).astype(np.float64)
    g = g[:, None, :] if g.ndim == 2 else g
    s = f["x"].astype(np.float64) + g * f["u"].astype(np.float64)
    y = G.ln_ref(s, G.WEIGHT if affine else None, G.BIAS if affine else None, 1e-6)
    y = y * (1 + f["scale"].astype(np.float64)[:, None, :]) + f["shift"].astype(np.float64)[:, None, :]
    return y + s if residual else y


def _fused(model, off=None):
    report = RewriteReport()
    return rewrite(model, target="trt", report=report, off=off), report


def _gated(m):
    return [n for n in m.graph.node if n.domain == ops.DOMAIN and n.op_type == "GatedAdaLNZero"]


@pytest.mark.parametrize("gate_form", ["unsqueeze", "b1h"])
@pytest.mark.parametrize("affine", [True, False])
def test_gated_residual_fuses(gate_form, affine):
    out, rep = _fused(_dit(gate_form, affine=affine))
    (node,) = _gated(out)
    assert len(node.output) == 2 and len(node.input) == (7 if affine else 5)
    assert not rep.unverified()
    onnx.checker.check_model(out, full_check=True)
    f = _feeds(gate_form)
    (z,) = G.run(out, **f)
    G.assert_close(z, _ref(f, affine=affine), "fused vs fp64 formula")


def test_mul_operands_swapped_and_no_residual_use():
    out, rep = _fused(_dit(residual=False, mul_left=True))
    assert len(_gated(out)) == 1 and G.op_types(out).count("Add") == 0
    f = _feeds()
    G.assert_close(G.run(out, **f)[0], _ref(f, residual=False))


def test_fp16():
    out, rep = _fused(_dit(elem=TensorProto.FLOAT16))
    assert len(_gated(out)) == 1 and not rep.unverified()
    f = _feeds(dtype=np.float16)
    (z,) = G.run(out, **f)
    ref = _ref(f)
    assert np.abs(z.astype(np.float64) - ref).max() <= 2e-3 * np.abs(ref).max()


def test_full_gate_with_bh_modulation_is_a_near_miss():
    out, rep = _fused(_dit("full"))
    assert not _gated(out) and G.op_types(out).count("AdaLNZero") == 1
    reasons = [r["reason"] for rec in rep.rules.values() for r in rec.rejected]
    assert any("gate shape" in why or "used outside the pattern" in why for why in reasons), reasons


def test_wrong_fusion_is_rejected_by_local_verification(monkeypatch):
    """A planted bug (the fused node reads the shift as the gate) is caught by local verification."""
    class Planted(mod.GatedAdaLNFusion):
        def check(self, context, x, u, shift, scale, sum, norm, **k):  # noqa: A002
            r = super().check(context, x, u, shift, scale, sum, norm, **k)
            self._gate, self._squeeze = shift, False
            return r

    monkeypatch.setattr(mod, "RULES", [Planted.rule(rule.name, residual=rule.name.startswith("gated_adaln_zero_residual"),
                                                    add_left=rule.name.endswith("_l")) for rule in mod.RULES])
    out, rep = _fused(_dit())
    assert not _gated(out)
    assert rep.unverified(), "the wrong fusion was not rejected"


def test_off_with_the_flag():
    """--no-residual-fusion: the plain normexport::AdaLNZero and the gated Add stay, and the report
    says the rule is off and which flag did it (never silent)."""
    out, rep = _fused(_dit(), off=switches.from_flags(no_residual_fusion=True))
    assert not _gated(out) and G.op_types(out).count("AdaLNZero") == 1
    assert rep.modules["gated_adaln"] == "off (--no-residual-fusion)"
    assert rep.norm_nodes == {"normexport::AdaLNZero": 1}
    f = _feeds()
    G.assert_close(G.run(out, **f)[0], _ref(f), "unfused vs fp64 formula")
