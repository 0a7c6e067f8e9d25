"""External data that leaves the model's folder (issue 22, security): an ONNX file may name any
location for its weights; `rewrite` used to follow `../x`, an absolute path or a symlink pointing
out and copy those bytes into its output (a hostile file exfiltrates any file the user can read).
Every command that reads ONNX (rewrite, check, build) refuses them, however the model path is spelled
(a bare name in the current folder included): exit 2, one stderr line, no output written. A
truncated data file is bad input, said so (not "cannot write"). Outputs get the umask's mode."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

from normexport import cli

SECRET = np.arange(64, dtype=np.float32) + 1000.0  # a file outside the model's folder


def _model(folder: Path, name: str, location: str, length: int | None = 256) -> Path:
    w = numpy_helper.from_array(np.zeros(64, np.float32), "w")
    set_external_data(w, location=location, offset=0, length=length)
    if length is None:  # no length field: the tensor's dims and type say what it needs
        for i, e in enumerate(w.external_data):
            if e.key == "length":
                del w.external_data[i]
                break
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(folder / name))
    return folder / name


@pytest.fixture()
def tree(tmp_path):
    """tmp/secret.bin outside; tmp/model/ holds the hostile files, a good one and a truncated one."""
    folder = tmp_path / "model"
    folder.mkdir()
    SECRET.tofile(tmp_path / "secret.bin")
    os.symlink(tmp_path / "secret.bin", folder / "link.bin")
    np.arange(10, dtype=np.float32).tofile(folder / "short.bin")
    np.arange(64, dtype=np.float32).tofile(folder / "ok.bin")
    files = {
        "dotdot": _model(folder, "dotdot.onnx", "../secret.bin"),
        "absolute": _model(folder, "abs.onnx", str(tmp_path / "secret.bin")),
        "symlink": _model(folder, "symlink.onnx", "link.bin"),
        "truncated": _model(folder, "trunc.onnx", "short.bin"),
        "ok": _model(folder, "ok.onnx", "ok.bin"),
    }
    return tmp_path, folder, files


def _run(argv, capfd):
    rc = cli.main([str(a) for a in argv])
    out, err = capfd.readouterr()
    return rc, out, err


HOSTILE = ["dotdot", "absolute", "symlink"]


@pytest.mark.parametrize("kind", HOSTILE)
@pytest.mark.parametrize("spelling", ["bare", "relative", "absolute"])
def test_rewrite_refuses_data_outside_the_folder(tree, kind, spelling, capfd, monkeypatch):
    tmp, folder, files = tree
    path = files[kind]
    if spelling == "bare":  # run in the model's own folder: the case the loader did not catch
        monkeypatch.chdir(folder)
        arg = path.name
    elif spelling == "relative":
        monkeypatch.chdir(tmp)
        arg = os.path.join("model", path.name)
    else:
        arg = str(path)
    out_dir = tmp / "elsewhere"
    out_dir.mkdir()
    rc, out, err = _run(["rewrite", arg, "-o", out_dir / "out.onnx", "--report", out_dir / "r.json"], capfd)
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "outside the model's folder" in lines[0] and "Traceback" not in err, err
    assert list(out_dir.iterdir()) == []  # nothing written: no file, no .data with the secret's bytes


@pytest.mark.parametrize("kind", HOSTILE + ["truncated"])
def test_build_and_check_refuse_too(tree, kind, capfd, monkeypatch):
    tmp, folder, files = tree
    monkeypatch.chdir(folder)
    name = files[kind].name
    rc, out, err = _run(["build", name, "-o", tmp / "e.engine"], capfd)
    assert rc == 2 and len(err.strip().splitlines()) == 1, (out, err)
    assert not (tmp / "e.engine").exists()
    rc, out, err = _run(["check", name, "--reference", "torch.nn:Identity", "--json", tmp / "c.json"], capfd)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (out, err)
    assert ("outside the model's folder" if kind != "truncated" else "shorter than its tensors need") in err
    assert not (tmp / "c.json").exists()


def test_truncated_data_is_bad_input(tree, capfd, monkeypatch):
    tmp, folder, files = tree
    monkeypatch.chdir(folder)
    rc, out, err = _run(["rewrite", "trunc.onnx", "-o", tmp / "out.onnx"], capfd)
    assert rc == 2, (out, err)
    line, = err.strip().splitlines()
    assert "short.bin" in line and "shorter than its tensors need" in line and "cannot write" not in line, line
    assert not (tmp / "out.onnx").exists()


def test_data_inside_the_folder_is_read(tree, capfd, monkeypatch):
    """The control: the same layout with its data beside it (bare name too) rewrites, and the
    output carries the data file's values (not the secret's)."""
    tmp, folder, files = tree
    monkeypatch.chdir(folder)
    rc, out, err = _run(["rewrite", "ok.onnx", "-o", tmp / "out.onnx"], capfd)
    assert rc == 0, (out, err)
    got = onnx.load(str(tmp / "out.onnx"))
    w = numpy_helper.to_array(got.graph.initializer[0])
    assert np.array_equal(w, np.arange(64, dtype=np.float32))


def test_a_symlink_that_stays_inside_is_read(tree, capfd, monkeypatch):
    tmp, folder, files = tree
    os.symlink(folder / "ok.bin", folder / "inner.bin")
    _model(folder, "inner.onnx", "inner.bin")
    rc, out, err = _run(["rewrite", folder / "inner.onnx", "-o", tmp / "out.onnx"], capfd)
    assert rc == 0, (out, err)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_outputs_honour_the_umask(tree, mask, capfd, monkeypatch):
    """rewrite -o (and its .data), --report, check --json: mode 0666 & ~umask (0644 under 022)."""
    tmp, folder, files = tree
    old = os.umask(mask)
    try:
        rc, out, err = _run(["rewrite", files["ok"], "-o", tmp / "out.onnx", "--report", tmp / "r.json"], capfd)
        assert rc == 0, err
        # check --json (the file differs from the Identity reference: FAILED, rc 1, the report written all the same)
        rc, out, err = _run(["check", files["ok"], "--reference", "torch.nn:Identity", "--json", tmp / "c.json"], capfd)
        assert rc == 1 and "wrote" in out, (out, err)
    finally:
        os.umask(old)
    want = 0o666 & ~mask
    for f in ("out.onnx", "out.onnx.data", "r.json", "c.json"):
        assert stat.S_IMODE((tmp / f).stat().st_mode) == want, (f, oct((tmp / f).stat().st_mode))


def test_hugging_face_cache_layout_is_one_line_with_the_fix(tmp_path, capfd):
    """snapshots/<rev>/model.onnx and model.onnx.data link into ../../blobs (how hf_hub_download
    stores files): the data leaves the folder as a link, like the hostile case (onnx.load and
    onnx_ir refuse it too): one line naming the fix, not an internal error; after `cp -L` it reads."""
    import shutil

    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    np.arange(64, dtype=np.float32).tofile(blobs / "sha2")
    _model(blobs, "sha1", "model.onnx.data")
    os.symlink("../../blobs/sha1", snap / "model.onnx")
    os.symlink("../../blobs/sha2", snap / "model.onnx.data")
    rc, out, err = _run(["rewrite", snap / "model.onnx", "-o", tmp_path / "out.onnx"], capfd)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "cp -L" in err, (out, err)
    shutil.copytree(snap, tmp_path / "copy", symlinks=False)  # what cp -L does
    rc, out, err = _run(["rewrite", tmp_path / "copy" / "model.onnx", "-o", tmp_path / "out.onnx"], capfd)
    assert rc == 0, (out, err)


def test_truncated_data_without_a_length_field(tree, capfd):
    """No length entry: 64 floats need 256 bytes, the file has 40."""
    tmp, folder, files = tree
    path = _model(folder, "nolen.onnx", "short.bin", length=None)
    assert not any(e.key == "length" for e in onnx.load(str(path), load_external_data=False).graph.initializer[0].external_data)
    rc, out, err = _run(["rewrite", path, "-o", tmp / "out.onnx"], capfd)
    assert rc == 2 and "shorter than its tensors need" in err and "needs 256" in err, (out, err)
