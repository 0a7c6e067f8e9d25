"""The public Python API names work as documented (functions, not shadowed by submodules)."""

import numpy as np
import onnxruntime as ort
import torch

import normexport
from normexport.models.llama import tiny


def test_public_api_end_to_end():
    block = tiny()
    x = block.example_inputs()
    prepared = normexport.prepare(block)
    assert prepared is not block
    model = normexport.convert_module(block, x, target="trt", input_names=["x"], dynamic_axes={"x": [0, 1]})
    again = normexport.rewrite(model, target="trt")  # already fused: nothing left to do
    assert [n.op_type for n in again.graph.node] == [n.op_type for n in model.graph.node]
    report = normexport.check(model, block, x, dynamic_axes={"x": [0, 1]})
    assert report.passed and callable(normexport.fold_batchnorm) and callable(normexport.load)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x2 = torch.randn(3, 5, 64)
    got = sess.run(None, {"x": x2.numpy()})[0]
    want = block(x2).detach().numpy()
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_float16_onnx_is_judged_in_float16():
    """normexport.convert_module at float16, then normexport.check / assert_parity with the fp32
    module: eager runs in the ONNX file's dtype (inferred, or dtype=...), a perturbed file fails."""
    import onnx
    import pytest

    from normexport.models.dit import tiny as dit_tiny
    from normexport.testing import assert_parity

    block = dit_tiny()
    x, c = block.example_inputs()
    half = dit_tiny().half()
    model = normexport.convert_module(half, tuple(t.half() for t in (x, c)), target="trt", input_names=["x", "c"],
                                      dynamic_axes={"x": [0, 1], "c": [0]})
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    report = normexport.check(model, block, (x, c), dynamic_axes={"x": [0, 1], "c": [0]})
    assert report.passed, report.table()
    assert report.dtype == "float16" and report.dtype_source == "ONNX input 'x'"
    assert all(r.dtype == "float16" and r.ref_err_fp64 > 1e-4 for r in report.rows)  # eager fp16's own error
    assert len({r.shape_index for r in report.rows}) == 3
    assert_parity(block, model, (x, c), dtype="float16")
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    init = max((t for t in bad.graph.initializer if t.data_type == onnx.TensorProto.FLOAT16),
               key=lambda t: int(np.prod(t.dims)))
    arr = onnx.numpy_helper.to_array(init)
    init.CopyFrom(onnx.numpy_helper.from_array((arr.astype(np.float64) * 1.01).astype(arr.dtype), init.name))
    with pytest.raises(AssertionError, match="ONNX parity failed"):
        assert_parity(block, bad, (x, c), dtype="float16")
