"""Where the plugin tests look for TensorRT's headers (tests/_plugin_build.find_tensorrt_root): the
places a user has them. Folders are laid out in a temporary directory as the tarballs and a clone
unpack (only the path of include/NvInferRuntime.h is looked at; nothing is built from these)."""

from __future__ import annotations

import os

import pytest

try:
    from tests._plugin_build import SHARED_TENSORRT, find_tensorrt_root, tensorrt_root_candidates
except ImportError:
    from _plugin_build import SHARED_TENSORRT, find_tensorrt_root, tensorrt_root_candidates

SYSTEM = ["/usr", "/usr/local/tensorrt", "/opt/tensorrt"]


def _headers(root):
    inc = root / "include"
    inc.mkdir(parents=True)
    (inc / "NvInferRuntime.h").write_text("// path only\n")
    return str(root)


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("TensorRT_ROOT", raising=False)
    if any(os.path.isfile(os.path.join(d, sub, "NvInferRuntime.h")) for d in SYSTEM
           for sub in ("include", "include/x86_64-linux-gnu", "include/aarch64-linux-gnu")):
        pytest.skip("this machine has TensorRT headers in a system folder, which come first")


@pytest.mark.parametrize("name", ["TensorRT-10.13.3.9", "TensorRT-11.0.0.4", "TensorRT-11.0.0.4.Linux.x86_64-gnu.cuda-13.0",
                                  "TensorRT", "third_party/TensorRT"])
def test_tarballs_and_clones_are_found(no_env, tmp_path, name):
    root = _headers(tmp_path / name)
    assert find_tensorrt_root([str(tmp_path)]) == root


def test_newest_tarball_first_and_headers_required(no_env, tmp_path):
    _headers(tmp_path / "TensorRT-10.9.0.34")
    newest = _headers(tmp_path / "TensorRT-11.0.0.4")
    (tmp_path / "TensorRT-12.0.0.1").mkdir()  # no headers: passed over
    assert find_tensorrt_root([str(tmp_path)], shared=None) == newest
    assert tensorrt_root_candidates([str(tmp_path)], shared=None)[len(SYSTEM):] == [
        str(tmp_path / n) for n in ("TensorRT-12.0.0.1", "TensorRT-11.0.0.4", "TensorRT-10.9.0.34")]


def test_nothing_there(no_env, tmp_path):
    (tmp_path / "TensorRT").mkdir()
    assert find_tensorrt_root([str(tmp_path)], shared=None) is None
    assert find_tensorrt_root([str(tmp_path)], shared=tmp_path / "no-shared-copy") is None


def test_environment_variable_comes_first(monkeypatch, tmp_path):
    _headers(tmp_path / "TensorRT-11.0.0.4")
    mine = _headers(tmp_path / "elsewhere")
    monkeypatch.setenv("TensorRT_ROOT", mine)
    assert tensorrt_root_candidates([str(tmp_path)])[0] == mine
    assert find_tensorrt_root([str(tmp_path)]) == mine


def test_shared_headers_come_last(no_env, tmp_path):
    """NVIDIA's headers at ../shared/third_party/tensorrt are the fallback: after a user's own
    TensorRT (a tarball here), used when nothing else is there."""
    shared = _headers(tmp_path / "shared" / "third_party" / "tensorrt")
    assert tensorrt_root_candidates([str(tmp_path / "users")], shared=tmp_path / "shared" / "third_party" / "tensorrt")[-1] == shared
    assert find_tensorrt_root([str(tmp_path / "users")], shared=tmp_path / "shared" / "third_party" / "tensorrt") == shared
    own = _headers(tmp_path / "users" / "TensorRT-10.13.3.9")
    assert find_tensorrt_root([str(tmp_path / "users")], shared=tmp_path / "shared" / "third_party" / "tensorrt") == own


@pytest.mark.skipif(not SHARED_TENSORRT.is_dir(), reason="no ../shared/third_party/tensorrt beside this checkout")
def test_this_checkout_finds_headers():
    """Beside this checkout (every developer machine and CI) the plugin tests always have headers:
    the shared copy of NVIDIA's, unless a real TensorRT comes first."""
    root = find_tensorrt_root()
    assert root is not None
    assert os.path.isfile(os.path.join(root, "include", "NvInferRuntime.h")) or root != str(SHARED_TENSORRT)
