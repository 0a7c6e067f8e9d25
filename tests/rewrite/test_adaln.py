"""rules/adaln.py: LayerNormalization -> Mul(1 + scale) -> Add(shift) -> normexport::AdaLNZero."""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import onnx
import pytest
import torch

from normexport.ops import adaln_zero as spec
from normexport.rewriter import RewriteReport, rewrite

sys.path.insert(0, os.path.dirname(__file__))
import _graphs as G  # noqa: E402


def _fused(model, target="trt"):
    report = RewriteReport()
    return rewrite(model, target=target, report=report), report


def _mods(form, rank=3, seed=3):
    rng = np.random.default_rng(seed)
    shape = {"bh": (2, G.H), "full": (2, 3, G.H) if rank == 3 else (2, 2, 3, G.H), "b1h": (2, 1, G.H)}[form]
    return (rng.standard_normal(shape).astype(np.float32) * 0.5 + 0.1,
            rng.standard_normal(shape).astype(np.float32) * 0.5 - 0.2)


def _ref(x, shift, scale, w=None, b=None, eps=1e-6):
    """fp64 formula: LayerNorm(x) * (1 + scale) + shift with [B, H] broadcast over middle dims."""
    y = G.ln_ref(x, w, b, eps)
    if shift.ndim == 2:
        shape = (shift.shape[0],) + (1,) * (x.ndim - 2) + (shift.shape[1],)
        shift, scale = shift.reshape(shape), scale.reshape(shape)
    return y * (1.0 + scale.astype(np.float64)) + shift.astype(np.float64)


@pytest.mark.parametrize("mul_left,add_left,one_left", [(False, False, False), (True, True, True), (True, False, True)])
def test_helper_commuted_bh(mul_left, add_left, one_left):
    model = G.adaln_graph(mul_left=mul_left, add_left=add_left, one_left=one_left)
    out, rep = _fused(model)
    assert G.op_types(out) == ["AdaLNZero"] and len(out.graph.node[0].input) == 3  # all-ones LN weight
    x = G.xin(2, 3, G.H)
    shift, scale = _mods("bh")
    (y,) = G.run(out, x=x, shift=shift, scale=scale)
    G.assert_close(y, _ref(x, shift, scale))
    G.assert_close(y, spec.reference(x, shift, scale, epsilon=1e-6), "op spec reference")


@pytest.mark.parametrize("affine", ["both", "weight"])
@pytest.mark.parametrize("form", ["bh", "full", "b1h"])
def test_helper_affine_and_forms(affine, form):
    model = G.adaln_graph(form=form, affine=affine)
    out, _ = _fused(model)
    assert G.count(out, "AdaLNZero", "normexport") == 1
    node = next(n for n in out.graph.node if n.op_type == "AdaLNZero")
    assert len(node.input) == 5
    x = G.xin(2, 3, G.H)
    shift, scale = _mods(form)
    (y,) = G.run(out, x=x, shift=shift, scale=scale)
    G.assert_close(y, _ref(x, shift, scale, G.WEIGHT, G.BIAS if affine == "both" else None))


def test_rank4_bh():
    model = G.adaln_graph(rank=4, affine="both")
    out, _ = _fused(model)
    assert G.op_types(out) == ["AdaLNZero"]
    x = G.xin(2, 2, 3, G.H)
    shift, scale = _mods("bh")
    G.assert_close(G.run(out, x=x, shift=shift, scale=scale)[0], _ref(x, shift, scale, G.WEIGHT, G.BIAS))


def test_ln_axis_not_last_rejected():
    model = G.adaln_graph(form="full", ln_axis=-2)
    out, rep = _fused(model)
    assert out == model
    reasons = [r["reason"] for rec in rep.rules.values() for r in rec.rejected]
    assert any("does not normalize the last dim" in r for r in reasons), reasons


def test_not_for_other_targets():
    model = G.adaln_graph()
    out, rep = _fused(model, target="onnx")
    assert out == model and rep.modules["adaln"] == "not for target onnx"


class _DiTBlock(torch.nn.Module):
    def __init__(self, affine):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(G.H, elementwise_affine=affine, eps=1e-6)
        if affine:
            with torch.no_grad():
                self.norm.weight.copy_(torch.from_numpy(G.WEIGHT))
                self.norm.bias.copy_(torch.from_numpy(G.BIAS))
        self.ada = torch.nn.Linear(G.H, 2 * G.H)

    def forward(self, x, c):
        shift, scale = self.ada(c).chunk(2, dim=1)
        return self.norm(x) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def test_dynamo_exported_dit_modulate():
    import logging

    logging.disable(logging.WARNING)
    block = _DiTBlock(affine=True).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.onnx.export(block, (torch.randn(2, 3, G.H), torch.randn(2, G.H)), dynamo=True,
                                  opset_version=18, verbose=False).model_proto
    logging.disable(logging.NOTSET)
    out, _ = _fused(model)
    assert G.count(out, "AdaLNZero", "normexport") == 1
    assert G.count(out, "LayerNormalization") == 0 and G.count(out, "Unsqueeze") == 0
    x, c = G.xin(2, 3, G.H), G.xin(2, G.H, seed=9)
    with torch.no_grad():
        shift, scale = (t.numpy() for t in block.ada(torch.from_numpy(c)).chunk(2, dim=1))
    names = [i.name for i in out.graph.input]
    (y,) = G.run(out, **dict(zip(names, (x, c))))
    G.assert_close(y, _ref(x, shift, scale, G.WEIGHT, G.BIAS))


def test_mixed_affine_and_plain_in_one_model_get_one_form():
    """attach_functions needs one arity per op: the plain one gets weight = 1, bias = 0."""
    import onnx

    a, b = G.adaln_graph(affine="both"), G.adaln_graph(affine="none")
    b = onnx.compose.add_prefix(b, "p_")
    g = a.graph
    g.node.extend(b.graph.node)
    g.initializer.extend(b.graph.initializer)
    g.input.extend(b.graph.input)
    g.output.extend(b.graph.output)
    del g.value_info[:]
    model = onnx.shape_inference.infer_shapes(a)
    out, rep = _fused(model)
    nodes = [n for n in out.graph.node if n.op_type == "AdaLNZero"]
    assert len(nodes) == 2 and {len(n.input) for n in nodes} == {5}
    x, x2 = G.xin(2, 3, G.H), G.xin(2, 3, G.H, seed=4)
    (s1, c1), (s2, c2) = _mods("bh"), _mods("bh", seed=7)
    y1, y2 = G.run(out, x=x, shift=s1, scale=c1, p_x=x2, p_shift=s2, p_scale=c2)
    G.assert_close(y1, _ref(x, s1, c1, G.WEIGHT, G.BIAS))
    G.assert_close(y2, _ref(x2, s2, c2))


def _reasons(rep):
    return [r["reason"] for rec in rep.rules.values() for r in rec.rejected]


@pytest.mark.parametrize("shift_shape,scale_shape", [
    (None, ["B", 1]),            # [B, 1] unsqueezed: not [B, H]
    (None, [1, G.H]),            # [1, H] unsqueezed: broadcast over batch, not the op's [B, H]
    (["B", 1, G.H], ["B", "S", G.H]),  # shift [B, 1, H] beside a full-shape scale
])
def test_mod_shapes_that_do_not_fit_fail_the_check(shift_shape, scale_shape):
    form = "bh" if shift_shape is None else "full"
    if form == "bh":
        shift_shape = [2 if d == "B" else d for d in scale_shape] if scale_shape[0] == 1 else ["B", G.H]
    model = G.adaln_graph(form=form, shift_shape=shift_shape, scale_shape=scale_shape)
    for verify in (True, False):
        out = rewrite(model, target="trt", verify=verify, report=(rep := RewriteReport()))
        assert G.count(out, "AdaLNZero", "normexport") == 0, (shift_shape, scale_shape)
        assert not any(r.startswith("numeric verification") for r in _reasons(rep)), _reasons(rep)


def test_float64_graph_is_not_fused_into_float32_only_op():
    model = G.to_dtype(G.adaln_graph(affine="both"), onnx.TensorProto.DOUBLE)
    out, rep = _fused(model)
    assert G.count(out, "AdaLNZero", "normexport") == 0
    assert any("not DOUBLE" in r or "not FLOAT64" in r or "float32/float16/bfloat16" in r for r in _reasons(rep)), _reasons(rep)
    onnx.checker.check_model(out, full_check=True)


def test_stash_type_not_float_is_kept():
    out, rep = _fused(G.adaln_graph(stash_type=0))
    assert G.count(out, "AdaLNZero", "normexport") == 0
    assert any("stash_type" in r for r in _reasons(rep)), _reasons(rep)


def test_ln_output_used_elsewhere_is_kept():
    model = G.adaln_graph()
    ln = next(n for n in model.graph.node if n.op_type == "LayerNormalization").output[0]
    model.graph.output.append(onnx.helper.make_tensor_value_info(ln, onnx.TensorProto.FLOAT, None))
    out, _ = _fused(model)
    assert G.count(out, "AdaLNZero", "normexport") == 0 and G.count(out, "LayerNormalization") == 1


def test_fp16_fuses_and_stays_within_fp16_tolerance():
    model = G.to_dtype(G.adaln_graph(affine="both"), onnx.TensorProto.FLOAT16)
    out, rep = _fused(model)
    assert G.count(out, "AdaLNZero", "normexport") == 1, rep.summary()
    onnx.checker.check_model(out, full_check=True)
    x = G.xin(2, 3, G.H).astype(np.float16)
    shift, scale = (a.astype(np.float16) for a in _mods("bh"))
    (y,) = G.run(out, x=x, shift=shift, scale=scale)
    ref = _ref(x, shift, scale, G.WEIGHT.astype(np.float16), G.BIAS.astype(np.float16))
    assert y.dtype == np.float16
    assert np.max(np.abs(y.astype(np.float64) - ref)) <= 2e-3 * np.max(np.abs(ref))


@pytest.mark.parametrize("opset", [11, 14, 16])
def test_legacy_export_decomposed_ln_modulate(opset):
    """the legacy exporter writes LayerNorm decomposed below opset 17: the layer_norm rule makes
    LayerNormalization (opset raised) and this rule takes the modulation."""
    block = _DiTBlock(affine=True).eval()
    import io as _io

    f = _io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(block, (torch.randn(2, 3, G.H), torch.randn(2, G.H)), f, dynamo=False,
                          opset_version=opset, input_names=["x", "c"], output_names=["y"])
    model = onnx.load_from_string(f.getvalue())
    out, rep = _fused(model)
    assert G.count(out, "AdaLNZero", "normexport") == 1, rep.summary()
    x, c = G.xin(2, 3, G.H), G.xin(2, G.H, seed=9)
    with torch.no_grad():
        shift, scale = (t.numpy() for t in block.ada(torch.from_numpy(c)).chunk(2, dim=1))
    (y,) = G.run(out, x=x, c=c)
    G.assert_close(y, _ref(x, shift, scale, G.WEIGHT, G.BIAS))
    again, rep2 = _fused(out)
    assert rep2.applied == 0 and G.op_types(again) == G.op_types(out)
