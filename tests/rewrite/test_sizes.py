"""normexport.sizes: the sizes `rewrite` (and `check`) verify at: --input, else sizes the model runs at."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from normexport import sizes
from normexport.errors import UsageError


def _model(nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _f(name, dims, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, dims)


def square_only():
    """x [N, C, H, W] + its H/W transpose: runs only when H == W (the first size set, 64x96, fails)."""
    return _model([helper.make_node("Transpose", ["x"], ["t"], perm=[0, 1, 3, 2]),
                   helper.make_node("Add", ["x", "t"], ["y"])],
                  [_f("x", ["N", 3, "H", "W"])], [_f("y", None)])


def sevens():
    """ids-like x [B, S] reshaped to [-1, 7]: B*S must be a multiple of 7, which no common size is."""
    shape = onnx.numpy_helper.from_array(np.array([-1, 7], np.int64), "shape")
    return _model([helper.make_node("Reshape", ["x", "shape"], ["y"])],
                  [_f("x", ["B", "S"])], [_f("y", None)], [shape])


def test_roles_and_shared_dims():
    """Batch 2, spatial axes of an image 64x96 (NCHW and NHWC), sequence 8 (16 where the input has
    a fixed 8), a dim name shared by two inputs gets one size, fixed dims are kept."""
    m = _model([helper.make_node("Identity", [n], [n + "_o"]) for n in ("img", "nhwc", "h", "ids", "mask")],
               [_f("img", ["N", 3, "H", "W"]), _f("nhwc", ["N", "a", "b", 3]), _f("h", ["B", "S", 8]),
                _f("ids", ["B", "S2"], TensorProto.INT64), _f("mask", ["B", "S2"], TensorProto.INT64)],
               [_f(n + "_o", None, TensorProto.INT64 if n in ("ids", "mask") else TensorProto.FLOAT)
                for n in ("img", "nhwc", "h", "ids", "mask")])
    shapes, how = sizes.discover(m)
    assert shapes == {"img": [2, 3, 64, 96], "nhwc": [2, 64, 96, 3], "h": [2, 16, 8], "ids": [2, 8], "mask": [2, 8]}
    assert how == "discovered: tried 1 size set(s)"
    feeds = sizes.feeds_for(m, shapes)
    assert feeds["ids"].dtype == np.int64 and feeds["img"].dtype == np.float32 and np.any(feeds["img"] != 0)
    # a size the user gives for a dim name holds in every input that uses the name
    shapes, how = sizes.discover(m, {"ids": [3, 5]})
    assert shapes["mask"] == [3, 5] and shapes["ids"] == [3, 5] and shapes["h"][0] == 3
    assert how == "--input, other dims discovered: tried 1 size set(s)"


def test_search_goes_on_until_the_model_runs_and_onnxruntime_stays_quiet(capfd):
    m = square_only()
    found = sizes.find(m)
    assert found.shapes == {"x": [1, 3, 64, 64]} and found.how == "discovered: tried 2 size set(s)"
    x = found.feeds["x"]
    np.testing.assert_allclose(found.outputs["y"], x + x.transpose(0, 1, 3, 2), rtol=0, atol=0)
    out, err = capfd.readouterr()  # file-descriptor level: onnxruntime's C++ logger writes there
    assert "onnxruntime" not in err.lower() and "error" not in err.lower(), err
    assert sizes.discover(m, {"x": [2, 3, 32, 32]}) == ({"x": [2, 3, 32, 32]}, "--input")


def test_no_size_runs():
    with pytest.raises(sizes.SizesError) as e:
        sizes.discover(sevens())
    msg = str(e.value)
    assert "none of" in msg and "size sets tried" in msg and "--input" in msg and "\n" not in msg
    assert "onnxruntime_src" not in msg and "[ONNXRuntimeError]" not in msg  # the cause, not ort's source location
    assert sizes.discover(sevens(), {"x": [2, 7]}) == ({"x": [2, 7]}, "--input")


def test_static_model():
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [_f("x", [2, 5])], [_f("y", None)])
    assert sizes.discover(m) == ({"x": [2, 5]}, "static dims")


@pytest.mark.parametrize("texts, words", [
    (["y:1x3x64x64"], ["no input 'y'", "its inputs: x"]),
    (["x:1x64x64"], ["rank 4", "give 4 sizes"]),
    (["x:1x4x64x64"], ["axis 1 is fixed to 3", "give 3 there"]),
    (["x:1x3x64x64:int64"], ["is float32", "drop ':int64'"]),
    (["x:1x3x64x64", "x:1x3x32x32"], ["given twice"]),
    (["x:1x3x64x96"], ["does not run at the --input sizes", "x: 1x3x64x96", "give sizes it takes"]),
])
def test_bad_input(texts, words):
    m = square_only()
    with pytest.raises(UsageError) as e:
        given = sizes.parse_inputs(m, texts)
        sizes.find(m, given)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_ort_error_is_one_clean_line():
    class E(Exception):
        pass

    raw = ("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Add node. Name:'/Add_2' "
           "Status Message: /onnxruntime_src/onnxruntime/core/providers/cpu/math/element_wise_ops.h:563 void "
           "onnxruntime::BroadcastIterator::Init(ptrdiff_t, ptrdiff_t) axis == 1 || axis == largest was false. "
           "Attempting to broadcast an axis by a dimension other than 1. 2 by 8\n")
    assert sizes.ort_error(E(raw)) == ("Non-zero status code returned while running Add node. Name:'/Add_2' "
                                       "Status Message: Attempting to broadcast an axis by a dimension other than 1. 2 by 8")
