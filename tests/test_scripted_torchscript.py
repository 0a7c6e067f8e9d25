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


# ---- --inputs (a recorded (args, kwargs) call) of scripted models (issue 47 item 4b) -------------
def _recorded(tmp_path, mask=True):
    torch.manual_seed(1)
    x = torch.randn(2, 8, 16)
    kwargs = {"mask": (torch.rand(2, 8, 16) > 0.3).float()} if mask else {}
    path = tmp_path / "inputs.pt"
    torch.save(((x,), kwargs), str(path))
    return path, x, kwargs


def _same_as_eager(out, m, x, kwargs):
    feeds = {"x": x.numpy(), **{k: v.numpy() for k, v in kwargs.items()}}
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    with torch.no_grad():
        want = m(x, **kwargs).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("target", ["trt", "onnx"])
def test_scripted_model_with_recorded_call_converts(scripted, tmp_path, capfd, target):
    """The recorded call's keyword reaches its parameter positionally (forward's schema): no adapter
    and no forward hooks on the ScriptModule (was 'internal error: register_forward_pre_hook ...')."""
    m, path = scripted
    inputs, x, kwargs = _recorded(tmp_path)
    out = tmp_path / "gated.onnx"
    rc, so, err = _run(["convert", path, "--inputs", inputs, "--target", target, "-o", out], capfd)
    assert rc == 0, (so, err)
    assert "internal error" not in err and "Traceback" not in err
    onnx.checker.check_model(str(out), full_check=True)
    assert [i.name for i in onnx.load(str(out)).graph.input] == ["x", "mask"]
    _same_as_eager(out, m, x, kwargs)
    rc, so, err = _run(["check", out, "--reference", path, "--inputs", inputs], capfd)
    assert rc == 0 and "PASSED" in so, (so, err)


def test_scripted_recorded_call_that_skips_a_parameter_is_one_line(tmp_path, capfd):
    class Two(nn.Module):
        def forward(self, x, mask: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None):
            return x * 2.0 if scale is None else x * scale

    path = tmp_path / "two.pt"
    torch.jit.script(Two()).save(str(path))
    inputs = tmp_path / "inputs.pt"
    torch.save(((torch.randn(2, 4),), {"scale": torch.randn(2, 4)}), str(inputs))
    out = tmp_path / "two.onnx"
    rc, so, err = _run(["convert", path, "--inputs", inputs, "-o", out], capfd)
    assert rc == 2, (so, err)
    assert len(err.strip().splitlines()) == 1 and "parameter 'mask' is not given" in err, err
    assert not out.exists()


class Holder(nn.Module):
    """A Python model with a scripted submodule (torch.jit.script of one part)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(16, 16)
        self.body = torch.jit.script(Gated().eval())

    def forward(self, x, mask: Optional[torch.Tensor] = None):
        return self.body(self.pre(x), mask)


def make_holder():
    return Holder().eval()


def test_python_model_with_a_scripted_part_and_recorded_call(tmp_path, capfd, monkeypatch):
    """The prepare step (call capture, swaps, folding) hooks every submodule: with a ScriptModule
    inside, it is skipped and said in the report (was 'internal error: register_forward_pre_hook ...').
    torch.onnx itself cannot export a Python model calling a scripted submodule (its trace refuses
    the ScriptModule: 'not part of the active trace'): that is a one-line export failure, nothing written."""
    from normexport.prepare.for_export import prepare_for_export
    from normexport.prepare.swap import summary_lines

    _, x, kwargs = _recorded(tmp_path)
    report: dict = {}
    holder = make_holder()
    module, unswapped = prepare_for_export(holder, (x, kwargs["mask"]), target="trt", report=report)
    assert module is holder and unswapped is holder
    assert any("body is TorchScript (scripted or traced): no torch-side preparation" in line
               for line in summary_lines(report["prepare"])), report
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    inputs = tmp_path / "inputs.pt"
    out = tmp_path / "holder.onnx"
    rc, so, err = _run(["convert", "test_scripted_torchscript:make_holder", "--inputs", inputs, "--target", "trt",
                        "-o", out], capfd)
    assert rc == 1 and "internal error" not in err and "register_forward" not in err, (so, err)
    assert err.startswith("normexport: export failed") and "not part of the active trace" in err, err
    assert not out.exists()


def test_capture_of_a_scripted_model_is_one_line(scripted, tmp_path):
    import normexport
    from normexport.errors import UsageError

    _, path = scripted
    with pytest.raises(UsageError, match="cannot record a TorchScript module's call") as e:
        normexport.capture(torch.jit.load(str(path)), tmp_path / "inputs.pt")
    assert "\n" not in str(e.value) and not (tmp_path / "inputs.pt").exists()


def test_float64_reference_of_a_large_scripted_model_says_why(scripted, monkeypatch):
    """Over the float64-copy limit the reference upcasts one module at a time with forward hooks,
    which a ScriptModule refuses: the reason says so (no hook registered, no internal error)."""
    from normexport.parity import reference

    _, path = scripted
    monkeypatch.setattr(reference, "FP64_COPY_LIMIT_BYTES", 0)
    ref = reference._Float64Reference(torch.jit.load(str(path)))
    out, reason = ref(torch.randn(2, 8, 16))
    assert out is None and "TorchScript and too large for a float64 copy" in reason, reason
