"""transformers' T5 encoder (sdpa attention, the text encoder of PixArt / SD3 / Flux) exports with
the dynamo exporter and dynamic batch and sequence, in float32 and bfloat16.

On CPU torch traces scaled_dot_product_attention with its flash kernel, whose [B, S, H, D] layout
makes `out.transpose(1, 2).contiguous()` a no-op in the trace; torch.onnx's later pass re-runs the
graph in the math layout and the `.reshape` turned view fails ("Cannot view a tensor with shape
... as (B, S, H*D)"). rungs.math_attention traces with the math backend. Without it, both dynamo
rungs fail and the ladder falls to the TorchScript exporter (which refuses the bf16 encoder)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from normexport import export as nexport

transformers = pytest.importorskip("transformers")


def _t5(dtype):
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=300, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4,
                                feed_forward_proj="gated-gelu", is_gated_act=True, attn_implementation="sdpa")
    return transformers.T5EncoderModel(cfg).to(dtype).eval()


def _ref_last_hidden(model, ids):
    with torch.no_grad():
        return model.double()(ids).last_hidden_state.numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_t5_encoder_sdpa_exports_with_dynamo_dynamic(dtype):
    import onnx_ir as ir
    import onnxruntime as ort

    model = _t5(dtype)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(1))
    report = {}
    onnx_model = nexport.convert_module_ir(model, (ids,), target="ort", input_names=["input_ids"],
                                           output_names=["last_hidden_state"],
                                           dynamic_axes={"input_ids": [0, 1]}, report=report)
    ex = report["exporter"]
    assert ex["name"] == "dynamo" and "dynamo_error" not in ex, ex
    dims = onnx_model.graph.inputs[0].shape
    assert not isinstance(dims[0], int) and not isinstance(dims[1], int), dims
    if dtype == torch.float32:  # onnxruntime's CPU provider runs float32 (bf16: the parity stage widens)
        sess = ort.InferenceSession(ir.serde.serialize_model(onnx_model).SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        other = torch.randint(0, 300, (3, 11), generator=torch.Generator().manual_seed(2))
        got = sess.run(None, {"input_ids": other.numpy()})[0]
        ref = _ref_last_hidden(_t5(torch.float64), other)
        assert np.max(np.abs(got - ref)) < 1e-4 * max(1.0, np.max(np.abs(ref)))
