"""`normexport convert`: every MODEL form, dynamic axes, weights, and every bad input (issue 2)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _cli_models  # noqa: E402


def _ort_run(path, feeds):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {n: v.numpy() for n, v in zip(names, feeds)})


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.fixture
def block():
    return _cli_models.rms_block()


def _inputs(b=2, s=5, h=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, h, generator=g), torch.randn(b, s, h, generator=g)


# ---- good paths --------------------------------------------------------------------------------
def test_convert_pt2_uses_its_example_inputs(cli, tmp_path, block):
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}
    ep = torch.export.export(block, _inputs(), dynamic_shapes=(dims, dims))
    torch.export.save(ep, tmp_path / "m.pt2")
    code, out, err = cli("convert", tmp_path / "m.pt2", "--report", tmp_path / "r.json")
    assert code == 0, err
    model = onnx.load(tmp_path / "m.onnx")
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node].count("RMSNorm") == 1  # fused by the rewriter
    x, y = _inputs(3, 7, seed=1)  # another batch and sequence length
    (got,) = _ort_run(tmp_path / "m.onnx", (x, y))
    assert _rel_err(got, block(x, y).detach()) < 1e-5
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["command"] == "convert" and report["passed"] is True


def test_convert_torchscript_with_dynamic_axes(cli, tmp_path, block):
    torch.jit.script(block).save(str(tmp_path / "m.pt"))
    code, out, err = cli("convert", tmp_path / "m.pt", "--input", "x:2x5x24", "--input", "y:2x5x24",
                         "--dynamic", "x:0,1", "--dynamic", "y:0,1")
    assert code == 0, err
    x, y = _inputs(4, 9, seed=2)
    (got,) = _ort_run(tmp_path / "m.onnx", (x, y))
    assert got.shape == (4, 9, 24)
    assert _rel_err(got, block(x, y).detach()) < 1e-5


def test_convert_factory_with_weights(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    other = _cli_models.RMSNormBlock()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))
    torch.save(other.state_dict(), tmp_path / "w.pt")
    code, out, err = cli("convert", "_cli_models:rms_block", "--weights", tmp_path / "w.pt",
                         "--input", "x:2x5x24", "--input", "y:2x5x24", "--dynamic", "x:0", "--dynamic", "y:0")
    assert code == 0, err
    path = tmp_path / "_cli_models_rms_block.onnx"
    x, y = _inputs(3, 5, seed=4)
    (got,) = _ort_run(path, (x, y))
    assert _rel_err(got, other.eval()(x, y).detach()) < 1e-5  # the loaded weights, not the factory's
    assert _rel_err(got, _cli_models.rms_block()(x, y).detach()) > 1e-2


def test_trusted_pickle_loads(cli, tmp_path, block):
    torch.save(block, tmp_path / "m.pth")
    code, out, err = cli("convert", tmp_path / "m.pth", "--trust-pickle", "--input", "x:2x5x24", "--input", "y:2x5x24")
    assert code == 0, err
    assert (tmp_path / "m.onnx").exists()


# ---- bad input: exit 2, one line, no traceback, no output file ---------------------------------
def _assert_usage_error(result, *words, out_dir=None):
    code, out, err = result
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("normexport: error: ")
    assert "Traceback" not in err
    for w in words:
        assert w.lower() in lines[0].lower(), lines[0]
    if out_dir is not None:
        assert not list(Path(out_dir).glob("*.onnx*")), list(Path(out_dir).iterdir())
        assert not list(Path(out_dir).glob(".normexport-*"))


def test_missing_file(cli, tmp_path):
    _assert_usage_error(cli("convert", tmp_path / "nope.pt2"), "not found", out_dir=tmp_path)


def test_corrupt_file(cli, tmp_path):
    (tmp_path / "m.pt").write_bytes(b"\x00garbage" * 100)
    _assert_usage_error(cli("convert", tmp_path / "m.pt", "--input", "x:2x3"), "cannot read", out_dir=tmp_path)
    (tmp_path / "m.pt2").write_bytes(b"PK\x03\x04 broken zip")
    _assert_usage_error(cli("convert", tmp_path / "m.pt2"), ".pt2", out_dir=tmp_path)


def test_unknown_extension(cli, tmp_path):
    (tmp_path / "m.xyz").write_bytes(b"abc")
    _assert_usage_error(cli("convert", tmp_path / "m.xyz"), "unknown model extension", ".pt2", out_dir=tmp_path)


@pytest.mark.parametrize("spec", ["x", "x:2xa", "x:2x3:float99", "1x:2", "x:2x3:float32:extra"])
def test_malformed_input(cli, tmp_path, block, spec):
    torch.jit.script(block).save(str(tmp_path / "m.pt"))
    _assert_usage_error(cli("convert", tmp_path / "m.pt", "--input", spec), "--input", out_dir=tmp_path)


def test_malformed_dynamic(cli, tmp_path, block):
    torch.jit.script(block).save(str(tmp_path / "m.pt"))
    _assert_usage_error(cli("convert", tmp_path / "m.pt", "--input", "x:2x5x24", "--input", "y:2x5x24",
                            "--dynamic", "x:a"), "--dynamic", out_dir=tmp_path)


def test_wrong_number_of_inputs(cli, tmp_path, block):
    torch.jit.script(block).save(str(tmp_path / "m.pt"))
    _assert_usage_error(cli("convert", tmp_path / "m.pt", "--input", "x:2x5x24"), "takes 2 input", out_dir=tmp_path)


def test_shape_the_model_rejects(cli, tmp_path, block):
    torch.jit.script(block).save(str(tmp_path / "m.pt"))
    _assert_usage_error(cli("convert", tmp_path / "m.pt", "--input", "x:2x5x7", "--input", "y:2x5x7"),
                        "rejected inputs of shape 2x5x7", out_dir=tmp_path)


def test_torchscript_without_inputs_names_the_flag(cli, tmp_path, block):
    torch.jit.script(block).save(str(tmp_path / "m.pt"))
    _assert_usage_error(cli("convert", tmp_path / "m.pt"), "--input", out_dir=tmp_path)


def test_untrusted_pickle_is_never_unpickled(cli, tmp_path):
    marker = tmp_path / "payload_ran"
    torch.save(_cli_models.Evil(str(marker)), tmp_path / "evil.pt")
    assert not marker.exists()
    _assert_usage_error(cli("convert", tmp_path / "evil.pt", "--input", "x:2x3"), "--trust-pickle", out_dir=tmp_path)
    assert not marker.exists(), "the pickle's payload ran"
    # the same file does run its payload when unpickled: the marker is a real witness
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


def test_state_dict_as_model(cli, tmp_path, block):
    torch.save(block.state_dict(), tmp_path / "sd.pt")
    _assert_usage_error(cli("convert", tmp_path / "sd.pt"), "state dict", "--weights", out_dir=tmp_path)


def test_weights_that_do_not_fit(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"fc.weight": torch.randn(3, 3)}, tmp_path / "w.pt")
    _assert_usage_error(cli("convert", "_cli_models:rms_block", "--weights", tmp_path / "w.pt",
                            "--input", "x:2x5x24", "--input", "y:2x5x24"), "does not fit", out_dir=tmp_path)


def test_unwritable_output(cli, tmp_path, block):
    torch.jit.script(block).save(str(tmp_path / "m.pt"))
    args = ("--input", "x:2x5x24", "--input", "y:2x5x24")
    _assert_usage_error(cli("convert", tmp_path / "m.pt", "-o", tmp_path / "no" / "such" / "m.onnx", *args), "does not exist",
                        out_dir=tmp_path)
    (tmp_path / "file").write_text("x")
    _assert_usage_error(cli("convert", tmp_path / "m.pt", "-o", tmp_path / "file" / "m.onnx", *args), "file", out_dir=tmp_path)
    _assert_usage_error(cli("convert", tmp_path / "m.pt", "-o", tmp_path, *args), "directory", out_dir=tmp_path)


def test_unknown_factory(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _assert_usage_error(cli("convert", "no_such_pkg.mod:make"), "cannot import")
    _assert_usage_error(cli("convert", "_cli_models:nothing"), "no callable")


def test_bad_usage_is_one_line(cli):
    _assert_usage_error(cli("convert"), "--help")
    _assert_usage_error(cli("frobnicate"), "--help")


def test_console_script_exit_code_and_no_traceback(tmp_path):
    """The installed `normexport` entry point itself: exit 2 and one line."""
    exe = Path(sys.executable).with_name("normexport")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "normexport"]
    r = subprocess.run(cmd + ["convert", str(tmp_path / "missing.pt2")], capture_output=True, text=True,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
