"""normexport.prepare.fold_bn.fold_batchnorm: torch-level BN folding, checked against a float64 reference.

Tolerance: docs/design.md §7 fp32 (max abs err <= 1e-5 * max|ref| + 1e-6), or, where folding's extra
float32 rounding of the weights exceeds that, <= 2x the eager float32 model's own error + 1e-6
(see tests/rewrite/_bn_graphs.py)."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "rewrite"))
import _bn_graphs as G  # noqa: E402

from normexport.prepare.fold_bn import BatchNormAffine, FoldedLinearBatchNorm1d, fold_batchnorm  # noqa: E402

_BN = nn.modules.batchnorm._BatchNorm


def _bns(m: nn.Module) -> list[str]:
    return [n for n, x in m.named_modules() if isinstance(x, _BN)]


def _check(model: nn.Module, *inputs, what="", example=True):
    ref = G.reference64(model, *inputs)
    eager_err = G.max_err(G.eager32(model, *inputs), ref)
    report: list = []
    before = copy.deepcopy(model.state_dict())
    folded = fold_batchnorm(model, report, example_inputs=inputs if example else None)
    # input untouched
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"input module mutated: {k}"
    err = G.assert_parity(G.eager32(folded, *inputs), ref, eager_err, what)
    return folded, report, err


PRODUCERS = {
    "conv1d": (lambda: nn.Conv1d(6, 8, 3, padding=1), nn.BatchNorm1d, (2, 6, 17)),
    "conv2d_grouped_dilated_reflect_nobias": (
        lambda: nn.Conv2d(8, 12, 3, padding=2, dilation=2, groups=4, bias=False, padding_mode="reflect"),
        nn.BatchNorm2d, (2, 8, 11, 9)),
    "conv2d_depthwise_circular": (
        lambda: nn.Conv2d(8, 8, 3, padding=1, groups=8, padding_mode="circular"), nn.BatchNorm2d, (2, 8, 7, 7)),
    "conv3d": (lambda: nn.Conv3d(4, 6, 3, stride=2, padding=1), nn.BatchNorm3d, (2, 4, 7, 6, 5)),
    "convT1d_groups": (lambda: nn.ConvTranspose1d(6, 9, 4, stride=2, groups=3), nn.BatchNorm1d, (2, 6, 10)),
    "convT2d_groups_nobias": (
        lambda: nn.ConvTranspose2d(8, 12, 3, stride=2, padding=1, output_padding=1, groups=4, bias=False),
        nn.BatchNorm2d, (2, 8, 6, 5)),
    "convT3d": (lambda: nn.ConvTranspose3d(4, 6, 2, stride=2), nn.BatchNorm3d, (2, 4, 3, 4, 3)),
    "linear2d": (lambda: nn.Linear(20, 12), nn.BatchNorm1d, (5, 20)),
    "linear2d_nobias": (lambda: nn.Linear(20, 12, bias=False), nn.BatchNorm1d, (5, 20)),
}


def _out_features(m):
    return m.out_features if isinstance(m, nn.Linear) else m.out_channels


@pytest.mark.parametrize("eps", G.EPS_VALUES)
@pytest.mark.parametrize("kind", list(PRODUCERS))
def test_fold_producer(kind, eps):
    make, bn_cls, shape = PRODUCERS[kind]
    torch.manual_seed(0)
    prod = make()
    model = G.randomize_(nn.Sequential(prod, bn_cls(_out_features(prod), eps=eps))).eval()
    x = torch.randn(*shape)
    folded, report, _ = _check(model, x, what=kind)
    assert report == [{"name": "1", "action": "folded", "into": "0", "reason": report[0]["reason"]}]
    assert not _bns(folded)
    assert isinstance(folded[1], nn.Identity)
    assert type(folded[0]) is type(prod) and folded[0].bias is not None


def test_affine_after_relu_and_stacked_decoder():
    torch.manual_seed(1)
    model = G.randomize_(nn.Sequential(
        nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(8, eps=1e-3),      # BN after ReLU
        nn.ConvTranspose2d(8, 8, 4, stride=2, padding=1, groups=2), nn.BatchNorm2d(8, eps=0.1),
        nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1, groups=4), nn.BatchNorm2d(4),
        nn.Sigmoid())).eval()
    folded, report, _ = _check(model, torch.randn(2, 4, 8, 8), what="decoder")
    by = {r["name"]: r for r in report}
    assert by["2"]["action"] == "affine" and "ReLU" in by["2"]["reason"]
    assert isinstance(folded[2], BatchNormAffine)
    assert by["4"]["action"] == "folded" and by["4"]["into"] == "3"
    assert by["6"]["action"] == "folded" and by["6"]["into"] == "5"
    assert not _bns(folded)


@pytest.mark.parametrize("shape", [(4, 8), (4, 8, 5)])
def test_affine_bn1d_after_relu(shape):
    model = G.randomize_(nn.Sequential(nn.ReLU(), nn.BatchNorm1d(8, eps=1e-3))).eval()
    folded, report, _ = _check(model, torch.randn(*shape))
    assert report[0]["action"] == "affine"


def test_batch_statistics_bn_is_skipped():
    model = G.randomize_(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False))).eval()
    report: list = []
    folded = fold_batchnorm(model, report)
    assert report[0]["action"] == "skipped" and "track_running_stats" in report[0]["reason"]
    assert isinstance(folded[1], nn.BatchNorm2d)
    x = torch.randn(4, 3, 6, 6)
    torch.testing.assert_close(folded(x), model(x))


def test_training_mode_bn_is_skipped():
    model = G.randomize_(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))  # .train()
    report: list = []
    folded = fold_batchnorm(model, report)
    assert report[0]["action"] == "skipped" and "training mode" in report[0]["reason"]
    assert isinstance(folded[1], nn.BatchNorm2d) and folded.training


def test_producer_with_two_consumers_not_folded():
    model = G.randomize_(G.TwoConsumers()).eval()
    folded, report, _ = _check(model, torch.randn(2, 3, 8, 8))
    assert report[0]["action"] == "affine" and "2 consumers" in report[0]["reason"]
    torch.testing.assert_close(folded.conv.weight, model.conv.weight)


class _SharedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(3, 4, 3, padding=1)
        self.b.weight = self.a.weight  # tied
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.a(x)) + self.b(x)


def test_shared_weight_other_conv_unchanged():
    model = G.randomize_(_SharedWeight()).eval()
    model.b.weight = model.a.weight
    folded, report, _ = _check(model, torch.randn(2, 3, 8, 8))
    assert report[0]["action"] == "folded" and report[0]["into"] == "a"
    assert torch.equal(folded.b.weight, model.a.weight)
    assert folded.a.weight is not folded.b.weight


class _LinearBN3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.bn = nn.BatchNorm1d(4)  # BatchNorm1d on [N, L=4, C=5] normalizes L

    def forward(self, x):
        return self.bn(self.fc(x))


def test_linear_bn1d_3d_input_not_folded_with_example():
    model = G.randomize_(_LinearBN3d()).eval()
    x = torch.randn(3, 4, 6)
    report: list = []
    folded = fold_batchnorm(model, report, example_inputs=(x,))
    assert report[0]["action"] == "affine" and "3-D" in report[0]["reason"]
    ref = G.reference64(model, x)
    G.assert_parity(G.eager32(folded, x), ref, G.max_err(G.eager32(model, x), ref))


def test_linear_bn1d_rank_guard_without_example():
    model = G.randomize_(nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5, eps=1e-3))).eval()
    report: list = []
    folded = fold_batchnorm(model, report)
    assert report[0]["action"] == "folded" and isinstance(folded[0], FoldedLinearBatchNorm1d)
    for shape in [(7, 6), (3, 5, 6)]:  # 3-D: BN1d normalizes dim 1 (=5 here), the guard runs original ops
        x = torch.randn(*shape)
        ref = G.reference64(model, x)
        G.assert_parity(G.eager32(folded, x), ref, G.max_err(G.eager32(model, x), ref), str(shape))
    x = torch.randn(7, 6)
    folded2 = fold_batchnorm(model, example_inputs=(x,))
    assert type(folded2[0]) is nn.Linear


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6, eps=0.1), nn.ReLU(),
                                  nn.BatchNorm2d(6))
        self.head_bn = nn.BatchNorm2d(6)

    def forward(self, x):
        y = self.body(x)
        if y.sum() > 0:  # data-dependent control flow: fx cannot trace
            y = y * 1.0
        return self.head_bn(y)


def test_sequential_fallback_when_fx_fails():
    model = G.randomize_(_Untraceable()).eval()
    with pytest.raises(Exception):
        torch.fx.symbolic_trace(model)
    folded, report, _ = _check(model, torch.randn(2, 3, 8, 8), example=False)
    by = {r["name"]: r for r in report}
    assert by["body.1"]["action"] == "folded" and "Sequential" in by["body.1"]["reason"]
    assert by["body.3"]["action"] == "affine"
    assert by["head_bn"]["action"] == "affine"
    assert not _bns(folded)


def test_conv_bn_reference_model():
    conv_bn = pytest.importorskip("normexport.models.conv_bn")
    model = conv_bn.tiny()
    inputs = model.example_inputs()
    folded, report, err = _check(model, *inputs, what="conv_bn.tiny")
    assert {r["action"] for r in report} == {"folded"}, report
    assert not _bns(folded)
