"""rules/adaln_continuous.py: modulated LayerNorms in the forms rules/adaln.py leaves (the `+ 1`
before the unsqueeze / reshape as in diffusers' AdaLayerNormContinuous, Reshape-made [B, 1, H],
fp32 Casts around the LayerNorm) -> normexport::AdaLNZero; near-misses stay, with a reason.

Each form is written in torch and exported by both torch exporters (dynamo, TorchScript-based),
so the graphs are the ones real files carry."""

from __future__ import annotations

import io
import logging
import os
import sys
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from normexport.ops import adaln_zero as spec
from normexport.rewriter import RewriteReport, rewrite

sys.path.insert(0, os.path.dirname(__file__))
import _graphs as G  # noqa: E402

H = G.H


class Modulated(torch.nn.Module):
    """A LayerNorm modulated by shift / scale from a Linear of c, in one of diffusers' spellings."""

    def __init__(self, form: str, eps: float = 1e-6, affine: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.ln = torch.nn.LayerNorm(H, elementwise_affine=affine, eps=eps)
        if affine:
            with torch.no_grad():
                self.ln.weight.copy_(torch.from_numpy(G.WEIGHT))
                self.ln.bias.copy_(torch.from_numpy(G.BIAS))
        self.lin = torch.nn.Linear(H, 2 * H)
        self.table = torch.nn.Parameter(0.3 * torch.randn(2, H))

    def mods(self, x, c):
        """(shift, scale) as the form computes them: [B, H], or [B, 1, H] for the PixArt form."""
        if self.form == "pixart":
            shift, scale = (self.table[None] + self.lin(c).reshape(x.shape[0], 2, -1)).chunk(2, dim=1)
            return shift, scale
        if self.form in ("split", "split_shift_first"):
            a, b = self.lin(c).split(H, dim=1)
            return (a, b) if self.form == "split_shift_first" else (b, a)
        scale, shift = self.lin(c).chunk(2, dim=1)
        return shift, scale

    def forward(self, x, c):
        f, B = self.form, x.shape[0]
        shift, scale = self.mods(x, c)
        if f == "pixart":
            return self.ln(x) * (1 + scale) + shift
        if f in ("continuous", "split", "split_shift_first"):
            return self.ln(x) * (1 + scale)[:, None, :] + shift[:, None, :]
        if f == "unsqueeze_after":
            return self.ln(x) * (1 + scale).unsqueeze(1) + shift.unsqueeze(1)
        if f == "reshape":
            return self.ln(x) * (scale + 1).reshape(B, 1, H) + shift.view(B, 1, H)
        if f == "reshape_before":
            return self.ln(x) * (1 + scale.reshape(B, 1, H)) + shift.reshape(B, 1, H)
        if f == "shift_first":
            return shift[:, None] + (1 + scale)[:, None] * self.ln(x)
        if f == "fp32_ln":  # diffusers FP32LayerNorm then the modulation in the model's dtype
            y = F.layer_norm(x.float(), (H,), None if self.ln.weight is None else self.ln.weight.float(),
                             None if self.ln.bias is None else self.ln.bias.float(), self.ln.eps).to(x.dtype)
            return y * (1 + scale)[:, None] + shift[:, None]
        # near-misses
        if f == "two_plus":
            return self.ln(x) * (2 + scale)[:, None] + shift[:, None]
        if f == "one_minus":
            return self.ln(x) * (1 - scale)[:, None] + shift[:, None]
        if f == "no_shift":
            return self.ln(x) * (1 + scale)[:, None]
        if f == "read_elsewhere":
            y = self.ln(x)
            return y * (1 + scale)[:, None] + shift[:, None] + 0.5 * y
        if f == "reshape_mixed":  # (1 + scale) laid out as [1, B, H]: over the sequence, not the batch
            return self.ln(x) * (1 + scale).reshape(1, B, H) + shift[:, None]
        raise ValueError(f)


def export(module, args, exporter: str, opset: int = 18) -> onnx.ModelProto:
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if exporter == "dynamo":
                return torch.onnx.export(module, args, dynamo=True, opset_version=opset, input_names=["x", "c"],
                                         verbose=False).model_proto
            f = io.BytesIO()
            torch.onnx.export(module, args, f, dynamo=False, opset_version=opset, input_names=["x", "c"],
                              output_names=["y"])
            return onnx.load_from_string(f.getvalue())
    finally:
        logging.disable(logging.NOTSET)


def _reference(m: Modulated, x, c) -> np.ndarray:
    """fp64 formula from the module's own shift / scale (computed in float64)."""
    m64 = Modulated(m.form, m.ln.eps, m.ln.weight is not None).double()
    m64.load_state_dict(m.state_dict())
    with torch.no_grad():
        shift, scale = (t.numpy() for t in m64.mods(torch.from_numpy(x).double(), torch.from_numpy(c).double()))
    w = None if m.ln.weight is None else m.ln.weight.detach().double().numpy()
    b = None if m.ln.bias is None else m.ln.bias.detach().double().numpy()
    return spec.reference(x, shift, scale, w, b, epsilon=m.ln.eps)


def _fuse(model):
    report = RewriteReport()
    return rewrite(model, target="trt", report=report), report


def _reasons(rep):
    return [r["reason"] for rec in rep.rules.values() for r in rec.rejected]


FORMS = ["continuous", "unsqueeze_after", "reshape", "reshape_before", "shift_first", "split", "split_shift_first",
         "pixart", "fp32_ln"]


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("form", FORMS)
def test_forms_fuse_and_match_fp64(form, exporter):
    m = Modulated(form, affine=form in ("continuous", "fp32_ln")).eval()
    x, c = G.xin(2, 3, H), G.xin(2, H, seed=5)
    model = export(m, (torch.from_numpy(x), torch.from_numpy(c)), exporter)
    assert G.count(model, "LayerNormalization") == 1
    out, rep = _fuse(model)
    assert G.count(out, "AdaLNZero", "normexport") == 1, rep.summary()
    assert G.count(out, "LayerNormalization") == 0
    onnx.checker.check_model(out, full_check=True)
    (y,) = G.run(out, x=x, c=c)
    G.assert_close(y, _reference(m, x, c), form)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("form", ["continuous", "fp32_ln"])
def test_float16_with_fp32_layernorm_fuses_no_worse_than_eager(form, exporter):
    """Half models: x (an fp16 input, upcast for an FP32LayerNorm) goes into the op in fp16; the
    output stays fp16, no further from the fp64 formula than eager float16 is."""
    m = Modulated(form, affine=True).eval().half()
    x, c = G.xin(2, 5, H).astype(np.float16), G.xin(2, H, seed=5).astype(np.float16)
    model = export(m, (torch.from_numpy(x), torch.from_numpy(c)), exporter)
    out, rep = _fuse(model)
    assert G.count(out, "AdaLNZero", "normexport") == 1 and G.count(out, "LayerNormalization") == 0, rep.summary()
    (y,) = G.run(out, x=x, c=c)
    assert y.dtype == np.float16
    with torch.no_grad():
        eager = m(torch.from_numpy(x), torch.from_numpy(c)).double().numpy()
        # the formula on the fp16 shift / scale both eager and the file compute
        shift, scale = (t.double().numpy() for t in m.mods(torch.from_numpy(x), torch.from_numpy(c)))
    ref = spec.reference(x, shift, scale, G.WEIGHT.astype(np.float16), G.BIAS.astype(np.float16), epsilon=1e-6)
    err, err_eager = np.abs(y.astype(np.float64) - ref).max(), np.abs(eager - ref).max()
    assert err <= err_eager * (1 + 1e-6), (err, err_eager)
    assert err <= 2e-3 * np.abs(ref).max()


def test_each_site_keeps_its_own_epsilon():
    """Two modulated LayerNorms with different eps: each fused node carries its own. Both take
    the same shift / scale (one Linear), so the `1 + scale` and unsqueeze nodes are shared by
    the two sites: both still fuse."""

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Modulated("continuous", eps=1e-6), Modulated("continuous", eps=1e-2)
            self.b.lin = self.a.lin

        def forward(self, x, c):
            return self.a(x, c), self.b(x, c)

    m = Two().eval()
    x, c = G.xin(2, 3, H) * 0.05, G.xin(2, H, seed=5)  # small x: eps 1e-2 matters
    out, rep = _fuse(export(m, (torch.from_numpy(x), torch.from_numpy(c)), "dynamo"))
    nodes = [n for n in out.graph.node if n.op_type == "AdaLNZero"]
    assert len(nodes) == 2, rep.summary()
    eps = sorted(onnx.helper.get_attribute_value(a) for n in nodes for a in n.attribute if a.name == "epsilon")
    np.testing.assert_allclose(eps, [1e-6, 1e-2], rtol=1e-6)
    ya, yb = G.run(out, x=x, c=c)
    G.assert_close(ya, _reference(m.a, x, c), "eps 1e-6")
    G.assert_close(yb, _reference(m.b, x, c), "eps 1e-2")


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("form,why", [
    ("two_plus", "modulation factor is (2.0 + scale), not (1 + scale)"),
    ("one_minus", "not (1 + scale)"),
    ("no_shift", "no shift is added after the modulation"),
    ("read_elsewhere", "LayerNormalization output is read by 2 nodes"),
    ("reshape_mixed", "Reshape to [1, 2, 8] does not make [B, H] into [B, 1.., H]"),
])
def test_near_misses_stay_with_a_reason(form, why, exporter):
    m = Modulated(form).eval()
    x, c = G.xin(2, 2, H), G.xin(2, H, seed=5)
    model = export(m, (torch.from_numpy(x), torch.from_numpy(c)), exporter)
    out, rep = _fuse(model)
    assert G.count(out, "AdaLNZero", "normexport") == 0
    assert G.count(out, "LayerNormalization") == 1
    reasons = _reasons(rep)
    assert any(why in r for r in reasons), reasons
    assert not any(r.startswith("numeric verification") for r in reasons), reasons
    with torch.no_grad():
        want = m(torch.from_numpy(x), torch.from_numpy(c)).numpy()
    G.assert_close(G.run(out, x=x, c=c)[0], want, form)


def test_already_fused_file_is_left_alone():
    m = Modulated("continuous").eval()
    x, c = G.xin(2, 3, H), G.xin(2, H, seed=5)
    out, _ = _fuse(export(m, (torch.from_numpy(x), torch.from_numpy(c)), "dynamo"))
    again, rep = _fuse(out)
    assert rep.applied == 0 and G.op_types(again) == G.op_types(out)
