"""The pip-installed TensorRT for RTX and normexport's plugin: its ONNX parser dlopens the
unversioned `libtensorrt_rtx.so` for a plugin node, the wheel ships only `libtensorrt_rtx.so.1`,
and the failed lookup aborts the process (std::terminate). normexport.trt builds in a child whose
loader path starts with a private folder holding `libtensorrt_rtx.so -> <wheel>/libtensorrt_rtx.so.1`.

- the private link points at the wheel's library, and nothing is added to site-packages
- without that folder the child really aborts, and build() turns it into one BuildError line
  (the parent lives on); with it the same build has one plugin layer per normexport node
The second half needs the plugin library (TensorRT headers to build it), else it skips saying so.
"""

from __future__ import annotations

import os

import onnx
import pytest

import normexport
from normexport import trt
from normexport.trt import runtime

_ok, _why = trt.can_build()
if not _ok:
    pytest.skip(f"no TensorRT: {_why}", allow_module_level=True)
_T = runtime.load()
if _T.lib_dir is None or not (_T.lib_dir / "libtensorrt_rtx.so.1").exists():
    pytest.skip(f"{_T} is not the pip-installed TensorRT for RTX (nothing to work around)", allow_module_level=True)


def test_private_link_to_the_wheels_library():
    assert not (_T.lib_dir / "libtensorrt_rtx.so").exists(), "the wheel now ships the unversioned name"
    folder = runtime.loader_dir(_T)
    link = folder / "libtensorrt_rtx.so"
    assert link.is_symlink() and link.resolve() == (_T.lib_dir / "libtensorrt_rtx.so.1").resolve()
    assert not folder.is_relative_to(_T.lib_dir.parent)  # not in site-packages
    env = runtime.loader_env(_T)
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(folder)
    assert runtime.loader_dir(_T) == folder  # reused, not remade


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    block = __import__("normexport.models.llama", fromlist=["tiny"]).tiny()
    model = normexport.convert_module(block, block.example_inputs(), target="trt", input_names=block.input_names,
                                      dynamic_axes=block.dynamic_axes)
    path = tmp_path_factory.mktemp("lookup") / "llama.onnx"
    onnx.save(model, str(path))
    return path, model


def _spec(path, model, plugin):
    profiles, _ = trt.profiles.profiles_for(model, {})
    return trt.BuildSpec(str(path), str(path.with_suffix(".engine")), plugin=plugin, profiles=profiles)


def test_without_the_link_the_parser_aborts_and_build_says_so(plugin_lib, llama_file, monkeypatch):
    path, model = llama_file
    plain = dict(os.environ)
    plain.pop("LD_LIBRARY_PATH", None)
    plain["NORMEXPORT_TENSORRT"] = "rtx"
    monkeypatch.setattr(runtime, "loader_env", lambda t: plain)
    with pytest.raises(trt.BuildError) as err:
        trt.build(_spec(path, model, plugin_lib))
    message = str(err.value)
    assert "\n" not in message and "TensorRT ended the build process (signal 6)" in message, message
    assert "terminate called" in message
    assert not path.with_suffix(".engine").exists()


def test_with_the_link_every_node_is_a_plugin_layer(plugin_lib, llama_file):
    path, model = llama_file
    result = trt.build(_spec(path, model, plugin_lib))
    n = sum(node.domain == "normexport" for node in model.graph.node)
    assert n == 2 and len(result.plugin_layers) == n and result.engine_bytes > 0
