"""A TorchScript file of a *scripted* model (torch.jit.script, with control flow torch's TorchScript ->
ExportedProgram converter cannot take) converts: it is exported as it is by the TorchScript rung,
with no forward hooks (a ScriptModule refuses them: "register_forward_pre_hook is not supported on
ScriptModules" was an internal error), and the ONNX rewriter fuses its norms. `--module NAME` of a
TorchScript model, whose submodule calls no hook can see, is one line and exit 2 naming the fix."""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn


class Gated(nn.Module):
    """Linear -> LayerNorm, an optional mask (an `if` in TorchScript) and a loop."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)

    def forward(self, x, mask: Optional[torch.Tensor] = None):
        y = self.ln(self.fc(x))
        if mask is not None:
            y = y * mask
        for _ in range(2):
            y = y + 1.0
        return y


@pytest.fixture
def scripted(tmp_path):
    torch.manual_seed(0)
    m = Gated().eval()
    with torch.no_grad():
        m.ln.weight.uniform_(0.5, 1.5)
        m.ln.bias.uniform_(-0.5, 0.5)
    path = tmp_path / "gated.pt"
    torch.jit.script(m).save(str(path))
    return m, path


def _run(argv, capfd):
    from normexport.cli import main

    rc = main([str(a) for a in argv])
    out, err = capfd.readouterr()
    return rc, out, err


def test_scripted_model_with_control_flow_converts(scripted, tmp_path, capfd):
    m, path = scripted
    out = tmp_path / "gated.onnx"
    rc, so, err = _run(["convert", path, "--input", "x:2x8x16", "--input", "mask:2x8x16", "-o", out], capfd)
    assert rc == 0, (so, err)
    assert "internal error" not in err and "Traceback" not in err
    onnx.checker.check_model(str(out), full_check=True)
    model = onnx.load(str(out))
    assert "LayerNormalization" in {n.op_type for n in model.graph.node}
    x, mask = torch.randn(2, 8, 16), (torch.rand(2, 8, 16) > 0.3).float()
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x.numpy(), "mask": mask.numpy()})[0]
    with torch.no_grad():
        want = m(x, mask).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_module_of_a_torchscript_model_is_one_line(scripted, tmp_path, capfd):
    _, path = scripted
    out = tmp_path / "part.onnx"
    rc, so, err = _run(["convert", path, "--input", "x:2x8x16", "--input", "mask:2x8x16", "--module", "ln",
                        "-o", out], capfd)
    assert rc == 2, (so, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("normexport: error: --module ln: the model is TorchScript"), err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["gated.pt"]
    # the fix it names works: the submodule saved as its own file converts
    torch.jit.load(str(path)).ln.save(str(tmp_path / "part.pt"))
    rc, so, err = _run(["convert", tmp_path / "part.pt", "--input", "x:2x8x16", "-o", out, "--no-check"], capfd)
    assert rc == 0, (so, err)
    onnx.checker.check_model(str(out), full_check=True)
