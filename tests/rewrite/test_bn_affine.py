"""bn_affine: a BatchNormalization that bn_fold could not fold -> Mul + Add (per-channel constants
broadcast on axis 1), for the targets where that is chosen (see the measurement in bn_affine)."""

from __future__ import annotations

import os
import sys

import onnx
import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import _bn_graphs as G  # noqa: E402

from normexport.rewriter.rules import bn_affine, bn_fold  # noqa: E402


def test_contract():
    names = [r.name for r in bn_affine.RULES]
    assert len(names) == len(set(names))
    assert bn_affine.TARGETS <= {"trt", "ort", "onnx"}
    # measured: onnxruntime CPU runs BatchNormalization 2-5x faster than Mul+Add -> kept for ort
    assert "ort" not in bn_affine.TARGETS and "trt" in bn_affine.TARGETS


def _run(model, x, shape_inference=True):
    proto = G.export_legacy(model, (x,))
    if shape_inference:
        proto = G.infer_shapes(proto)
    ref = G.reference64(model, x)
    eager_err = G.max_err(G.eager32(model, x), ref)
    before = G.op_counts(proto)
    out = G.apply_rules(G.apply_rules(proto, bn_fold.RULES), bn_affine.RULES)
    onnx.checker.check_model(out)
    err = G.assert_parity(G.run_ort(out, x.numpy()), ref,
                          max(eager_err, G.max_err(G.run_ort(proto, x.numpy()), ref)))
    return before, G.op_counts(out), err


@pytest.mark.parametrize("eps", G.EPS_VALUES)
def test_bn_after_relu_becomes_mul_add(eps):
    torch.manual_seed(0)
    model = G.randomize_(nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8, eps=eps), nn.ReLU(),
                                       nn.BatchNorm2d(8, eps=eps), nn.Conv2d(8, 4, 1))).eval()
    before, after, _ = _run(model, torch.randn(2, 4, 9, 9))
    assert before["BatchNormalization"] == 2
    assert "BatchNormalization" not in after
    assert after["Mul"] == 1 and after["Add"] == 1 and after["Conv"] == 2


@pytest.mark.parametrize("shape", [(6, 8), (3, 8, 5), (2, 8, 3, 4, 5)])
def test_ranks(shape):
    bn = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 5: nn.BatchNorm3d}[len(shape)](8, eps=1e-3)
    model = G.randomize_(nn.Sequential(nn.ReLU(), bn)).eval()
    before, after, _ = _run(model, torch.randn(*shape))
    assert "BatchNormalization" not in after and after["Mul"] == 1 and after["Add"] == 1


def test_rank_from_conv_without_shape_inference():
    """No value_info from the legacy exporter: the rank is traced back through Relu to the Conv."""
    model = G.randomize_(nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.BatchNorm2d(6))).eval()
    before, after, _ = _run(model, torch.randn(2, 3, 8, 8), shape_inference=False)
    assert "BatchNormalization" not in after


def test_unknown_rank_kept():
    model = G.randomize_(nn.Sequential(nn.Softmax(dim=1), nn.BatchNorm1d(6))).eval()
    x = torch.randn(2, 6, 4)
    proto = G.export_legacy(model, (x,))
    for v in list(proto.graph.input):  # forget the input shape: no way to know the rank
        v.type.tensor_type.ClearField("shape")
    _, reasons = G.bn_kept(proto, bn_affine.RULES, "BatchNormToMulAdd")
    assert any("rank unknown" in r for r in reasons), reasons


def test_conv_bn_reference_model_has_nothing_left():
    conv_bn = pytest.importorskip("normexport.models.conv_bn")
    model = conv_bn.tiny()
    (x,) = model.example_inputs()
    before, after, _ = _run(model, x)
    assert "BatchNormalization" not in after and "Mul" not in after
