"""`normexport build --timing-cache FILE` (normexport.trt.BuildSpec.timing_cache): TensorRT's timing
cache is written after a build, read by the next, replaced whole (temp file + rename), and nothing
else is left beside it. Runs with any TensorRT (TensorRT for RTX builds without a GPU)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from normexport import trt

_ok, _why = trt.can_build()
if not _ok:
    pytest.skip(f"no TensorRT: {_why}", allow_module_level=True)


def _matmul_model(path):
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 32])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))


def test_timing_cache_written_then_read(tmp_path):
    model, cache = tmp_path / "m.onnx", tmp_path / "trt.cache"
    _matmul_model(model)
    spec = dict(profiles={"x": ((1, 64), (4, 64), (16, 64))}, timing_cache=str(cache))
    first = trt.build(trt.BuildSpec(str(model), str(tmp_path / "a.engine"), **spec))
    assert first.engine_bytes > 0 and cache.stat().st_size > 0
    written = cache.read_bytes()
    second = trt.build(trt.BuildSpec(str(model), str(tmp_path / "b.engine"), **spec))
    assert second.engine_bytes > 0 and cache.stat().st_size >= len(written)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.engine", "b.engine", "m.onnx", "trt.cache"]
