"""rules/adaln_seq_first.py (issue 40): a LayerNorm modulated with shift / scale broadcast over x's
leading (sequence) dims, x [S, B, H] with a [B, H] modulation over S, any batch: one
normexport::AdaLNZero on x itself with shift / scale fed as [B, H] and modulation_axis 1 (the dim
of x their rows follow; rank(x) - 2 in general). A modulation that is one row for every row of a
batch > 1 stays, with the reason. After it, rule gated_adaln takes a gated residual whose gate is
laid out the same way (GatedAdaLNZero with modulation_axis 1).

Numerics against a float64 numpy evaluation of LayerNorm(x) * (1 + scale) + shift written here
(not the op spec's reference), random weights, non-zero inputs; S != B except where a square
[B, B, H] is the point (a modulation fed along the wrong axis would run there, and be wrong). The
real class: diffusers 0.42's ErnieImageAdaLNContinuous (final_norm of
ErnieImageTransformer2DModel, x [S, B, H], `x * (1 + scale.unsqueeze(0)) + shift.unsqueeze(0)`),
alone and in the whole tiny transformer at batch 1 and 2."""

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


def _adaln_node(model: onnx.ModelProto, op_type: str = "AdaLNZero") -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.op_type == op_type and n.domain == "normexport"]
    return node


def _attr(node: onnx.NodeProto, name: str):
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


def _shapes(model: onnx.ModelProto) -> dict[str, list]:
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    return {v.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim]
            for v in list(g.value_info) + list(g.input) + list(g.output)}


@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("form", FORMS)
def test_fuses_and_matches_fp64(form, exporter, batch):
    """x [5, B, H] at batch 1, 2 and 3: one AdaLNZero on x itself (no Reshape / Transpose of x),
    shift / scale fed as [B, H], modulation_axis 1, no LayerNormalization left; the file against
    the float64 formula."""
    m = SeqFirst(form, affine=form in ("unsqueeze0", "fp32_ln")).eval()
    x, c = G.xin(5, batch, H), G.xin(batch, H, seed=5)
    model = export(m, (torch.from_numpy(x), torch.from_numpy(c)), exporter)
    assert G.count(model, "LayerNormalization") == 1
    out, rep = _fuse(model)
    assert G.count(out, "AdaLNZero", "normexport") == 1, rep.summary()
    assert G.count(out, "LayerNormalization") == 0
    assert rep.rules["adaln_seq_first" + ("_l" if form == "shift_first" else "")].applied == 1, rep.summary()
    assert rep.local.summary()["passed"] == rep.local.summary()["checked"] >= 1
    assert not any(r.startswith("skipped") for r in _reasons(rep)), _reasons(rep)
    onnx.checker.check_model(out, full_check=True)
    node = _adaln_node(out)
    assert _attr(node, "modulation_axis") == 1
    np.testing.assert_allclose([_attr(node, "epsilon")], [1e-6], rtol=1e-6)
    # x itself (the graph input, or a Cast of it), shift / scale [B, H]: the op's contract with B on dim 1
    shapes = _shapes(out)
    assert [shapes[i] for i in node.input[:3]] == [[5, batch, H], [batch, H], [batch, H]], shapes
    assert G.count(out, "Transpose") == 0
    producer = {o: n for n in out.graph.node for o in n.output}
    assert node.input[0] == "x" or producer[node.input[0]].op_type == "Cast", producer.get(node.input[0])
    # the function body that declares modulation_axis comes with the node
    (fn,) = [f for f in out.functions if f.name == "AdaLNZero"]
    assert "modulation_axis" in {a.name for a in fn.attribute_proto}
    (y,) = G.run(out, x=x, c=c)
    G.assert_close(y, _module_ref(m, x, c), form)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("form", ["unsqueeze0", "implicit"])
def test_the_rule_itself_unverified_matches_fp64(form, batch):
    """verify=False: the rule's own output (no local check to veto a wrong one) still matches the
    float64 formula; a second epsilon checks that each site keeps its own."""
    m = SeqFirst(form, eps=1e-2).eval()
    x, c = G.xin(4, batch, H) * 0.05, G.xin(batch, H, seed=6)  # small x: epsilon matters
    out, rep = _fuse(export(m, (torch.from_numpy(x), torch.from_numpy(c)), "dynamo"), verify=False)
    assert G.count(out, "AdaLNZero", "normexport") == 1, rep.summary()
    (y,) = G.run(out, x=x, c=c)
    G.assert_close(y, _module_ref(m, x, c), form)


@pytest.mark.parametrize("form", ["unsqueeze0", "implicit"])
def test_square_seq_batch_unverified_is_exact(form):
    """S = B = 2, verify=False: a modulation fed along the wrong axis (x's first, the op's default)
    would run here and be wrong; the fused file computes the formula."""
    m = SeqFirst(form).eval()
    x, c = G.xin(2, 2, H), G.xin(2, H, seed=8)
    out, rep = _fuse(export(m, (torch.from_numpy(x), torch.from_numpy(c)), "dynamo"), verify=False)
    assert G.count(out, "AdaLNZero", "normexport") == 1, rep.summary()
    assert _attr(_adaln_node(out), "modulation_axis") == 1
    G.assert_close(G.run(out, x=x, c=c)[0], _module_ref(m, x, c), form)
    # the same node read with the default layout (modulation_axis left out) is measurably wrong
    wrong = copy.deepcopy(out)
    node = _adaln_node(wrong)
    keep = [a for a in node.attribute if a.name != "modulation_axis"]
    del node.attribute[:]
    node.attribute.extend(keep)
    from normexport import ops
    ops.attach_functions(wrong)
    err = np.abs(G.run(wrong, x=x, c=c)[0] - _module_ref(m, x, c)).max()
    assert err > 0.1, err


def test_dynamic_sequence_and_batch():
    """S and B symbolic dims (TorchScript exporter, dynamic_axes): fuses, and runs at other sizes
    than those it was exported at (B 1 and 3, S 7 and 2)."""
    m = SeqFirst("unsqueeze0", affine=True).eval()
    x, c = G.xin(5, 2, H), G.xin(2, H, seed=5)
    model = export(m, (torch.from_numpy(x), torch.from_numpy(c)), "torchscript",
                   dynamic={"x": {0: "s", 1: "b"}, "c": {0: "b"}})
    out, rep = _fuse(model)
    assert G.count(out, "AdaLNZero", "normexport") == 1 and G.count(out, "LayerNormalization") == 0, rep.summary()
    assert _attr(_adaln_node(out), "modulation_axis") == 1
    for s, b in ((7, 1), (2, 3)):
        x2, c2 = G.xin(s, b, H, seed=s), G.xin(b, H, seed=b)
        G.assert_close(G.run(out, x=x2, c=c2)[0], _module_ref(m, x2, c2), f"S={s} B={b}")


def test_rank4_leading_dims():
    """x [S1, S2, B, H] with [B, H] over both leading dims: modulation_axis 2 (rank - 2)."""

    class Rank4(SeqFirst):
        def forward(self, x, c):
            shift, scale = self.mods(c)
            return self.ln(x) * (1 + scale[None, None]) + shift[None, None]

    m = Rank4("unsqueeze0").eval()
    x, c = G.xin(3, 2, 4, H), G.xin(4, H, seed=5)
    out, rep = _fuse(export(m, (torch.from_numpy(x), torch.from_numpy(c)), "dynamo"))
    assert G.count(out, "AdaLNZero", "normexport") == 1, rep.summary()
    assert _attr(_adaln_node(out), "modulation_axis") == 2
    G.assert_close(G.run(out, x=x, c=c)[0], _module_ref(m, x, c), "rank 4")


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


def test_float16_batch_two():
    """fp16 model at batch 2: the fused node takes and returns fp16, no further from float64 than
    eager fp16."""
    m = SeqFirst("unsqueeze0", affine=True).eval().half()
    x, c = G.xin(6, 2, H).astype(np.float16), G.xin(2, H, seed=5).astype(np.float16)
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


# ---- the gated residual before it (rule gated_adaln) ---------------------------------------------
class GatedSeqFirst(SeqFirst):
    """h = r + gate * u, then the sequence-first modulated LayerNorm of h, added to h (the next
    residual: both the norm and the sum are read); r, u [S, B, H]; gate, shift, scale [B, H] from c.
    `gate_form` spells the gate: "unsqueeze0" (gate[None]), "implicit" ([B, H] against [S, B, H])
    or "axis0" (gate[:, None]: rows of x's dim 0, a different layout)."""

    def __init__(self, gate_form: str):
        super().__init__("unsqueeze0", affine=True)
        self.gate_form = gate_form
        self.glin = torch.nn.Linear(H, H)

    def forward(self, r, u, c):
        g = self.glin(c)
        g = {"unsqueeze0": g[None], "implicit": g, "axis0": g[:, None]}[self.gate_form]
        h = r + g * u
        shift, scale = self.mods(c)
        y = self.ln(h) * (1 + scale.unsqueeze(0)) + shift.unsqueeze(0)
        return y if self.gate_form == "axis0" else y + h  # (axis0: h read by the norm alone)

    def ref(self, r, u, c):
        g = np.asarray(c, np.float64) @ self.glin.weight.detach().double().numpy().T + \
            self.glin.bias.detach().double().numpy()
        g = g[:, None] if self.gate_form == "axis0" else g  # numpy aligns [B, H] with [S, B, H]'s last dims
        h = np.asarray(r, np.float64) + g * np.asarray(u, np.float64)
        return _module_ref(self, h, c) + (0 if self.gate_form == "axis0" else h)


@pytest.mark.parametrize("gate_form", ["unsqueeze0", "implicit"])
def test_gated_residual_seq_first(gate_form):
    """x [4, 3, H]: the AdaLNZero (modulation_axis 1) and the gated Add before it become one
    GatedAdaLNZero with modulation_axis 1 and gate [B, H], its Sum read by the next residual Add;
    against float64."""
    m = GatedSeqFirst(gate_form).eval()
    r, u, c = G.xin(4, 3, H), G.xin(4, 3, H, seed=3), G.xin(3, H, seed=5)
    model = export(m, tuple(torch.from_numpy(a) for a in (r, u, c)), "dynamo", names=("r", "u", "c"))
    out, rep = _fuse(model)
    assert G.count(out, "GatedAdaLNZero", "normexport") == 1 and G.count(out, "AdaLNZero", "normexport") == 0, \
        rep.summary()
    node = _adaln_node(out, "GatedAdaLNZero")
    assert _attr(node, "modulation_axis") == 1
    assert _shapes(out)[node.input[2]] == [3, H]
    assert rep.local.summary()["passed"] == rep.local.summary()["checked"] >= 2
    (y,) = G.run(out, r=r, u=u, c=c)
    G.assert_close(y, m.ref(r, u, c), gate_form)


def test_gated_residual_of_another_layout_stays():
    """S = B = 2 so that it runs: a gate laid out along x's dim 0 (gate[:, None]) before a
    sequence-first AdaLNZero is not the op's one layout; the Add stays (reason given), unverified too."""
    m = GatedSeqFirst("axis0").eval()
    r, u, c = G.xin(2, 2, H), G.xin(2, 2, H, seed=3), G.xin(2, H, seed=5)
    model = export(m, tuple(torch.from_numpy(a) for a in (r, u, c)), "dynamo", names=("r", "u", "c"))
    out, rep = _fuse(model, verify=False)
    assert G.count(out, "GatedAdaLNZero", "normexport") == 0 and G.count(out, "AdaLNZero", "normexport") == 1
    assert any("[B, H] at dim 1 of x" in why for why in _reasons(rep, "gated_adaln")), _reasons(rep)
    (y,) = G.run(out, r=r, u=u, c=c)
    G.assert_close(y, m.ref(r, u, c), "axis0")


# ---- real classes ------------------------------------------------------------------------------
needs_diffusers = pytest.mark.skipif(importlib.util.find_spec("diffusers") is None, reason="diffusers not installed")


def _randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g) + 0.05)
    return module.eval()


@needs_diffusers
@pytest.mark.parametrize("batch", [1, 2])
def test_ernie_image_final_norm_class(batch):
    """diffusers' ErnieImageAdaLNContinuous, random weights, x [S, B, H]: one AdaLNZero with
    modulation_axis 1; against the formula in float64 from its own Linear (scale first, then shift,
    as it chunks)."""
    from diffusers.models.transformers.transformer_ernie_image import ErnieImageAdaLNContinuous

    m = _randomized(ErnieImageAdaLNContinuous(H, eps=1e-6), seed=11)
    x, c = G.xin(6, batch, H), G.xin(batch, H, seed=9)
    model = export(m, (torch.from_numpy(x), torch.from_numpy(c)), "dynamo")
    out, rep = _fuse(model)
    assert G.count(out, "AdaLNZero", "normexport") == 1 and G.count(out, "LayerNormalization") == 0, rep.summary()
    assert _attr(_adaln_node(out), "modulation_axis") == 1
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
    convert_module(target="trt"): its final_norm (x [S, B, H]) fuses at batch 1 and 2 into one node
    with modulation_axis 1, no LayerNormalization left (rule adaln_seq_first; rule gated_adaln then
    takes the last block's gated residual into it where the gate has that layout); the file
    (onnxruntime) against the model in float64."""
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
    assert rules["adaln_seq_first"]["applied"] == 1, rules["adaln_seq_first"]
    assert G.count(model, "LayerNormalization") == 0
    adaln = [n for n in model.graph.node if n.domain == "normexport" and n.op_type in ("AdaLNZero", "GatedAdaLNZero")]
    assert len(adaln) == 1 and _attr(adaln[0], "modulation_axis") == 1, adaln
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
