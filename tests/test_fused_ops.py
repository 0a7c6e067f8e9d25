"""The fused residual ops (docs/design.md §2): normexport::SkipRMSNorm and normexport::GatedAdaLNZero.
torch custom op, ONNX function body in onnxruntime (both outputs), torch.onnx export, all against
float64 references written from the formulas; bodies pass the ONNX checker."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from normexport import ops
from normexport.ops import gated_adaln_zero, skip_rms_norm

G = torch.Generator().manual_seed(0)
ONNX_TYPE = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}
NP_TYPE = {torch.float32: np.float32, torch.float16: np.float16}
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # docs/design.md §7 (relative to max|ref|)


def rand(*shape, dtype=torch.float32, scale=1.0, offset=0.0):
    return (torch.randn(*shape, generator=G) * scale + offset).to(dtype)


def rel_err(got, ref) -> float:
    got = np.asarray(got.float() if isinstance(got, torch.Tensor) else got, dtype=np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def f64(t):
    return None if t is None else t.double().numpy()


def test_references_follow_the_formulas():
    x = np.array([[1.0, 2.0, 3.0, 4.0]])
    skip = np.array([[0.0, 1.0, -1.0, 0.0]])
    w = np.array([1.0, 0.5, 2.0, -1.0])
    y, s = skip_rms_norm.reference(x, skip, w, np.array([0.0, 0.0, 0.0, 1.0]), epsilon=0.0)
    np.testing.assert_allclose(s, [[1.0, 3.0, 2.0, 5.0]])
    np.testing.assert_allclose(y, s / np.sqrt(39.0 / 4) * w)
    y, s = gated_adaln_zero.reference(x, skip, np.full((1, 4), 2.0), np.ones((1, 4)), np.zeros((1, 4)), epsilon=0.0)
    np.testing.assert_allclose(s, [[1.0, 4.0, 1.0, 4.0]])
    np.testing.assert_allclose(y, (s - 2.5) / 1.5 + 1.0)


@pytest.mark.parametrize("bias", [False, True])
def test_skip_rms_norm_op(bias):
    x, skip = rand(2, 5, 64, scale=2.0), rand(2, 5, 64, offset=0.3)
    w, b = rand(64, offset=1.0, scale=0.3), (rand(64, scale=0.5) if bias else None)
    y, s = torch.ops.normexport.skip_rms_norm(x, skip, w, b, 1e-5)
    ref_y, ref_s = skip_rms_norm.reference(f64(x), f64(skip), f64(w), f64(b), 1e-5)
    assert rel_err(s, ref_s) < 1e-6 and rel_err(y, ref_y) < 1e-6


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_gated_adaln_zero_op(affine, full):
    shape = (2, 9, 48)
    x, upd = rand(*shape, scale=2.0, offset=0.5), rand(*shape)
    mod = shape if full else (2, 48)
    gate, shift, scale = rand(*mod, offset=0.5), rand(*mod), rand(*mod, scale=0.5)
    w = rand(48, offset=1.0, scale=0.3) if affine else None
    b = rand(48, scale=0.3) if affine else None
    y, s = torch.ops.normexport.gated_adaln_zero(x, upd, gate, shift, scale, w, b, 1e-6)
    ref_y, ref_s = gated_adaln_zero.reference(f64(x), f64(upd), f64(gate), f64(shift), f64(scale), f64(w), f64(b), 1e-6)
    assert rel_err(s, ref_s) < 1e-6 and rel_err(y, ref_y) < 1e-5


# ---- ONNX function bodies in onnxruntime -------------------------------------------------------
def _one_node(op_type, inputs: dict, attrs, dtype):
    """A model with one normexport node; inputs are graph inputs, both outputs graph outputs."""
    elem = ONNX_TYPE[dtype]
    node = helper.make_node(op_type, list(inputs), ["Y", "Sum"], domain=ops.DOMAIN, **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, elem, list(v.shape)) for n, v in inputs.items()],
        [helper.make_tensor_value_info(n, elem, list(inputs["X"].shape)) for n in ("Y", "Sum")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ops.DOMAIN, 1)])
    ops.attach_functions(model)
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {n: v.numpy() for n, v in inputs.items()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_skip_rms_norm_body_in_onnxruntime(dtype, bias):
    x, skip = rand(2, 7, 96, dtype=dtype, scale=2.0), rand(2, 7, 96, dtype=dtype, offset=0.3)
    w = rand(96, dtype=dtype, offset=1.0, scale=0.3)
    inputs = {"X": x, "skip": skip, "scale": w} | ({"bias": rand(96, dtype=dtype, scale=0.5)} if bias else {})
    y, s = _one_node("SkipRMSNorm", inputs, {"epsilon": 1e-5}, dtype)
    ref_y, ref_s = skip_rms_norm.reference(f64(x), f64(skip), f64(w), f64(inputs.get("bias")), 1e-5, NP_TYPE[dtype])
    assert y.dtype == s.dtype == NP_TYPE[dtype]
    assert rel_err(s, ref_s) < TOL[dtype] and rel_err(y, ref_y) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_gated_adaln_zero_body_in_onnxruntime(dtype, full, affine):
    shape = (2, 5, 64)
    mod = shape if full else (2, 64)
    inputs = {"X": rand(*shape, dtype=dtype, scale=2.0, offset=0.5), "update": rand(*shape, dtype=dtype),
              "gate": rand(*mod, dtype=dtype, offset=0.5), "shift": rand(*mod, dtype=dtype),
              "scale": rand(*mod, dtype=dtype, scale=0.5)}
    if affine:
        inputs |= {"weight": rand(64, dtype=dtype, offset=1.0, scale=0.3), "bias": rand(64, dtype=dtype, scale=0.3)}
    y, s = _one_node("GatedAdaLNZero", inputs, {"epsilon": 1e-6}, dtype)
    ref_y, ref_s = gated_adaln_zero.reference(*(f64(v) for v in inputs.values()), epsilon=1e-6, dtype=NP_TYPE[dtype])
    assert rel_err(s, ref_s) < TOL[dtype] and rel_err(y, ref_y) < TOL[dtype]


def test_body_check_can_fail():
    """A body whose Sum drops the gate is caught by the same comparison."""
    shape = (2, 5, 64)
    inputs = {"X": rand(*shape), "update": rand(*shape), "gate": rand(2, 64, offset=0.5), "shift": rand(2, 64),
              "scale": rand(2, 64)}
    y, s = _one_node("GatedAdaLNZero", inputs, {"epsilon": 1e-6}, torch.float32)
    ref_y, _ = gated_adaln_zero.reference(*(f64(v) for v in inputs.values()), epsilon=1e-6)
    wrong_y, _ = gated_adaln_zero.reference(f64(inputs["X"]), f64(inputs["update"]), np.ones((2, 64)),
                                            f64(inputs["shift"]), f64(inputs["scale"]), epsilon=1e-6)
    assert rel_err(y, ref_y) < 1e-5 and rel_err(y, wrong_y) > 1e-2


# ---- torch.onnx export -------------------------------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(rand(32, offset=1.0, scale=0.3))

    def forward(self, x, skip, upd, gate, shift, scale):
        y, h = torch.ops.normexport.skip_rms_norm(x, skip, self.w, None, 1e-6)
        y2, h2 = torch.ops.normexport.gated_adaln_zero(h, upd, gate, shift, scale, None, None, 1e-6)
        return y + y2, h2


def test_export_both_ops(tmp_path):
    args = (rand(2, 4, 32), rand(2, 4, 32), rand(2, 4, 32), rand(2, 32, offset=0.5), rand(2, 32), rand(2, 32))
    m = _Block().eval()
    prog = torch.onnx.export(m, args, dynamo=True, custom_translation_table=ops.TRANSLATION_TABLE, opset_version=18)
    model = prog.model_proto
    ops.attach_functions(model)
    types = sorted(n.op_type for n in ops.custom_nodes(model))
    assert types == ["GatedAdaLNZero", "SkipRMSNorm"], types
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)})
    with torch.no_grad():
        want = [t.numpy() for t in m(*args)]
    for g, w in zip(got, want):
        assert rel_err(g, w.astype(np.float64)) < 1e-5


# ---- modulation_axis (a [B, H] gate / shift / scale following X's dim 1: sequence-first [S, B, H]) --
def _seq_first_gated(x, upd, gate, shift, scale, w=None, b=None, eps=1e-6):
    """float64 (Y, Sum) with numpy broadcasting: [B, H] against [S, B, H] follows x's dim 1 (written
    here from the formula)."""
    s = f64(x) + f64(gate) * f64(upd)
    m = s.mean(-1, keepdims=True)
    y = (s - m) / np.sqrt(((s - m) ** 2).mean(-1, keepdims=True) + eps)
    y = y * (1.0 if w is None else f64(w)) + (0.0 if b is None else f64(b))
    return y * (1.0 + f64(scale)) + f64(shift), s


@pytest.mark.parametrize("affine", [False, True])
def test_gated_adaln_zero_op_modulation_axis(affine):
    shape = (7, 3, 48)
    x, upd = rand(*shape, scale=2.0, offset=0.5), rand(*shape)
    gate, shift, scale = rand(3, 48, offset=0.5), rand(3, 48), rand(3, 48, scale=0.5)
    w = rand(48, offset=1.0, scale=0.3) if affine else None
    b = rand(48, scale=0.3) if affine else None
    y, s = torch.ops.normexport.gated_adaln_zero(x, upd, gate, shift, scale, w, b, 1e-6, 1)
    ref_y, ref_s = _seq_first_gated(x, upd, gate, shift, scale, w, b)
    assert rel_err(s, ref_s) < 1e-6 and rel_err(y, ref_y) < 1e-5
    spec_y, spec_s = gated_adaln_zero.reference(f64(x), f64(upd), f64(gate), f64(shift), f64(scale), f64(w), f64(b),
                                                1e-6, modulation_axis=1)
    np.testing.assert_allclose(spec_y, ref_y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("affine", [False, True])
def test_gated_adaln_zero_body_modulation_axis(dtype, affine):
    """The body declaring modulation_axis, in onnxruntime, at S = B (where the default layout would
    also run): both outputs against float64; without the attribute the same inputs are measurably off."""
    shape = (4, 4, 64)
    inputs = {"X": rand(*shape, dtype=dtype, scale=2.0, offset=0.5), "update": rand(*shape, dtype=dtype),
              "gate": rand(4, 64, dtype=dtype, offset=0.5), "shift": rand(4, 64, dtype=dtype),
              "scale": rand(4, 64, dtype=dtype, scale=0.5)}
    if affine:
        inputs |= {"weight": rand(64, dtype=dtype, offset=1.0, scale=0.3), "bias": rand(64, dtype=dtype, scale=0.3)}
    y, s = _one_node("GatedAdaLNZero", inputs, {"epsilon": 1e-6, "modulation_axis": 1}, dtype)
    ref_y, ref_s = _seq_first_gated(*inputs.values())
    assert rel_err(s, ref_s) < TOL[dtype] and rel_err(y, ref_y) < TOL[dtype]
    wrong_y, _ = _one_node("GatedAdaLNZero", inputs, {"epsilon": 1e-6}, dtype)
    assert rel_err(wrong_y, ref_y) > 1e-2
