"""rules/skip_rms_norm.py: residual Add -> RMSNormalization -> com.microsoft SkipSimplifiedLayerNormalization.

Whether target ort ships the rule is decided by tools/bench_ort.py (see the module docstring);
these tests force it on for target ort (the `skip_on` fixture) so that the rule itself is tested
either way, and check separately that the shipped configuration is what the docstring says.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import normexport.rewriter as rw
from normexport.rewriter import RewriteReport, rewrite
from normexport.rewriter.rules import skip_rms_norm as mod

sys.path.insert(0, os.path.dirname(__file__))
import _graphs as G  # noqa: E402

H = G.H
MS = "com.microsoft"
SKIP = "SkipSimplifiedLayerNormalization"


@pytest.fixture
def skip_on(monkeypatch):
    """The rewriter with skip_rms_norm enabled for target ort (after rms_norm), shipped or not."""
    if "skip_rms_norm" not in rw.RULE_MODULES:
        mods = list(rw.RULE_MODULES)
        mods.insert(mods.index("rms_norm") + 1, "skip_rms_norm")
        monkeypatch.setattr(rw, "RULE_MODULES", tuple(mods))
    monkeypatch.setattr(mod, "TARGETS", frozenset(mod.TARGETS | {"ort"}))
    monkeypatch.setattr(mod, "MIN_HIDDEN", 1)  # the small test graphs are below the size gate
    monkeypatch.setattr(mod, "MIN_ELEMENTS", 1)


def _fused(model, target="ort"):
    report = RewriteReport()
    return rewrite(model, target=target, report=report), report


def _reasons(rep):
    return [r["reason"] for rec in rep.rules.values() for r in rec.rejected]


def _graph(x_shape=("B", "S", H), r_shape=None, swap=False, residual=True, sum_output=False, axis=None,
           stash_type=None, elem=TensorProto.FLOAT, w_shape=(H,), eps=1e-6):
    """s = Add(x, r) (or Add(r, x)); y = RMSNormalization(s, w); outputs z = Add(y, s) (residual) or y."""
    r_shape = x_shape if r_shape is None else r_shape
    np_dt = helper.tensor_dtype_to_np_dtype(elem)
    w = np.resize(G.WEIGHT, w_shape).astype(np_dt)
    attrs = {"epsilon": eps}
    if axis is not None:
        attrs["axis"] = axis
    if stash_type is not None:
        attrs["stash_type"] = stash_type
    nodes = [helper.make_node("Add", ["r", "x"] if swap else ["x", "r"], ["s"]),
             helper.make_node("RMSNormalization", ["s", "w"], ["y"], **attrs)]
    outs = ["y"]
    if residual:
        nodes.append(helper.make_node("Add", ["y", "s"], ["z"]))
        outs = ["z"]
    if sum_output:
        outs.append("s")
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, list(x_shape)),
                                       helper.make_tensor_value_info("r", elem, list(r_shape))],
                          [helper.make_tensor_value_info(o, elem, None) for o in outs],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    m.ir_version = 10
    return onnx.shape_inference.infer_shapes(m)


def _inputs(x_shape, r_shape=None, dtype=np.float32):
    r_shape = x_shape if r_shape is None else r_shape
    return G.xin(*x_shape, seed=1).astype(dtype), G.xin(*r_shape, seed=2).astype(dtype)


def _ref(x, r, w=G.WEIGHT, eps=1e-6, residual=True):
    """fp64 formula: s = x + r; y = s / sqrt(mean(s^2) + eps) * w; z = y + s."""
    s = np.asarray(x, np.float64) + np.asarray(r, np.float64)
    y = G.rms_ref(s, np.asarray(w, np.float64).reshape(-1), eps)
    return y + s if residual else y


def _skip_nodes(model):
    return [n for n in model.graph.node if n.op_type == SKIP and n.domain == MS]


# ---- fuses --------------------------------------------------------------------------------------
def test_residual_sum_becomes_fourth_output(skip_on):
    model = _graph()
    out, rep = _fused(model)
    (node,) = _skip_nodes(out)
    assert G.op_types(out) == [SKIP, "Add"]
    assert list(node.input) == ["x", "r", "w"] and len(node.output) == 4
    assert out.graph.node[1].input[1] == node.output[3]  # the residual reads input_skip_bias_sum
    assert any(o.domain == MS and o.version == 1 for o in out.opset_import)
    assert rep.rules["skip_rms_norm_residual"].applied == 1
    x, r = _inputs((2, 3, H))
    (z,) = G.run(out, x=x, r=r)
    G.assert_close(z, _ref(x, r), "fused vs fp64 formula")


def test_sum_read_only_by_the_norm_uses_one_output(skip_on):
    out, rep = _fused(_graph(residual=False))
    (node,) = _skip_nodes(out)
    assert G.op_types(out) == [SKIP] and len(node.output) == 1  # the sum is not even written
    assert rep.rules["skip_rms_norm"].applied == 1 and rep.rules["skip_rms_norm_residual"].applied == 0
    x, r = _inputs((2, 3, H))
    G.assert_close(G.run(out, x=x, r=r)[0], _ref(x, r, residual=False))


@pytest.mark.parametrize("x_shape,r_shape,swap", [
    (("T", H), None, False),  # 2-D [T, H]
    ((2, 3, H), (3, H), False),  # skip [S, H] broadcast over B
    ((2, 3, H), (1, 3, H), True),  # skip [1, S, H], written first in the Add
    (("B", "S", H), None, True),
])
def test_shapes_that_fit(skip_on, x_shape, r_shape, swap):
    model = _graph(x_shape=x_shape, r_shape=r_shape, swap=swap)
    out, _ = _fused(model)
    (node,) = _skip_nodes(out)
    assert sorted(node.input[:2]) == ["r", "x"]
    if r_shape is not None:  # input is the full-shaped operand, skip the broadcast one, whatever the Add order
        assert list(node.input[:2]) == ["x", "r"]
    conc = tuple(2 if d == "T" else (2 if d == "B" else (3 if d == "S" else d)) for d in x_shape)
    rconc = conc if r_shape is None else tuple(r_shape)
    x, r = _inputs(conc, rconc)
    G.assert_close(G.run(out, x=x, r=r)[0], _ref(x, r))


def test_fp16(skip_on):
    model = _graph(elem=TensorProto.FLOAT16)
    out, _ = _fused(model)
    assert len(_skip_nodes(out)) == 1
    x, r = _inputs((2, 3, H), dtype=np.float16)
    (z,) = G.run(out, x=x, r=r)
    assert z.dtype == np.float16
    ref = _ref(x, r, G.WEIGHT.astype(np.float16))
    assert np.abs(z - ref).max() <= 2e-3 * np.abs(ref).max()  # docs/design.md §7 fp16


def test_idempotent(skip_on):
    out, _ = _fused(_graph())
    again, rep = _fused(out)
    assert again == out and rep.applied == 0


# ---- near-misses: untouched, with the reason -----------------------------------------------------
@pytest.mark.parametrize("kind,kw,reason", [
    ("sum is a graph output", dict(sum_output=True), "graph output"),
    ("norm over a non-last axis", dict(x_shape=(2, 3, H), axis=1, w_shape=(3, H)), "does not normalize the last dim"),
    ("skip [B, 1, H]", dict(x_shape=(2, 3, H), r_shape=(2, 1, H)), "does not fit"),
    ("2-D input, skip [1, H]", dict(x_shape=("T", H), r_shape=(1, H)), "does not fit"),
    ("anonymous dims", dict(x_shape=(None, None, H)), "has the sum's shape"),
    ("stash_type 0", dict(stash_type=0), "stash_type 0"),
    ("rank 4", dict(x_shape=(2, 2, 3, H)), "rank 4"),
    ("float64", dict(elem=TensorProto.DOUBLE), "not float32/float16"),
])
def test_near_misses_untouched(skip_on, kind, kw, reason):
    model = _graph(**kw)
    out, rep = _fused(model)
    assert out == model, kind
    reasons = _reasons(rep)
    assert any(reason in r and r.startswith("failed check: ") for r in reasons), (kind, reasons)


def test_add_feeding_only_a_graph_output_is_untouched(skip_on):
    nodes = [helper.make_node("Add", ["x", "r"], ["s"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, H]) for n in "xr"],
                          [helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, H])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    out, rep = _fused(model)
    assert out == model and rep.applied == 0


def test_not_for_other_targets(skip_on):
    model = _graph()
    for target in ("trt", "onnx"):
        out, rep = _fused(model, target=target)
        assert not _skip_nodes(out)
        assert rep.modules["skip_rms_norm"].startswith("not for target")


# ---- exported reference models ------------------------------------------------------------------
def _norm_heavy_ref(m, x, r, c):
    """models/norm_heavy.py forward in numpy float64 from its parameters."""
    p = {k: v.detach().double().numpy() for k, v in m.state_dict().items()}
    x, r, c = (np.asarray(t, np.float64) for t in (x, r, c))
    h = x + r
    y1 = G.rms_ref(h, p["norm1.weight"], m.norm1.eps)
    y2 = G.rms_ref(y1 + r, p["norm2.weight"], m.norm2.eps)
    cs = c / (1 + np.exp(-c))
    mod_out = cs @ p["modulation.1.weight"].T + p["modulation.1.bias"]
    shift, scale = mod_out[:, :m.hidden], mod_out[:, m.hidden:]
    return G.ln_ref(y2 + h, eps=m.norm3.eps) * (1 + scale) + shift


def test_exported_norm_heavy_target_ort(skip_on):
    import normexport.models.norm_heavy
    from normexport.export import convert_module

    m = normexport.models.norm_heavy.tiny()
    args = m.example_inputs()
    report: dict = {}
    out = convert_module(m, args, target="ort", input_names=m.input_names, report=report)
    nodes = _skip_nodes(out)
    assert len(nodes) == 2 and G.count(out, "RMSNormalization") == 0
    assert sorted(len(n.output) for n in nodes) == [1, 4]  # h = x + r is also read by the last residual
    assert G.count(out, "Add") == 3  # of 5: y2 + h (into the LayerNorm), 1 + scale, + shift
    rules = {r["name"]: r for r in report["rewrite"]["rules"]}
    assert rules["skip_rms_norm"]["applied"] == 1 and rules["skip_rms_norm_residual"]["applied"] == 1
    feeds = {n: a.numpy() for n, a in zip(m.input_names, args)}
    (y,) = G.run(out, **feeds)
    G.assert_close(y, _norm_heavy_ref(m, *feeds.values()), "norm_heavy fused vs fp64 formula")
    again, rep = _fused(out)
    assert again == out and rep.applied == 0  # idempotent on the exported graph too


def test_exported_llama_block_target_ort(skip_on):
    import torch

    import normexport.models.llama
    from normexport.export import convert_module

    m = normexport.models.llama.tiny()
    args = tuple(m.example_inputs(batch=1))
    out = convert_module(m, args, target="ort", input_names=m.input_names)
    (node,) = _skip_nodes(out)  # the second norm reads the residual sum; the first reads the input
    assert len(node.output) == 4
    with torch.no_grad():
        ref = m.double()(*(a.double() for a in args))
    feeds = {n: a.numpy() for n, a in zip(m.input_names, args)}
    G.assert_close(G.run(out, **feeds)[0], ref.numpy(), "llama block fused vs float64 eager")


# ---- what ships ---------------------------------------------------------------------------------
def test_shipped_configuration_matches_the_measurement():
    """Target ort uses the rule (tools/bench_ort.py measured it faster on large tensors), gated by
    size: small hidden sizes and small static tensors stay Add + RMSNormalization, with the reason."""
    import normexport.rewriter.rules as rules

    assert "skip_rms_norm" in rules.RULE_MODULES and "ort" in mod.TARGETS
    assert "Enabled for target ort" in mod.__doc__
    out, rep = _fused(_graph())  # H = 8
    assert not _skip_nodes(out)
    assert any(f"< {mod.MIN_HIDDEN}" in r for r in _reasons(rep)), _reasons(rep)
    big = 2 * mod.MIN_HIDDEN
    out, rep = _fused(_graph(x_shape=(1, 4, big), w_shape=(big,)))  # H large, but 16k elements
    assert not _skip_nodes(out) and any("elements <" in r for r in _reasons(rep)), _reasons(rep)
    out, rep = _fused(_graph(x_shape=("B", "S", big), w_shape=(big,)))  # dynamic rows, large H: fused
    assert len(_skip_nodes(out)) == 1, rep.summary()
