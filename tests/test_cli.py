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
    # fused by the rewriter, with the residual Add before it (fc(x) + y): one SkipRMSNorm, no RMSNorm left
    assert [(n.domain, n.op_type) for n in model.graph.node if n.op_type.endswith("RMSNorm")] == [("normexport", "SkipRMSNorm")]
    x, y = _inputs(3, 7, seed=1)  # another batch and sequence length
    (got,) = _ort_run(tmp_path / "m.onnx", (x, y))
    assert _rel_err(got, block(x, y).detach()) < 1e-5
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["command"] == "convert" and report["passed"] is True
    assert out.splitlines()[0].endswith("(target trt, dynamo exporter): 0 normexport::RMSNorm, 1 normexport::SkipRMSNorm, "
                                        f"0 normexport::AdaLNZero, {len(model.graph.node)} nodes"), out


def test_convert_residual_fusion_off(cli, tmp_path, block):
    """--no-residual-fusion: the plain RMSNorm and the Add stay, convert says why (a note) and the
    report records the flag."""
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}
    torch.export.save(torch.export.export(block, _inputs(), dynamic_shapes=(dims, dims)), tmp_path / "m.pt2")
    code, out, err = cli("convert", tmp_path / "m.pt2", "--no-residual-fusion", "--report", tmp_path / "r.json")
    assert code == 0, err
    model = onnx.load(tmp_path / "m.onnx")
    assert [(n.domain, n.op_type) for n in model.graph.node if n.op_type.endswith("RMSNorm")] == [("normexport", "RMSNorm")]
    assert "  note: rewriter rules skip_rms_norm_trt, gated_adaln off (--no-residual-fusion)" in out.splitlines(), out
    assert "PASSED" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["residual_fusion"] is False
    assert report["fusion_off"] == {"skip_rms_norm_trt": "--no-residual-fusion", "gated_adaln": "--no-residual-fusion"}
    assert report["rewrite"]["residual_fusion"] is False


def test_rewrite_residual_fusion_off(cli, tmp_path, block):
    """rewrite takes the same flag: a plain-exported block keeps its Add beside one RMSNorm."""
    path = tmp_path / "plain.onnx"
    torch.onnx.export(block, _inputs(), str(path), dynamo=True, input_names=["x", "y"], optimize=True)
    code, out, err = cli("rewrite", path, "-o", tmp_path / "fused.onnx")
    assert code == 0, err
    fused = [n.op_type for n in onnx.load(tmp_path / "fused.onnx").graph.node if n.domain == "normexport"]
    assert fused == ["SkipRMSNorm"], (fused, out)
    code, out, err = cli("rewrite", path, "-o", tmp_path / "plain_norm.onnx", "--no-residual-fusion",
                         "--report", tmp_path / "r.json")
    assert code == 0, err
    kept = [n.op_type for n in onnx.load(tmp_path / "plain_norm.onnx").graph.node if n.domain == "normexport"]
    assert kept == ["RMSNorm"], (kept, out)
    assert "  module skip_rms_norm_trt: off (--no-residual-fusion)" in out.splitlines(), out
    assert json.loads((tmp_path / "r.json").read_text())["residual_fusion"] is False
    code, out, err = cli("rewrite", path, "-o", tmp_path / "x.onnx", "--no-fuse", "rmsnorm")
    assert code == 2 and "--no-fuse rmsnorm: no such rule module" in err and not (tmp_path / "x.onnx").exists()
    code, out, err = cli("rewrite", path, "-o", tmp_path / "x.onnx", "--no-fuse", "attention")
    assert code == 2 and "--no-fuse attention: rewrite makes no attention fusion" in err, err
    assert not (tmp_path / "x.onnx").exists()


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


# ---- bad input: exit 2, exactly one non-empty line on stderr, no traceback, no output file left ------
# In-process (main() as the console script calls it, stdout / stderr captured) for each bad input; the real
# console script in a subprocess only where the process is what is tested (run_process: argparse's usage
# errors, a missing / corrupt file, a success with nothing on stderr): a Python start costs seconds of CI
# (docs/design.md §16).
def run_process(*argv, cwd=None):
    """Run the installed `normexport` console script; returns (exit code, stdout, stderr)."""
    exe = Path(sys.executable).with_name("normexport")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "normexport"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    env.pop("NORMEXPORT_DEBUG", None)
    r = subprocess.run(cmd + [str(a) for a in argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    return r.returncode, r.stdout, r.stderr


def run_cli(*argv, cwd=None):
    """`normexport ARGV` in this process (normexport.cli.main, NORMEXPORT_DEBUG unset, in `cwd` when
    given); returns (exit code, stdout, stderr)."""
    import contextlib
    import io

    from normexport.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    debug = os.environ.pop("NORMEXPORT_DEBUG", None)
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in argv])
    finally:
        os.chdir(here)
        if debug is not None:
            os.environ["NORMEXPORT_DEBUG"] = debug
    return code, out.getvalue(), err.getvalue()


def _assert_usage_error(result, *words, out_dir=None):
    code, out, err = result
    assert code == 2, (out, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("normexport: error: ")
    for w in words:
        assert w.lower() in lines[0].lower(), lines[0]
    if out_dir is not None:
        assert not list(Path(out_dir).glob("*.onnx*")), list(Path(out_dir).iterdir())
        assert not list(Path(out_dir).glob(".normexport-*"))
    return lines[0]


def test_missing_file(tmp_path):
    _assert_usage_error(run_process("convert", tmp_path / "nope.pt2"), "not found", out_dir=tmp_path)


def test_corrupt_file(tmp_path):
    (tmp_path / "m.pt").write_bytes(b"\x00garbage" * 100)
    _assert_usage_error(run_process("convert", tmp_path / "m.pt", "--input", "x:2x3"), "cannot read", out_dir=tmp_path)
    (tmp_path / "m.pt2").write_bytes(b"PK\x03\x04 broken zip")
    _assert_usage_error(run_process("convert", tmp_path / "m.pt2"), ".pt2", out_dir=tmp_path)


def _rewrite_zip(src, dst, replace=None, add=None):
    """Copy zip `src` to `dst`, replacing members whose name ends with a key of `replace`."""
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            for suffix, fn in (replace or {}).items():
                if info.filename.endswith(suffix):
                    data = fn(data)
            zout.writestr(info, data)
        root = zin.namelist()[0].split("/")[0]
        for name, data in (add or {}).items():
            zout.writestr(f"{root}/{name}", data)


def _truncate_keeping_end_record(data: bytes) -> bytes:
    """Half a zip plus its end-of-central-directory record: zipfile.is_zipfile() is still True."""
    return data[: len(data) // 2] + data[data.rindex(b"PK\x05\x06"):]


@pytest.fixture
def pt2(tmp_path, block):
    path = tmp_path / "good" / "m.pt2"
    path.parent.mkdir()
    torch.export.save(torch.export.export(block, _inputs()), path)
    return path


@pytest.mark.parametrize("how", ["truncated", "bad-json", "bad-sample-inputs"])
def test_corrupt_pt2_is_one_line(tmp_path, pt2, how):
    """torch.export.load logs a whole traceback through torch's logger: stderr must stay one line."""
    bad = tmp_path / "m.pt2"
    if how == "truncated":
        bad.write_bytes(_truncate_keeping_end_record(pt2.read_bytes()))
    elif how == "bad-json":
        _rewrite_zip(pt2, bad, {"models/model.json": lambda d: b"{garbage"})
    else:
        _rewrite_zip(pt2, bad, {"data/sample_inputs/model.pt": lambda d: b"\x80\x02garbage"})
    _assert_usage_error(run_cli("convert", bad), "m.pt2", out_dir=tmp_path)


def test_truncated_torchscript(tmp_path, block):
    import zipfile

    torch.jit.script(block).save(str(tmp_path / "ok.pt"))
    (tmp_path / "m.pt").write_bytes(_truncate_keeping_end_record((tmp_path / "ok.pt").read_bytes()))
    (tmp_path / "ok.pt").unlink()
    assert zipfile.is_zipfile(tmp_path / "m.pt")
    _assert_usage_error(run_cli("convert", tmp_path / "m.pt", "--input", "x:2x5x24", "--input", "y:2x5x24"),
                        "corrupt or truncated", out_dir=tmp_path)


def test_unknown_extension(tmp_path):
    (tmp_path / "m.xyz").write_bytes(b"abc")
    _assert_usage_error(run_cli("convert", tmp_path / "m.xyz"), "unknown model extension", ".pt2", out_dir=tmp_path)


@pytest.mark.parametrize("spec", ["x", "x:2xa", "x:2x3:float99", "1x:2", "x:2x3:float32:extra"])
def test_malformed_input(tmp_path, block, spec):
    torch.jit.script(block).save(str(tmp_path / "m.pt"))
    _assert_usage_error(run_cli("convert", tmp_path / "m.pt", "--input", spec), "--input", out_dir=tmp_path)


def test_malformed_dynamic(tmp_path, block):
    torch.jit.script(block).save(str(tmp_path / "m.pt"))
    _assert_usage_error(run_cli("convert", tmp_path / "m.pt", "--input", "x:2x5x24", "--input", "y:2x5x24",
                                "--dynamic", "x:a"), "--dynamic", out_dir=tmp_path)


def test_wrong_number_of_inputs(tmp_path, block):
    torch.jit.script(block).save(str(tmp_path / "m.pt"))
    _assert_usage_error(run_cli("convert", tmp_path / "m.pt", "--input", "x:2x5x24"), "takes 2 input", out_dir=tmp_path)


def test_shape_the_model_rejects(tmp_path, block):
    torch.jit.script(block).save(str(tmp_path / "m.pt"))
    _assert_usage_error(run_cli("convert", tmp_path / "m.pt", "--input", "x:2x5x7", "--input", "y:2x5x7"),
                        "rejected inputs of shape 2x5x7", out_dir=tmp_path)


def test_torchscript_without_inputs_names_the_flag(tmp_path, block):
    torch.jit.script(block).save(str(tmp_path / "m.pt"))
    _assert_usage_error(run_cli("convert", tmp_path / "m.pt"), "--input", out_dir=tmp_path)


def test_untrusted_pickle_is_never_unpickled(tmp_path):
    marker = tmp_path / "payload_ran"
    torch.save(_cli_models.Evil(str(marker)), tmp_path / "evil.pt")
    assert not marker.exists()
    _assert_usage_error(run_cli("convert", tmp_path / "evil.pt", "--input", "x:2x3"), "--trust-pickle", out_dir=tmp_path)
    assert not marker.exists(), "the pickle's payload ran"
    # the same file does run its payload when unpickled: the marker is a real witness
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


def _evil_pt2(src, dst, where, marker):
    """A .pt2 whose sample inputs / a weight / a constant is a pickle that creates `marker`."""
    import io as _io
    import pickle

    buf = _io.BytesIO()
    if where == "sample_inputs":
        torch.save(((_cli_models.Evil(str(marker)),), {}), buf)
        _rewrite_zip(src, dst, {"data/sample_inputs/model.pt": lambda d: buf.getvalue()})
    elif where == "weight":  # a `use_pickle` weight: torch loads it with weights_only=False
        torch.save(_cli_models.Evil(str(marker)), buf)

        def config(data):
            cfg = json.loads(data)
            cfg["config"]["weight"]["use_pickle"] = True
            return json.dumps(cfg).encode()

        _rewrite_zip(src, dst, {"data/weights/model_weights_config.json": config,
                                "data/weights/weight_0": lambda d: buf.getvalue()})
    else:  # an opaque-object constant: torch loads it with pickle.loads
        cfg = {"config": {"c0": {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}}}
        _rewrite_zip(src, dst, {"data/constants/model_constants_config.json": lambda d: json.dumps(cfg).encode()},
                     add={"data/constants/opaque_obj_0": pickle.dumps(_cli_models.Evil(str(marker)))})


@pytest.mark.parametrize("where", ["sample_inputs", "weight", "constant"])
def test_untrusted_pt2_payload_never_runs(tmp_path, pt2, where):
    """torch.export.load itself unpickles with weights_only=False / pickle.loads: without
    --trust-pickle, normexport must refuse before any of it runs."""
    marker = tmp_path / "payload_ran"
    _evil_pt2(pt2, tmp_path / "evil.pt2", where, marker)
    line = _assert_usage_error(run_cli("convert", tmp_path / "evil.pt2"), "--trust-pickle", out_dir=tmp_path)
    assert not marker.exists(), "the .pt2's pickle payload ran without --trust-pickle"
    assert "evil.pt2" in line
    # witness: plain torch.export.load does run the payload
    try:
        torch.export.load(tmp_path / "evil.pt2")
    except Exception:
        pass
    assert marker.exists()


def test_state_dict_as_model(tmp_path, block):
    torch.save(block.state_dict(), tmp_path / "sd.pt")
    _assert_usage_error(run_cli("convert", tmp_path / "sd.pt"), "state dict", "--weights", out_dir=tmp_path)


@pytest.mark.parametrize("key", ["model", "state_dict"])
def test_checkpoint_dict_as_model(tmp_path, block, key):
    torch.save({key: block.state_dict(), "epoch": 3, "lr": 0.1}, tmp_path / "ckpt.pt")
    _assert_usage_error(run_cli("convert", tmp_path / "ckpt.pt"), f"state dict under '{key}'",
                        "module:callable --weights", out_dir=tmp_path)


def test_weights_that_do_not_fit(tmp_path):
    torch.save({"fc.weight": torch.randn(3, 3)}, tmp_path / "w.pt")
    _assert_usage_error(run_cli("convert", "_cli_models:rms_block", "--weights", tmp_path / "w.pt",
                                "--input", "x:2x5x24", "--input", "y:2x5x24", cwd=tmp_path), "does not fit", out_dir=tmp_path)


def test_weights_without_a_state_dict(tmp_path):
    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "w.pt")
    _assert_usage_error(run_cli("convert", "_cli_models:rms_block", "--weights", tmp_path / "w.pt",
                                "--input", "x:2x5x24", "--input", "y:2x5x24", cwd=tmp_path),
                        "no state dict", "'epoch'", out_dir=tmp_path)


def _unwritable_dir(tmp_path) -> Path:
    """A folder nobody may create files in: chmod 0o500 (root ignores modes: /proc instead)."""
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o500)
        return d
    if not Path("/proc/self").is_dir():
        pytest.skip("running as root without /proc: no folder root cannot write in")
    return Path("/proc")


def test_unwritable_output(tmp_path, block):
    torch.jit.script(block).save(str(tmp_path / "m.pt"))
    args = ("--input", "x:2x5x24", "--input", "y:2x5x24")
    _assert_usage_error(run_cli("convert", tmp_path / "m.pt", "-o", tmp_path / "no" / "such" / "m.onnx", *args),
                        f"output folder '{tmp_path / 'no' / 'such'}' does not exist", out_dir=tmp_path)
    (tmp_path / "file").write_text("x")
    _assert_usage_error(run_cli("convert", tmp_path / "m.pt", "-o", tmp_path / "file" / "m.onnx", *args),
                        f"'{tmp_path / 'file'}' is a file, not a folder", "-o", out_dir=tmp_path)
    _assert_usage_error(run_cli("convert", tmp_path / "m.pt", "-o", tmp_path / "file" / "sub" / "m.onnx", *args),
                        f"'{tmp_path / 'file'}' is a file, not a folder", out_dir=tmp_path)
    _assert_usage_error(run_cli("convert", tmp_path / "m.pt", "-o", tmp_path, *args), "is a directory", out_dir=tmp_path)


def test_permission_denied_output(tmp_path, block):
    torch.jit.script(block).save(str(tmp_path / "m.pt"))
    ro = _unwritable_dir(tmp_path)
    try:
        _assert_usage_error(run_cli("convert", tmp_path / "m.pt", "-o", ro / "m.onnx", "--input", "x:2x5x24",
                                    "--input", "y:2x5x24"), f"cannot write in '{ro}'", "-o", out_dir=tmp_path)
        assert not (ro / "m.onnx").exists()
    finally:
        if ro != Path("/proc"):
            ro.chmod(0o700)


def test_unwritable_report(tmp_path, block):
    torch.jit.script(block).save(str(tmp_path / "m.pt"))
    args = ("--input", "x:2x5x24", "--input", "y:2x5x24", "-o", tmp_path / "m.onnx")
    ro = _unwritable_dir(tmp_path)
    try:
        _assert_usage_error(run_cli("convert", tmp_path / "m.pt", "--report", ro / "r.json", *args),
                            f"cannot write in '{ro}'", "--report", out_dir=tmp_path)
    finally:
        if ro != Path("/proc"):
            ro.chmod(0o700)
    _assert_usage_error(run_cli("convert", tmp_path / "m.pt", "--report", tmp_path / "nodir" / "r.json", *args),
                        "does not exist", "--report", out_dir=tmp_path)


def test_unknown_factory(tmp_path):
    _assert_usage_error(run_cli("convert", "no_such_pkg.mod:make", cwd=tmp_path), "cannot import")
    _assert_usage_error(run_cli("convert", "_cli_models:nothing", cwd=tmp_path), "no callable")


@pytest.mark.parametrize("source, words", [
    ("def make(:\n    pass\n", ("syntax error at broken_factory.py:1",)),
    ("raise RuntimeError('no GPU here')\ndef make():\n    pass\n", ("RuntimeError", "no GPU here")),
])
def test_factory_module_that_fails_to_import(tmp_path, source, words):
    (tmp_path / "broken_factory.py").write_text(source)
    _assert_usage_error(run_cli("convert", "broken_factory:make", cwd=tmp_path), "broken_factory", *words, out_dir=tmp_path)


def test_example_inputs_that_are_not_tensors(tmp_path):
    _assert_usage_error(run_cli("convert", "_cli_models:scalar_example_inputs", cwd=tmp_path),
                        "example_inputs() returned a list of float, int", "--input", out_dir=tmp_path)


def test_bad_usage_is_one_line():
    _assert_usage_error(run_process("convert"), "--help")
    _assert_usage_error(run_process("frobnicate"), "--help")


# ---- success is quiet on stderr; internal errors stay distinguishable ----------------------------
def test_pt2_success_has_clean_stderr(tmp_path, pt2):
    code, out, err = run_process("convert", pt2, "-o", tmp_path / "m.onnx")
    assert code == 0, err
    assert err == "", err  # no copyreg FutureWarning, no torch logging
    assert (tmp_path / "m.onnx").exists()


def test_internal_error_is_one_line_exit_1(cli, tmp_path, monkeypatch):
    from normexport import load as loaders

    def broken(*a, **k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(loaders, "load", broken)
    code, out, err = cli("convert", tmp_path / "m.pt2", "-o", tmp_path / "m.onnx")
    assert code == 1
    assert err.strip().splitlines() == ["normexport: internal error: ZeroDivisionError: a bug "
                                        "(run with NORMEXPORT_DEBUG=1 for the traceback)"]
    monkeypatch.setenv("NORMEXPORT_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        cli("convert", tmp_path / "m.pt2", "-o", tmp_path / "m.onnx")


# ---- --weights checkpoint forms ------------------------------------------------------------------
@pytest.mark.parametrize("wrap", ["state_dict", "model"])
def test_weights_in_a_checkpoint_dict(cli, tmp_path, monkeypatch, wrap):
    monkeypatch.chdir(tmp_path)
    other = _cli_models.RMSNormBlock()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))
    torch.save({wrap: other.state_dict(), "epoch": 3, "optimizer": {"state": {}, "param_groups": []}}, tmp_path / "w.pt")
    code, out, err = cli("convert", "_cli_models:rms_block", "--weights", tmp_path / "w.pt",
                         "--input", "x:2x5x24", "--input", "y:2x5x24", "--no-check")
    assert code == 0, err
    x, y = _inputs(2, 5, seed=5)
    (got,) = _ort_run(tmp_path / "_cli_models_rms_block.onnx", (x, y))
    assert _rel_err(got, other.eval()(x, y).detach()) < 1e-5


# ---- models over 2 GiB: external data, checked by path --------------------------------------------
def _tiny_onnx():
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((24, 24)).astype(np.float32)  # 2304 bytes: above the 1 KiB threshold
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 24])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 24])],
        [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w


def test_save_onnx_external_data_branch(tmp_path, monkeypatch):
    from normexport import io as nio

    model, w = _tiny_onnx()
    monkeypatch.setattr(nio, "PROTOBUF_LIMIT", 1000)  # the tiny model now counts as "over 2 GiB"
    assert nio._too_large(model)
    path = nio.save_onnx(model, tmp_path / "big.onnx")
    data = tmp_path / "big.onnx.data"
    assert path.exists() and data.exists() and data.stat().st_size >= w.nbytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]  # no temp files left
    assert model.graph.initializer[0].raw_data  # the in-memory model keeps its weights
    loaded = onnx.load(str(path), load_external_data=False)
    assert loaded.graph.initializer[0].data_location == onnx.TensorProto.EXTERNAL
    onnx.checker.check_model(str(path), full_check=True)
    x = np.random.default_rng(1).standard_normal((2, 24)).astype(np.float32)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], x @ w, rtol=1e-5, atol=1e-5)


def test_check_onnx_large_model_goes_by_path(tmp_path, monkeypatch):
    from normexport import io as nio

    model, _ = _tiny_onnx()
    seen = []
    real = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, **kw: (seen.append(type(m)), real(m, **kw))[1])
    nio.check_onnx(model, workdir=tmp_path)
    monkeypatch.setattr(nio, "PROTOBUF_LIMIT", 1000)
    nio.check_onnx(model, workdir=tmp_path)
    assert seen == [onnx.ModelProto, str]
    assert model.graph.initializer[0].raw_data and not list(tmp_path.iterdir())


def test_convert_large_model_writes_external_data(cli, tmp_path, monkeypatch):
    """A model over the limits (docs/design.md §8) stays an onnx-ir model: it is streamed to disk with
    external data, checked there by path, the whole-model parity left to `normexport check` with a
    line that says so; every fusion verified locally."""
    from normexport.convert import record as nconvert
    from normexport import io as nio

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(nio, "EXTERNAL_BYTES", 1000)
    monkeypatch.setattr(nconvert, "PARITY_LIMIT", 1000)
    torch.manual_seed(0)  # rms_block's Linear layers draw from the global RNG
    code, out, err = cli("convert", "_cli_models:rms_block", "--input", "x:2x5x24", "--input", "y:2x5x24",
                         "-o", tmp_path / "m.onnx")
    assert code == 0, err
    assert (tmp_path / "m.onnx.data").exists()
    assert "parity: not run here" in out and "normexport check m.onnx --reference" in out, out
    x, y = _inputs(2, 5, seed=6)
    (got,) = _ort_run(tmp_path / "m.onnx", (x, y))
    torch.manual_seed(0)
    assert _rel_err(got, _cli_models.rms_block()(x, y).detach()) < 1e-5
    assert not list(tmp_path.glob(".normexport-*"))


def test_bfloat16_conv_model_exports_at_opset_22(tmp_path):
    """ONNX Conv takes bfloat16 from opset 22: --dtype bfloat16 exports there by default, and an
    explicit older --opset is a usage error naming the fix. (onnxruntime's CPU provider cannot run
    the bf16 Conv, so the parity check is skipped with --no-check here.)"""
    import onnx

    out = tmp_path / "cbf.onnx"
    code, stdout, err = run_cli("convert", "normexport.models.conv_bn:tiny", "--dtype", "bfloat16", "--no-check", "-o", out)
    assert code == 0, err
    model = onnx.load(out)
    assert next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == 22
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    assert not any(n.op_type == "BatchNormalization" for n in model.graph.node)
    onnx.checker.check_model(model, full_check=True)
    out.unlink()
    _assert_usage_error(run_cli("convert", "normexport.models.conv_bn:tiny", "--dtype", "bfloat16", "--no-check", "--opset", "20",
                                "-o", out), "--opset 22", out_dir=tmp_path)


def test_sigterm_removes_the_temp_folder(tmp_path):
    """A convert stopped by SIGTERM (a scheduler's kill, `timeout`) unwinds as Ctrl-C does: exit 143,
    one line, no traceback, the temp folder the output is written in (GiBs at real sizes) removed, no
    output. The signal is sent while the file is being written (onnx_ir.save wrapped to send it to the
    process first), the moment a temp folder exists beside the output."""
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    script = (
        "import os, signal, sys\n"
        "import onnx_ir\n"
        "real = onnx_ir.save\n"
        "def save(*a, **k):\n"
        "    assert any(p.name.startswith('.normexport-') for p in a[1].parent.parent.iterdir())\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(*a, **k)\n"
        "onnx_ir.save = save\n"
        "from normexport.cli import run\n"
        "sys.argv = ['normexport'] + sys.argv[1:]\n"
        "run()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    env.pop("NORMEXPORT_DEBUG", None)
    r = subprocess.run([sys.executable, "-c", script, "convert", "_cli_models:rms_block", "--input", "x:2x5x24",
                        "--input", "y:2x5x24", "-o", str(out)], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 143, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "normexport: terminated (SIGTERM)", r.stderr
    assert "Traceback" not in r.stderr
    assert list(out.parent.iterdir()) == [], list(out.parent.iterdir())
