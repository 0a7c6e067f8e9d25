"""rules/adaln_seq_first.py (issue 40): a LayerNorm modulated with shift / scale broadcast over x's
leading (sequence) dims. x [S, 1, H] (batch 1) becomes x viewed as [1, S, H] (Reshape) -> one
normexport::AdaLNZero with [1, H] shift / scale -> viewed back; x [S, B, H] with a [B, H]
modulation over S (B > 1) stays LayerNorm + Mul + Add with the reason in the report, and so does a
modulation that is one row for every row of a batch > 1.

Numerics against a float64 numpy evaluation of LayerNorm(x) * (1 + scale) + shift written here
(not the op spec's reference), random weights, non-zero inputs. The real class: diffusers 0.42's
ErnieImageAdaLNContinuous (final_norm of ErnieImageTransformer2DModel, x [S, B, H],
`x * (1 + scale.unsqueeze(0)) + shift.unsqueeze(0)`), alone and in the whole tiny transformer."""

from __future__ import annotations

import copy
import importlib.util
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

from normexport.rewriter import RewriteReport, rewrite

sys.path.insert(0, os.path.dirname(__file__))
import _graphs as G  # noqa: E402

H = G.H
SEQ_FIRST = "are sequence-first"


def ref64(x, shift, scale, w=None, b=None, eps=1e-6):
    """float64 LayerNorm over the last dim, * (1 + scale) + shift, numpy broadcasting (trailing
    dims aligned: a [B, H] modulation of an [S, B, H] x is broadcast over S)."""
    x = np.asarray(x, np.float64)
    m = x.mean(-1, keepdims=True)
    y = (x - m) / np.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + eps)
    if w is not None:
        y = y * np.asarray(w, np.float64)
    if b is not None:
        y = y + np.asarray(b, np.float64)
    return y * (1.0 + np.asarray(scale, np.float64)) + np.asarray(shift, np.float64)


class SeqFirst(torch.nn.Module):
    """x [S, B, H], c [B, H]: shift / scale [B, H] from a Linear of c, applied over S in one spelling."""

    def __init__(self, form: str, eps: float = 1e-6, affine: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.form, self.eps = form, eps
        self.ln = torch.nn.LayerNorm(H, elementwise_affine=affine, eps=eps)
        if affine:
            with torch.no_grad():
                self.ln.weight.copy_(torch.from_numpy(G.WEIGHT))
                self.ln.bias.copy_(torch.from_numpy(G.BIAS))
        self.lin = torch.nn.Linear(H, 2 * H)
        with torch.no_grad():
            self.lin.bias.copy_(0.2 * torch.randn(2 * H))

    def mods(self, c):
        scale, shift = self.lin(c).chunk(2, dim=-1)
        return shift, scale

    def forward(self, x, c):
        f = self.form
        shift, scale = self.mods(c)
        B = c.shape[0]
        if f == "unsqueeze0":  # ErnieImageAdaLNContinuous's spelling
            return self.ln(x) * (1 + scale.unsqueeze(0)) + shift.unsqueeze(0)
        if f == "implicit":  # [B, H] against [S, B, H]: torch broadcasting aligns the trailing dims
            return self.ln(x) * (1 + scale) + shift
        if f == "plus_first":
            return self.ln(x) * (1 + scale)[None] + shift[None]
        if f == "reshape":
            return self.ln(x) * (scale + 1).reshape(1, B, H) + shift.view(1, B, H)
        if f == "shift_first":
            return shift[None] + (1 + scale[None]) * self.ln(x)
        if f == "fp32_ln":
            y = F.layer_norm(x.float(), (H,), None if self.ln.weight is None else self.ln.weight.float(),
                             None if self.ln.bias is None else self.ln.bias.float(), self.eps).to(x.dtype)
            return y * (1 + scale[None]) + shift[None]
        # near-misses
        if f == "two_plus":
            return self.ln(x) * (2 + scale[None]) + shift[None]
        if f == "mixed":  # scale over S, shift per leading row: not one layout
            return self.ln(x) * (1 + scale[None]) + shift[:, None]
        raise ValueError(f)


def export(module, args, exporter: str, names=("x", "c"), dynamic=None) -> onnx.ModelProto:
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if exporter == "dynamo":
                return torch.onnx.export(module, args, dynamo=True, opset_version=18, input_names=list(names),
                                         verbose=False).model_proto
            f = io.BytesIO()
            torch.onnx.export(module, args, f, dynamo=False, opset_version=18, input_names=list(names),
                              output_names=["y"], dynamic_axes=dynamic)
            return onnx.load_from_string(f.getvalue())
    finally:
        logging.disable(logging.NOTSET)


def _fuse(model, verify=True):
    report = RewriteReport()
    return rewrite(model, target="trt", verify=verify, report=report), report


def _reasons(rep, module=None):
    return [r["reason"] for rec in rep.rules.values() if module in (None, rec.module) for r in rec.rejected]


def _module_ref(m: SeqFirst, x, c):
    """ref64 on the module's own shift / scale, computed in float64 from its Linear."""
    W = m.lin.weight.detach().double().numpy()
    bias = m.lin.bias.detach().double().numpy()
    mods = np.asarray(c, np.float64) @ W.T + bias
    scale, shift = mods[:, :H], mods[:, H:]
    w = None if m.ln.weight is None else m.ln.weight.detach().double().numpy()
    b = None if m.ln.bias is None else m.ln.bias.detach().double().numpy()
    return ref64(x, shift, scale, w, b, m.eps)


FORMS = ["unsqueeze0", "implicit", "plus_first", "reshape", "shift_first", "fp32_ln"]


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("form", FORMS)
def test_batch_one_fuses_and_matches_fp64(form, exporter):
    """x [S, 1, H]: one AdaLNZero, shift / scale fed as [1, H], no LayerNormalization left."""
    m = SeqFirst(form, affine=form in ("unsqueeze0", "fp32_ln")).eval()
    x, c = G.xin(5, 1, H), G.xin(1, H, seed=5)
    model = export(m, (torch.from_numpy(x), torch.from_numpy(c)), exporter)
    assert G.count(model, "LayerNormalization") == 1
    out, rep = _fuse(model)
    assert G.count(out, "AdaLNZero", "normexport") == 1, rep.summary()
    assert G.count(out, "LayerNormalization") == 0
    assert rep.rules["adaln_seq_first" + ("_l" if form == "shift_first" else "")].applied == 1, rep.summary()
    assert rep.local.summary()["passed"] == rep.local.summary()["checked"] >= 1
    assert not any(r.startswith("skipped") for r in _reasons(rep)), _reasons(rep)
    onnx.checker.check_model(out, full_check=True)
    node = next(n for n in out.graph.node if n.op_type == "AdaLNZero")
    # x viewed as [1, S, H] and shift / scale [1, H]: the op's [B, H] contract with B = 1
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in onnx.shape_inference.infer_shapes(out).graph.value_info}
    assert [shapes[i] for i in node.input[:3]] == [[1, 5, H], [1, H], [1, H]], shapes
    assert G.count(out, "Transpose") == 0
    eps = [onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "epsilon"]
    np.testing.assert_allclose(eps, [1e-6], rtol=1e-6)
    (y,) = G.run(out, x=x, c=c)
    G.assert_close(y, _module_ref(m, x, c), form)


@pytest.mark.parametrize("form", ["unsqueeze0", "implicit"])
def test_the_rule_itself_unverified_matches_fp64(form):
    """verify=False: the rule's own output (no local check to veto a wrong one) still matches the
    float64 formula; a second epsilon checks that each site keeps its own."""
    m = SeqFirst(form, eps=1e-2).eval()
    x, c = G.xin(4, 1, H) * 0.05, G.xin(1, H, seed=6)  # small x: epsilon matters
    out, rep = _fuse(export(m, (torch.from_numpy(x), torch.from_numpy(c)), "dynamo"), verify=False)
    assert G.count(out, "AdaLNZero", "normexport") == 1, rep.summary()
    (y,) = G.run(out, x=x, c=c)
    G.assert_close(y, _module_ref(m, x, c), form)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("form", FORMS)
def test_batch_above_one_stays_with_the_reason(form, exporter):
    """x [S, B, H], B = 2 (S = 3, so a broadcast over the wrong axis cannot even run): the op
    cannot take a modulation indexed by x's dim 1; nothing changes and the report says why."""
    m = SeqFirst(form).eval()
    x, c = G.xin(3, 2, H), G.xin(2, H, seed=5)
    model = export(m, (torch.from_numpy(x), torch.from_numpy(c)), exporter)
    out, rep = _fuse(model)
    assert G.count(out, "AdaLNZero", "normexport") == 0
    assert G.count(out, "LayerNormalization") == 1
    reasons = _reasons(rep, "adaln_seq_first")
    assert any(SEQ_FIRST in r and "modulation-axis attribute" in r for r in reasons), rep.summary()
    assert not any(r.startswith("skipped") for r in _reasons(rep)), _reasons(rep)
    (y,) = G.run(out, x=x, c=c)
    G.assert_close(y, _module_ref(m, x, c), form)


@pytest.mark.parametrize("form", ["unsqueeze0", "implicit"])
def test_square_seq_batch_unverified_stays_exact(form):
    """S = B = 2, verify=False: a modulation fed along the wrong axis would run here (and be
    wrong); the rule itself declines, so the file computes the formula."""
    m = SeqFirst(form).eval()
    x, c = G.xin(2, 2, H), G.xin(2, H, seed=8)
    out, rep = _fuse(export(m, (torch.from_numpy(x), torch.from_numpy(c)), "dynamo"), verify=False)
    assert G.count(out, "AdaLNZero", "normexport") == 0, rep.summary()
    G.assert_close(G.run(out, x=x, c=c)[0], _module_ref(m, x, c), form)


def test_dynamic_sequence_batch_one():
    """S a symbolic dim (TorchScript exporter, dynamic_axes), B = 1 static: fuses, and runs at
    another S than the one it was exported at."""
    m = SeqFirst("unsqueeze0", affine=True).eval()
    x, c = G.xin(5, 1, H), G.xin(1, H, seed=5)
    model = export(m, (torch.from_numpy(x), torch.from_numpy(c)), "torchscript", dynamic={"x": {0: "s"}})
    out, rep = _fuse(model)
    assert G.count(out, "AdaLNZero", "normexport") == 1, rep.summary()
    x7 = G.xin(7, 1, H, seed=2)
    G.assert_close(G.run(out, x=x7, c=c)[0], _module_ref(m, x7, c))


def test_dynamic_batch_is_not_assumed_one():
    """B a symbolic dim: it may be > 1 at run time, so the site stays (with the reason)."""
    m = SeqFirst("unsqueeze0").eval()
    x, c = G.xin(5, 1, H), G.xin(1, H, seed=5)
    model = export(m, (torch.from_numpy(x), torch.from_numpy(c)), "torchscript",
                   dynamic={"x": {0: "s", 1: "b"}, "c": {0: "b"}})
    out, rep = _fuse(model)
    assert G.count(out, "AdaLNZero", "normexport") == 0
    assert any(SEQ_FIRST in r for r in _reasons(rep, "adaln_seq_first")), rep.summary()
    x2, c2 = G.xin(5, 3, H, seed=3), G.xin(3, H, seed=4)
    G.assert_close(G.run(out, x=x2, c=c2)[0], _module_ref(m, x2, c2))


@pytest.mark.parametrize("form,why", [
    ("two_plus", "modulation factor is (2.0 + scale), not (1 + scale)"),
    ("mixed", "varies along a leading dim"),
])
def test_near_misses_stay(form, why):
    m = SeqFirst(form).eval()
    x, c = G.xin(1, 1, H), G.xin(1, H, seed=5)
    if form == "mixed":
        x = G.xin(2, 2, H)  # shift[:, None] is [B, 1, H]: rows of x's dim 0
        c = G.xin(2, H, seed=5)
    out, rep = _fuse(export(m, (torch.from_numpy(x), torch.from_numpy(c)), "dynamo"))
    assert G.count(out, "AdaLNZero", "normexport") == 0
    assert any(why in r for r in _reasons(rep)), _reasons(rep)
    with torch.no_grad():
        want = m(torch.from_numpy(x), torch.from_numpy(c)).numpy()
    G.assert_close(G.run(out, x=x, c=c)[0], want, form)


def test_float16_batch_one():
    """fp16 model: the fused node takes and returns fp16, no further from float64 than eager fp16."""
    m = SeqFirst("unsqueeze0", affine=True).eval().half()
    x, c = G.xin(6, 1, H).astype(np.float16), G.xin(1, H, seed=5).astype(np.float16)
    out, rep = _fuse(export(m, (torch.from_numpy(x), torch.from_numpy(c)), "dynamo"))
    assert G.count(out, "AdaLNZero", "normexport") == 1, rep.summary()
    (y,) = G.run(out, x=x, c=c)
    assert y.dtype == np.float16
    with torch.no_grad():
        eager = m(torch.from_numpy(x), torch.from_numpy(c)).double().numpy()
        shift, scale = (t.double().numpy() for t in m.mods(torch.from_numpy(c)))
    ref = ref64(x, shift, scale, G.WEIGHT.astype(np.float16), G.BIAS.astype(np.float16))
    err, err_eager = np.abs(y.astype(np.float64) - ref).max(), np.abs(eager - ref).max()
    assert err <= err_eager * (1 + 1e-6) + 1e-7 and err <= 2e-3 * np.abs(ref).max(), (err, err_eager)


# ---- real classes ------------------------------------------------------------------------------
needs_diffusers = pytest.mark.skipif(importlib.util.find_spec("diffusers") is None, reason="diffusers not installed")


def _randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g) + 0.05)
    return module.eval()


@needs_diffusers
def test_ernie_image_final_norm_class():
    """diffusers' ErnieImageAdaLNContinuous, random weights, x [S, 1, H]: one AdaLNZero; against
    the formula in float64 from its own Linear (scale first, then shift, as it chunks)."""
    from diffusers.models.transformers.transformer_ernie_image import ErnieImageAdaLNContinuous

    m = _randomized(ErnieImageAdaLNContinuous(H, eps=1e-6), seed=11)
    x, c = G.xin(6, 1, H), G.xin(1, H, seed=9)
    model = export(m, (torch.from_numpy(x), torch.from_numpy(c)), "dynamo")
    out, rep = _fuse(model)
    assert G.count(out, "AdaLNZero", "normexport") == 1 and G.count(out, "LayerNormalization") == 0, rep.summary()
    W, b = m.linear.weight.detach().double().numpy(), m.linear.bias.detach().double().numpy()
    emb = c.astype(np.float64) @ W.T + b
    scale, shift = emb[:, :H], emb[:, H:]
    (y,) = G.run(out, x=x, c=c)
    G.assert_close(y, ref64(x, shift, scale, eps=1e-6), "ErnieImageAdaLNContinuous")


class _Positional(torch.nn.Module):
    def __init__(self, model, keys):
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *args):
        return self.model(**dict(zip(self.keys, args)), return_dict=False)[0]


@needs_diffusers
@pytest.mark.parametrize("batch", [1, 2])
def test_ernie_image_transformer_converts(batch):
    """The whole tiny ErnieImageTransformer2DModel (1 block, random weights) through
    convert_module(target="trt"): its final_norm fuses at batch 1 and stays, with the reason, at
    batch 2; the file (onnxruntime) against the model in float64 either way."""
    import onnxruntime as ort

    import normexport
    from diffusers.models.transformers.transformer_ernie_image import ErnieImageTransformer2DModel

    torch.manual_seed(0)
    m = _randomized(ErnieImageTransformer2DModel(
        hidden_size=32, num_attention_heads=2, num_layers=1, ffn_hidden_size=64, in_channels=4, out_channels=4,
        patch_size=1, text_in_dim=12, rope_axes_dim=(4, 6, 6)), seed=1)
    g = torch.Generator().manual_seed(2)
    args = (torch.randn(batch, 4, 4, 4, generator=g) + 0.1, torch.tensor([300.0, 700.0][:batch]),
            torch.randn(batch, 3, 12, generator=g) + 0.1, torch.tensor([3, 2][:batch]))
    module = _Positional(m, ["hidden_states", "timestep", "text_bth", "text_lens"]).eval()
    report: dict = {}
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = normexport.convert_module(module, args, target="trt", report=report)
    finally:
        logging.disable(logging.NOTSET)
    rules = {r["name"]: r for r in report["rewrite"]["rules"]}
    if batch == 1:
        assert rules["adaln_seq_first"]["applied"] == 1
        assert G.count(model, "AdaLNZero", "normexport") == 1 and G.count(model, "LayerNormalization") == 0
    else:
        assert rules["adaln_seq_first"]["applied"] == 0
        assert any(SEQ_FIRST in r["reason"] for r in rules["adaln_seq_first"]["rejected"])
        assert G.count(model, "LayerNormalization") == 1
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    got = sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)})[0]
    with torch.no_grad():
        ref = copy.deepcopy(module).double()(*[a.double() if a.is_floating_point() else a for a in args]).numpy()
    tol = 1e-5 * float(np.abs(ref).max()) + 1e-6
    assert float(np.abs(got.astype(np.float64) - ref).max()) <= tol


@needs_diffusers
def test_ada_layer_norm_timestep_only_modulation_stays():
    """diffusers' AdaLayerNorm (chunk_dim=0, the ada_norm of BasicTransformerBlock) with one
    timestep: scale / shift are [H], one row for every row of x [B, S, H] with B = 2: not the op's
    [B, H] contract, so it stays, with the reason; the file still computes the formula."""
    from diffusers.models.normalization import AdaLayerNorm

    m = _randomized(AdaLayerNorm(H, num_embeddings=10), seed=4)

    class Call(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, t):
            return self.inner(x, t)

    x, t = G.xin(2, 3, H), torch.tensor(7)
    out, rep = _fuse(export(Call(m), (torch.from_numpy(x), t), "dynamo", names=("x", "t")))
    assert G.count(out, "AdaLNZero", "normexport") == 0 and G.count(out, "LayerNormalization") == 1
    assert any("one row for every row of x" in r for r in _reasons(rep, "adaln_seq_first")), rep.summary()
    emb = m.emb.weight.detach().double().numpy()[7]
    lin = (emb / (1 + np.exp(-emb))) @ m.linear.weight.detach().double().numpy().T + m.linear.bias.detach().double().numpy()
    scale, shift = lin[:H], lin[H:]
    (y,) = G.run(out, x=x, t=t.numpy())
    G.assert_close(y, ref64(x, shift, scale, eps=m.norm.eps), "AdaLayerNorm")
