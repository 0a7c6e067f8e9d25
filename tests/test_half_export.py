"""End to end in float16: the reference DiT and LLaMA blocks cast to fp16, exported for target trt
(normexport ops with fp32 statistics inside), run by onnxruntime through the function bodies, and
judged by normexport.check against the float64 reference: within the fp16 tolerance (docs/design.md §7)
and no worse than 2x eager PyTorch's own fp16 error. bfloat16 cannot be run here: onnxruntime's
CPU provider has no bfloat16 MatMul (convert says so and writes nothing without --no-check)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import normexport
from normexport import ops
from normexport.export import op_counts

from _norm_counts import fold


@pytest.mark.parametrize("name,op,n", [("dit", "AdaLNZero", 2), ("llama", "RMSNorm", 2)])
def test_fp16_reference_block(name, op, n):
    mod = __import__(f"normexport.models.{name}", fromlist=["tiny"])
    block = mod.tiny().to(torch.float16)
    x = tuple(t.to(torch.float16) for t in block.example_inputs())
    model = normexport.convert_module(block, x, target="trt", input_names=block.input_names,
                                      dynamic_axes=block.dynamic_axes)
    counts = op_counts(model)  # n norms, the second with the residual Add before it fused in
    assert fold(counts).get(f"{ops.DOMAIN}::{op}", 0) == n and counts.get(f"{ops.DOMAIN}::{op}", 0) == 1, counts
    assert all(vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for vi in model.graph.input)
    onnx.checker.check_model(model, full_check=True)
    report = normexport.check(model, block, x, dynamic_axes=block.dynamic_axes)
    assert report.passed, report.table()
    # ONNX output vs the fp64 reference directly, independent of the report
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {n_: t.numpy() for n_, t in zip(block.input_names, x)})[0].astype(np.float64)
    ref = mod.tiny().double()(*(t.double() for t in x)).detach().numpy()
    eager = block(*x).double().detach().numpy()
    err, eager_err = np.abs(got - ref).max(), np.abs(eager - ref).max()
    assert err <= 2 * eager_err, (err, eager_err)
    assert err <= 2e-3 * np.abs(ref).max(), (err, np.abs(ref).max())
