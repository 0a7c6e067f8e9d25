"""The fused residual ops in TensorRT (TensorRT for RTX builds on the CPU): their function bodies
parse and build without the plugin (docs/design.md §2's parser constraints), and with
libnormexport_plugins.so every SkipRMSNorm / GatedAdaLNZero node becomes one plugin layer (both
outputs), in float32, float16 and bfloat16. The plugin library is the `plugin_lib` fixture's
(tests/conftest.py): skipped with the reason where nvcc or TensorRT headers are missing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from normexport import ops, trt

_ok, _why = trt.can_build()
if not _ok:
    pytest.skip(f"no TensorRT: {_why}", allow_module_level=True)

_ELEM = {"fp32": (TensorProto.FLOAT, np.float32), "fp16": (TensorProto.FLOAT16, np.float16),
         "bf16": (TensorProto.BFLOAT16, None)}


def _tensor(name, shape, dtype, rng):
    elem, np_dtype = _ELEM[dtype]
    v = rng.standard_normal(shape).astype(np.float32)
    raw = v.astype(np_dtype).tobytes() if np_dtype else (v.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return helper.make_tensor(name, elem, list(shape), raw, raw=True)


def _chain(dtype: str, affine: bool, bias: bool) -> onnx.ModelProto:
    """y1, h1 = SkipRMSNorm(x, r, w[, b]); y2, h2 = GatedAdaLNZero(h1, y1, gate, shift, scale[, w2, b2]);
    outputs y2 and h2: two normexport nodes, each with two outputs."""
    elem, _ = _ELEM[dtype]
    rng = np.random.default_rng(0)
    H = 64
    inits = [_tensor("w", (H,), dtype, rng)] + ([_tensor("b", (H,), dtype, rng)] if bias else [])
    inits += [_tensor(n, (2, H), dtype, rng) for n in ("gate", "shift", "scale")]
    gated_in = ["h1", "y1", "gate", "shift", "scale"]
    if affine:
        inits += [_tensor("w2", (H,), dtype, rng), _tensor("b2", (H,), dtype, rng)]
        gated_in += ["w2", "b2"]
    nodes = [helper.make_node("SkipRMSNorm", ["x", "r", "w"] + (["b"] if bias else []), ["y1", "h1"], domain=ops.DOMAIN,
                              epsilon=1e-5),
             helper.make_node("GatedAdaLNZero", gated_in, ["y2", "h2"], domain=ops.DOMAIN, epsilon=1e-6)]
    dims = [2, "s", H]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, elem, dims) for n in ("x", "r")],
                              [helper.make_tensor_value_info(n, elem, dims) for n in ("y2", "h2")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22), helper.make_opsetid(ops.DOMAIN, 1)])
    ops.attach_functions(model)
    onnx.checker.check_model(model, full_check=True)
    return model


def _build(model: onnx.ModelProto, tmp_path: Path, plugin: str | None) -> trt.BuildResult:
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    shapes, _ = trt.profiles.profiles_for(model, {})
    return trt.build(trt.BuildSpec(str(path), str(tmp_path / "m.engine"), plugin=plugin, profiles=shapes))


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_bodies_build_without_plugin(dtype, tmp_path):
    result = _build(_chain(dtype, affine=True, bias=True), tmp_path, None)
    assert result.engine_bytes > 0 and result.normexport_nodes == 2 and not result.plugin_layers


@pytest.mark.parametrize("dtype, affine, bias", [("fp32", True, True), ("fp16", False, False), ("bf16", True, False)])
def test_one_plugin_layer_per_node(plugin_lib, dtype, affine, bias, tmp_path):
    result = _build(_chain(dtype, affine, bias), tmp_path, plugin_lib)
    assert result.engine_bytes > 0
    assert result.normexport_nodes == 2 and len(result.plugin_layers) == 2, result.plugin_layers


def _seq_first(dtype: str, gated: bool, affine: bool) -> onnx.ModelProto:
    """A sequence-first x ["s", 3, H] (S dynamic) with [3, H] shift / scale (and gate) following x's
    dim 1: AdaLNZero(x, shift, scale[, w, b], modulation_axis=1), or GatedAdaLNZero(x, u, gate, ...)
    with both outputs; the function body that declares modulation_axis."""
    elem, _ = _ELEM[dtype]
    rng = np.random.default_rng(1)
    H, B = 64, 3
    inits = [_tensor(n, (B, H), dtype, rng) for n in (["gate"] if gated else []) + ["shift", "scale"]]
    ins = (["x", "u", "gate"] if gated else ["x"]) + ["shift", "scale"]
    if affine:
        inits += [_tensor("w", (H,), dtype, rng), _tensor("b", (H,), dtype, rng)]
        ins += ["w", "b"]
    outs = ["y", "h"] if gated else ["y"]
    node = helper.make_node("GatedAdaLNZero" if gated else "AdaLNZero", ins, outs, domain=ops.DOMAIN, epsilon=1e-6,
                            modulation_axis=1)
    dims = ["s", B, H]
    graph = helper.make_graph([node], "g",
                              [helper.make_tensor_value_info(n, elem, dims) for n in (["x", "u"] if gated else ["x"])],
                              [helper.make_tensor_value_info(n, elem, dims) for n in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22), helper.make_opsetid(ops.DOMAIN, 1)])
    ops.attach_functions(model)
    assert "modulation_axis" in {a.name for a in model.functions[0].attribute_proto}
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("dtype, gated, affine", [("fp32", False, True), ("fp16", True, False), ("bf16", True, True),
                                                  ("fp32", False, False)])
def test_modulation_axis_body_builds_without_plugin(dtype, gated, affine, tmp_path):
    """modulation_axis 1 (x [S, B, H], [B, H] over S): the body that reads the attribute (Constant of
    it, Min, Expand, Reshape) parses and builds in TensorRT for RTX."""
    result = _build(_seq_first(dtype, gated, affine), tmp_path, None)
    assert result.engine_bytes > 0 and result.normexport_nodes == 1 and not result.plugin_layers


@pytest.mark.parametrize("gated", [False, True])
def test_modulation_axis_one_plugin_layer(plugin_lib, gated, tmp_path):
    """With the plugin library: the node (its modulation_axis a plugin field) becomes one plugin layer."""
    result = _build(_seq_first("fp16", gated, True), tmp_path, plugin_lib)
    assert result.engine_bytes > 0
    assert result.normexport_nodes == 1 and len(result.plugin_layers) == 1, result.plugin_layers
