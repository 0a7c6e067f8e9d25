"""Complex arithmetic in functions defined inside a method (diffusers ZImageTransformer2DModel, issue 22):
its rotary module builds complex tables with torch.polar, pads per-sample lists of them with
torch.nn.utils.rnn.pad_sequence, and its attention processor applies them with view_as_complex in a
nested function; the forward takes lists of tensors (inputs built in Python). The per-function swaps
that prepare/rope.py had could not reach it; the general lowering does: the model exports with its
norms fused and onnxruntime parity against the float64 reference."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from normexport.export import convert_module  # noqa: E402
from normexport.load.call import CallAdapter  # noqa: E402
from normexport.parity import check  # noqa: E402


def test_z_image_converts_fused_with_parity():
    torch.manual_seed(0)
    model = diffusers.ZImageTransformer2DModel(in_channels=4, dim=32, n_layers=1, n_refiner_layers=1, n_heads=2,
                                               n_kv_heads=2, cap_feat_dim=16, axes_dims=[4, 6, 6],
                                               axes_lens=[64, 32, 32]).eval()
    kwargs = dict(x=[torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)], t=torch.rand(2),
                  cap_feats=[torch.randn(6, 16), torch.randn(6, 16)], return_dict=False)
    adapter = CallAdapter(model, (), kwargs)
    report: dict = {}
    proto = convert_module(adapter, adapter.example_inputs, input_names=adapter.input_names, report=report)
    lowering = [e for e in report["prepare"] if e.get("lowering") == "complex"]
    assert [e["action"] for e in lowering] == ["swapped"] and "pad_sequence" in lowering[0]["reason"], lowering
    assert lowering[0]["kind"] == "ZImageTransformer2DModel" and lowering[0]["max_rel_err"] <= 1e-5
    calls: Counter = Counter()
    hooks = [m.register_forward_hook(lambda *a: calls.update(["rms"])) for m in model.modules()
             if type(m).__name__ == "RMSNorm"]
    with torch.no_grad():
        model(**kwargs)
    for h in hooks:
        h.remove()
    ops = Counter(n.op_type for n in proto.graph.node if n.domain == "normexport")
    assert calls["rms"] > 0 and ops["RMSNorm"] + ops["SkipRMSNorm"] == calls["rms"], (ops, calls)
    result = check(proto, adapter, adapter.example_inputs, extra_shapes=0, plain_export=lambda: convert_module(
        adapter, adapter.example_inputs, target="onnx", input_names=adapter.input_names, fold_bn=False,
        swap_norms=False, rewrite=False))
    assert result.passed and result.rows, [r.reason for r in result.rows]
