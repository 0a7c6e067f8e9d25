"""recognisers/standard_norms.py: torch's own norms are left alone by design (LayerNorm ->
LayerNormalization, BatchNorm folded or a standard op, GroupNorm / InstanceNorm / LocalResponseNorm
standard ops), reported with the reason and not listed on the terminal; torch.nn.RMSNorm is not one
of them."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from torch import nn

from normexport.prepare.recognisers import left_alone, standard_norms
from normexport.prepare.swap import prepare, summary_lines

sys.path.insert(0, os.path.dirname(__file__))
from _prep import randn, randomize  # noqa: E402

torch.set_grad_enabled(False)


@pytest.mark.parametrize("m, says", [
    (nn.LayerNorm(8), "nn.LayerNorm is exported as ONNX LayerNormalization"),
    (nn.BatchNorm1d(8), "BatchNorm1d is folded into the preceding conv/linear (fold_bn)"),
    (nn.InstanceNorm1d(8, affine=True), "InstanceNorm1d is folded into the preceding conv/linear"),
    (nn.GroupNorm(2, 8), "GroupNorm is exported as a standard ONNX op"),
    (nn.LocalResponseNorm(3), "LocalResponseNorm is exported as a standard ONNX op"),
])
def test_standard_norms_are_left_alone(m, says):
    why = standard_norms.skip_reason(m)
    assert why.startswith("standard torch norm, not swapped: ") and says in why, why
    assert left_alone(m) == why


def test_rmsnorm_and_others_are_not_standard():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for m in (nn.RMSNorm(8), LlamaRMSNorm(8), nn.Linear(8, 8)):
        assert standard_norms.skip_reason(m) is None


def test_prepare_reports_them_and_the_terminal_does_not_list_them():
    m = randomize(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GroupNorm(2, 8), nn.BatchNorm1d(8),
                                nn.RMSNorm(8, eps=1e-6)), seed=1)
    report = []
    new = prepare(m, report)
    skipped = [e for e in report if e["action"] == "skipped"]
    assert [e["kind"] for e in skipped] == ["LayerNorm", "GroupNorm", "BatchNorm1d"]
    assert all(e["reason"].startswith("standard torch norm") and math.isnan(e["max_rel_err"]) for e in skipped)
    assert summary_lines(report) == ["  swapped: 1 RMSNorm -> RMSNorm"]
    assert [type(c) for c in new][:4] == [nn.Linear, nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d]
    x = randn(4, 8, seed=2)
    torch.testing.assert_close(new(x), m(x), rtol=1e-5, atol=1e-6)
