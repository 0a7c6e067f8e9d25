"""The public Python API names work as documented (functions, not shadowed by submodules)."""

import numpy as np
import onnxruntime as ort
import torch

import normexport
from models.llama import tiny


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
