"""bn_fold rules: Conv / ConvTranspose / Gemm / MatMul(+Add) + BatchNormalization -> folded weights.

Inputs come from the legacy exporter (dynamo=False, do_constant_folding=False, training=PRESERVE on
an eval model -> inference-form BatchNormalization, training_mode=0); outputs are run in
onnxruntime and compared with the float64 eager reference (tolerance: see _bn_graphs)."""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import _bn_graphs as G  # noqa: E402

from normexport.rewriter.rules import bn_fold  # noqa: E402


def test_contract():
    names = [r.name for r in bn_fold.RULES]
    assert len(names) == len(set(names))
    assert bn_fold.TARGETS == frozenset({"trt", "ort", "onnx"})


def _fold_and_compare(model, x, what=""):
    proto = G.export_legacy(model, (x,))
    ref = G.reference64(model, x)
    eager_err = G.max_err(G.eager32(model, x), ref)
    before = G.op_counts(proto)
    out = G.apply_rules(proto, bn_fold.RULES)
    onnx.checker.check_model(out)
    after = G.op_counts(out)
    ort_before = G.max_err(G.run_ort(proto, x.numpy()), ref)
    err = G.assert_parity(G.run_ort(out, x.numpy()), ref, max(eager_err, ort_before), what)
    return before, after, err


CASES = {
    "conv1d": (lambda eps: nn.Sequential(nn.Conv1d(6, 8, 3, padding=1), nn.BatchNorm1d(8, eps=eps)),
               (2, 6, 17), "Conv"),
    "conv2d_grouped_nobias": (
        lambda eps: nn.Sequential(nn.Conv2d(8, 12, 3, padding=2, dilation=2, groups=4, bias=False),
                                  nn.BatchNorm2d(12, eps=eps)), (2, 8, 11, 9), "Conv"),
    "conv3d": (lambda eps: nn.Sequential(nn.Conv3d(4, 6, 3, stride=2, padding=1), nn.BatchNorm3d(6, eps=eps)),
               (2, 4, 7, 6, 5), "Conv"),
    "convT2d_decoder_groups": (
        lambda eps: nn.Sequential(
            nn.ConvTranspose2d(8, 12, 3, stride=2, padding=1, output_padding=1, groups=4, bias=False),
            nn.BatchNorm2d(12, eps=eps), nn.ReLU(),
            nn.ConvTranspose2d(12, 6, 4, stride=2, padding=1, groups=3), nn.BatchNorm2d(6, eps=eps)),
        (2, 8, 6, 5), "ConvTranspose"),
    "convT1d_groups": (lambda eps: nn.Sequential(nn.ConvTranspose1d(6, 9, 4, stride=2, groups=3),
                                                 nn.BatchNorm1d(9, eps=eps)), (2, 6, 10), "ConvTranspose"),
    "convT3d": (lambda eps: nn.Sequential(nn.ConvTranspose3d(4, 6, 2, stride=2), nn.BatchNorm3d(6, eps=eps)),
                (2, 4, 3, 4, 3), "ConvTranspose"),
    "linear_bn1d_gemm": (lambda eps: nn.Sequential(nn.Linear(20, 12), nn.BatchNorm1d(12, eps=eps)),
                         (5, 20), "Gemm"),
}


@pytest.mark.parametrize("eps", G.EPS_VALUES)
@pytest.mark.parametrize("kind", list(CASES))
def test_fold(kind, eps):
    make, shape, producer = CASES[kind]
    torch.manual_seed(0)
    model = G.randomize_(make(eps)).eval()
    before, after, _ = _fold_and_compare(model, torch.randn(*shape), kind)
    assert before["BatchNormalization"] >= 1
    assert "BatchNormalization" not in after
    assert after[producer] == before[producer]
    assert sum(after.values()) == sum(before.values()) - before["BatchNormalization"] - before.get("Identity", 0)


def _matmul_graph(bias: str, eps: float = 1e-3, rank: int = 2):
    """MatMul(x, W) [+ Add(b)] -> BatchNormalization, with shapes; bias in {"none", "after", "first"}."""
    rng = np.random.default_rng(0)
    k, n = 7, 5
    xs = [4, k] if rank == 2 else [3, n, k]
    c = n
    inits = [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b"),
             numpy_helper.from_array((1 + 0.5 * rng.standard_normal(c)).astype(np.float32), "g"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "beta"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "mean"),
             numpy_helper.from_array(rng.uniform(0.5, 2, c).astype(np.float32), "var")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"])]
    y = "mm"
    if bias == "after":
        nodes.append(helper.make_node("Add", ["mm", "b"], ["lin"])); y = "lin"
    elif bias == "first":
        nodes.append(helper.make_node("Add", ["b", "mm"], ["lin"])); y = "lin"
    nodes.append(helper.make_node("BatchNormalization", [y, "g", "beta", "mean", "var"], ["y"], epsilon=eps))
    out_shape = xs[:-1] + [n]
    g = helper.make_graph(nodes, "mm_bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, xs)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return G.infer_shapes(model), xs


def _numpy_bn_ref(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    i = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    y = x.astype(np.float64) @ i["W"]
    if any(n.op_type == "Add" for n in model.graph.node):
        y = y + i["b"]
    eps = [a.f for n in model.graph.node if n.op_type == "BatchNormalization" for a in n.attribute
           if a.name == "epsilon"][0]
    sh = [1, -1] + [1] * (y.ndim - 2)
    return ((y - i["mean"].reshape(sh)) / np.sqrt(i["var"].reshape(sh) + eps) * i["g"].reshape(sh)
            + i["beta"].reshape(sh))


@pytest.mark.parametrize("bias", ["none", "after", "first"])
def test_fold_matmul_add(bias):
    model, xs = _matmul_graph(bias)
    x = np.random.default_rng(1).standard_normal(xs).astype(np.float32)
    ref = _numpy_bn_ref(model, x)
    out = G.apply_rules(model, bn_fold.RULES)
    counts = G.op_counts(out)
    assert counts == {"MatMul": 1, "Add": 1}, counts
    eager_err = G.max_err(G.run_ort(model, x), ref)
    G.assert_parity(G.run_ort(out, x), ref, eager_err, f"matmul {bias}")


def test_matmul_3d_not_folded():
    model, _ = _matmul_graph("after", rank=3)
    _, reasons = G.bn_kept(model, bn_fold.RULES, "FoldMatMulAddBN")
    assert any("3-D" in r for r in reasons), reasons


class _LinearBN3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x))


def test_legacy_linear_3d_bn1d_not_folded():
    """Legacy export: Add(bias, MatMul(x, Transpose(W))) -> BN over axis 1 (=L): must not fold."""
    model = G.randomize_(_LinearBN3d()).eval()
    x = torch.randn(3, 4, 6)
    proto = G.infer_shapes(G.export_legacy(model, (x,)))
    _, reasons = G.bn_kept(proto, bn_fold.RULES, "FoldMatMulAddBN_bias_first")
    assert any("3-D" in r for r in reasons), reasons


def test_bn_input_with_two_consumers_not_folded():
    model = G.randomize_(G.TwoConsumers()).eval()
    x = torch.randn(2, 3, 8, 8)
    proto = G.export_legacy(model, (x,))
    out, reasons = G.bn_kept(proto, bn_fold.RULES, "FoldConvBN")
    assert any("other uses" in r or "other consumers" in r for r in reasons), reasons
    ref = G.reference64(model, x)
    G.assert_parity(G.run_ort(out, x.numpy()), ref, G.max_err(G.eager32(model, x), ref))


class _SharedConv(nn.Module):
    """The same Conv weight initializer feeds two Conv nodes; only one is followed by BN."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, eps=1e-3)

    def forward(self, x, z):
        return self.bn(self.conv(x)) + self.conv(z)


def test_shared_weight_initializer_copied_not_modified():
    model = G.randomize_(_SharedConv()).eval()
    x, z = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)
    proto = G.export_legacy(model, (x, z))
    convs = [n for n in proto.graph.node if n.op_type == "Conv"]
    assert convs[0].input[1] == convs[1].input[1]
    w_name = convs[0].input[1]
    w_before = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}[w_name]
    out = G.apply_rules(proto, bn_fold.RULES)
    onnx.checker.check_model(out)
    assert "BatchNormalization" not in G.op_counts(out)
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    convs = [n for n in out.graph.node if n.op_type == "Conv"]
    assert len(convs) == 2
    untouched = [c for c in convs if c.input[1] == w_name]
    assert len(untouched) == 1, "the Conv without BN must keep the original weight"
    np.testing.assert_array_equal(inits[w_name], w_before)
    with torch.no_grad():
        ref = copy_model_double(model)(x.double(), z.double()).numpy()
    y = G.run_ort(out, x.numpy(), z.numpy())
    eager = G.eager32(model, x, z)
    G.assert_parity(y, ref, G.max_err(eager, ref))


def copy_model_double(model):
    import copy

    return copy.deepcopy(model).double()


def _bn_graph(training: bool = False, stats_input: bool = False):
    rng = np.random.default_rng(0)
    c = 4
    w = numpy_helper.from_array(rng.standard_normal((c, 3, 3, 3)).astype(np.float32), "W")
    params = {"g": 1 + 0.5 * rng.standard_normal(c), "beta": rng.standard_normal(c),
              "mean": rng.standard_normal(c), "var": rng.uniform(0.5, 2, c)}
    inits = [w] + [numpy_helper.from_array(v.astype(np.float32), k) for k, v in params.items()
                   if not (stats_input and k == "mean")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])]
    if stats_input:
        inputs.append(helper.make_tensor_value_info("mean", TensorProto.FLOAT, [c]))
    outs = ["y", "rm", "rv"] if training else ["y"]
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"]),
             helper.make_node("BatchNormalization", ["c", "g", "beta", "mean", "var"], outs,
                              training_mode=int(training))]
    g = helper.make_graph(nodes, "bn", inputs,
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_training_mode_bn_rejected():
    model = _bn_graph(training=True)  # 3 outputs: the matcher already refuses (outputs in use)
    out = G.apply_rules(model, bn_fold.RULES)
    assert G.op_counts(out)["BatchNormalization"] == 1
    model = _bn_graph()  # training_mode=1 with only Y: our check refuses
    model.graph.node[1].attribute[0].i = 1
    assert model.graph.node[1].attribute[0].name == "training_mode"
    _, reasons = G.bn_kept(model, bn_fold.RULES, "FoldConvBN")
    assert reasons == ["training-mode BN (batch statistics)"], reasons


def test_non_constant_running_stats_rejected():
    model = _bn_graph(stats_input=True)
    _, reasons = G.bn_kept(model, bn_fold.RULES, "FoldConvBN")
    assert any("non-constant running stats" in r for r in reasons), reasons


def test_conv_bn_reference_model():
    conv_bn = pytest.importorskip("normexport.models.conv_bn")
    model = conv_bn.tiny()
    (x,) = model.example_inputs()
    before, after, err = _fold_and_compare(model, x, "conv_bn.tiny")
    assert before["BatchNormalization"] == 4
    assert "BatchNormalization" not in after, after


def _skips(rep):
    return {r["node"]: r["reason"] for rec in rep.rules.values() if rec.module == "bn_fold" for r in rec.rejected}


@pytest.mark.parametrize("target", ["trt", "ort"])
def test_driver_reports_every_bn_folded_or_skipped(target):
    """normexport.rewrite: each BN is folded (counted in applied) or reported skipped with its
    reason, also where no rule got near it (BN after Relu, producer read twice); outputs verified."""
    from normexport.rewriter import RewriteReport, rewrite

    torch.manual_seed(0)
    relu = G.randomize_(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.BatchNorm2d(8, eps=1e-3))).eval()
    x = torch.randn(2, 3, 8, 8)
    for model, applied, why in ((relu, 1, "producer Relu is not Conv"),
                                (G.randomize_(G.TwoConsumers()).eval(), 0, "output also feeds other nodes")):
        proto = G.export_legacy(model, (x,))
        rep = RewriteReport()
        out = rewrite(proto, target=target, report=rep)
        assert sum(r.applied for r in rep.rules.values() if r.module == "bn_fold") == applied
        skips = _skips(rep)
        assert len(skips) == 1 and why in next(iter(skips.values())), (skips, rep.summary())
        assert "skipped" in rep.summary()
        ref = G.reference64(model, x)
        G.assert_parity(G.run_ort(out, x.numpy()), ref, G.max_err(G.eager32(model, x), ref))


def test_driver_reports_training_mode_bn():
    from normexport.rewriter import RewriteReport, rewrite

    model = G.randomize_(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))).eval()
    proto = G.export_legacy(model, (torch.randn(2, 3, 8, 8),))
    bn = next(n for n in proto.graph.node if n.op_type == "BatchNormalization")
    bn.attribute.append(onnx.helper.make_attribute("training_mode", 1))
    rep = RewriteReport()
    rewrite(proto, target="ort", verify=False, report=rep)
    assert any("training" in r for r in _skips(rep).values()) or any(
        "training" in r["reason"] for rec in rep.rules.values() for r in rec.rejected), rep.summary()
