"""convert's rewrite verifies its fusions at the sizes of the call the file was exported from, not
at sizes normexport.sizes picks for the dynamic dims: its probe of intermediate sizes holds every
value of the graph at once, and at its own sizes (a 64 x 96 latent) a tiny SD UNet's probe peaked
at 5.5 GB where the recorded 8 x 8 call needs 0.7 GB (tools: /usr/bin/time -v on
`normexport convert SD_DIR -o OUT/`)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from normexport import export as nexport


class DecomposedLN(torch.nn.Module):
    """A LayerNorm written out (the rewriter fuses it, verified locally) over [B, C, H, W] channels-last."""

    def __init__(self, c=8):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(c) * 0.3 + 1.0)
        self.b = torch.nn.Parameter(torch.randn(c) * 0.3)

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return ((x - mean) / torch.sqrt(var + 1e-5) * self.w + self.b).permute(0, 3, 1, 2)


def test_rewrite_runs_at_the_call_sizes():
    torch.manual_seed(0)
    m = DecomposedLN().eval()
    x = torch.randn(3, 8, 5, 7)
    report = {}
    model = nexport.convert_module_ir(m, (x,), target="ort", input_names=["x"], output_names=["y"],
                                      dynamic_axes={"x": [0, 2, 3]}, report=report, swap_norms=False)
    rw = report["rewrite"]
    assert rw["inputs"] == [{"name": "x", "shape": [3, 8, 5, 7], "dtype": "float"}], rw["inputs"]
    assert "LayerNormalization" in [n.op_type for n in model.graph], [n.op_type for n in model.graph]
    # the fused file still runs at other sizes
    import onnxruntime as ort

    sess = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])
    other = np.random.default_rng(1).standard_normal((2, 8, 4, 9)).astype(np.float32)
    xd = other.transpose(0, 2, 3, 1).astype(np.float64)
    mu = xd.mean(-1, keepdims=True)
    ref = ((xd - mu) / np.sqrt(((xd - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * m.w.detach().double().numpy()
           + m.b.detach().double().numpy()).transpose(0, 3, 1, 2)
    assert np.max(np.abs(sess.run(None, {"x": other})[0] - ref)) < 1e-5


def test_call_sizes_keeps_only_inputs_of_the_file():
    torch.manual_seed(0)
    model = nexport.convert_module_ir(DecomposedLN().eval(), (torch.randn(2, 8, 3, 3),), target="ort",
                                      input_names=["x"], dynamic_axes={"x": [0]}, rewrite=False)
    t = torch.zeros(4, 8, 3, 3)
    assert nexport.call_sizes(model, {"x": t, "gone": t}) == {"x": [4, 8, 3, 3]}
    assert nexport.call_sizes(model, {"x": torch.zeros(4, 8)}) is None  # another rank: not this input
    assert nexport.call_sizes(model, None) is None
