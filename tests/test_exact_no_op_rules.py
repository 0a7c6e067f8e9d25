"""onnxscript's optimizer (run by torch.onnx on every dynamo export and by the exporter ladder)
removes `x + c` for any |c| < 1e-8 as if c were 0 (its no-op rules compare with math.isclose,
abs_tol=1e-8): the eps guard of a division goes and 0 / 0 is NaN in the file where eager gives a
number (Sana's DC-AE decoder: `num / (den + 1e-15)`, found by tools/try_pipeline_families.py).
normexport.exporter.optimizer_rules keeps those rules for exact 0 / 1 only. Planted: without
`exact_no_op_rules` in exporter/rungs.py, both tests fail (NaN; the Add is gone)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch


class GuardedRatio(torch.nn.Module):
    """Linear attention's normalisation, as diffusers' SanaMultiscaleLinearAttention writes it:
    ReLU kernels (exact zeros where the input is negative), a ratio with a tiny eps."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        k = torch.relu(self.proj(x))
        num = k * torch.relu(x)
        den = k.sum(-1, keepdim=True)
        return num / (den + 1e-15) * 1.000001 + x


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g)
    x[0, 0] = -1.0 - torch.rand(8, generator=g)  # a row whose kernel is all zeros: den = 0, num = 0
    return x


def test_eps_guard_survives_the_export(tmp_path):
    import onnxruntime as ort

    import normexport

    torch.manual_seed(0)
    m = GuardedRatio().eval()
    with torch.no_grad():
        m.proj.bias.fill_(-10.0)  # every kernel value of the negative row is exactly 0
        x = _inputs()
        want = m(x).double().numpy()
    assert np.isfinite(want).all()
    model = normexport.convert_module(m, (x,), target="onnx")
    consts = [float(onnx.numpy_helper.to_array(t).reshape(-1)[0]) for t in model.graph.initializer
              if onnx.numpy_helper.to_array(t).size == 1]
    consts += [float(onnx.numpy_helper.to_array(a.t).reshape(-1)[0]) for n in model.graph.node
               if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    assert any(c == pytest.approx(1e-15, rel=1e-3) for c in consts), "the + 1e-15 was optimized away"
    assert any(c == pytest.approx(1.000001, abs=2e-7) for c in consts), "the * 1.000001 was optimized away"
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    assert np.isfinite(got).all(), "0 / 0: the eps guard is gone"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_exact_no_ops_still_go():
    """x + 0, 0 + x, x - 0, x * 1, 1 * x, x / 1 are still removed; the rules are restored after."""
    import onnxscript.rewriter as rewriter

    from normexport.exporter.optimizer_rules import exact_no_op_rules

    class NoOps(torch.nn.Module):
        def forward(self, x):
            return ((0.0 + (x + 0.0) - 0.0) * 1.0) / 1.0 * torch.tensor(1.0) + torch.tanh(x)

    before = rewriter._DEFAULT_REWRITE_RULES
    with exact_no_op_rules():
        p = torch.onnx.export(NoOps(), (torch.randn(2, 3),), dynamo=True, optimize=True, verbose=False)
    assert rewriter._DEFAULT_REWRITE_RULES is before
    assert sorted(n.op_type for n in p.model.graph) == ["Add", "Tanh"], [n.op_type for n in p.model.graph]
