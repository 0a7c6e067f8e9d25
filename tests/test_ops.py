"""The two custom ops (docs/design.md §2): torch op, ONNX function body in onnxruntime, torch.onnx export,
all against float64 references written from the formulas."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from normexport import ops
from normexport.prepare.nn import AdaLNZero, RMSNorm
from normexport.ops import adaln_zero, rms_norm

G = torch.Generator().manual_seed(0)
ONNX_TYPE = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16, torch.bfloat16: TensorProto.BFLOAT16}
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # docs/design.md §7 (relative)


def rand(*shape, dtype=torch.float32, scale=1.0, offset=0.0):
    return (torch.randn(*shape, generator=G) * scale + offset).to(dtype)


def rel_err(got, ref) -> float:
    got = np.asarray(got.float() if isinstance(got, torch.Tensor) else got, dtype=np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def f64(t):
    return t.double().numpy()


def test_references_follow_the_formulas():
    x = np.array([[1.0, 2.0, 3.0, 4.0]])
    w = np.array([1.0, 0.5, 2.0, -1.0])
    np.testing.assert_allclose(rms_norm.reference(x, w, 0.0), x / np.sqrt(7.5) * w)
    mu, var = 2.5, 1.25
    np.testing.assert_allclose(adaln_zero.reference(x, np.ones((1, 4)), np.full((1, 4), 2.0), epsilon=0.0),
                               (x - mu) / np.sqrt(var) * 3.0 + 1.0)


# ---- torch custom ops --------------------------------------------------------------------------
@pytest.mark.parametrize("shape,axis", [((2, 5, 64), -1), ((3, 37), -1), ((2, 4, 6, 10), -2), ((2, 4, 7), 1)])
def test_rms_norm_op_fp32(shape, axis):
    x = rand(*shape)
    w = rand(*shape[axis % len(shape):], offset=1.0, scale=0.3)
    y = torch.ops.normexport.rms_norm(x, w, 1e-5, axis)
    assert rel_err(y, rms_norm.reference(f64(x), f64(w), 1e-5, axis)) < 1e-6


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("shape", [(2, 9, 48), (3, 37), (2, 3, 4, 33)])
def test_adaln_zero_op_fp32(shape, affine, full):
    x = rand(*shape, scale=2.0, offset=0.5)
    mod_shape = shape if full else (shape[0], shape[-1])
    shift, scale = rand(*mod_shape), rand(*mod_shape, scale=0.5)
    w = rand(shape[-1], offset=1.0, scale=0.3) if affine else None
    b = rand(shape[-1], scale=0.3) if affine else None
    y = AdaLNZero(shape[-1], 1e-6, w, b)(x, shift, scale)
    ref = adaln_zero.reference(f64(x), f64(shift), f64(scale), None if w is None else f64(w), None if b is None else f64(b), 1e-6)
    assert rel_err(y, ref) < 1e-6


# ---- ONNX function bodies in plain onnxruntime ---------------------------------------------------
def single_node_model(op_type, inputs: dict, opset: int, dtype, **attrs) -> onnx.ModelProto:
    """One normexport node on `dtype` tensors; graph IO in float32 with Casts around it (so that
    bfloat16 can be fed from numpy)."""
    t = ONNX_TYPE[dtype]
    casts = [helper.make_node("Cast", [n], [n + "_t"], to=t) for n in inputs]
    node = helper.make_node(op_type, [n + "_t" for n in inputs], ["Y_t"], domain=ops.DOMAIN, **attrs)
    out = helper.make_node("Cast", ["Y_t"], ["Y"], to=TensorProto.FLOAT)
    rank = next(iter(inputs.values())).dim()
    graph = helper.make_graph(
        casts + [node, out], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None] * v.dim()) for n, v in inputs.items()],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None] * rank)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    ops.attach_functions(model)
    onnx.checker.check_model(model, full_check=True)
    return model


def ort_run(model, inputs: dict):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {k: v.float().numpy() for k, v in inputs.items()})[0]


def no_worse_than_eager(err: float, eager: float, dtype) -> bool:
    """docs/design.md §7: within tolerance and, for half types, no worse than eager PyTorch in the same
    dtype (one final rounding of slack); fp32 errors are rounding noise: at most 2x eager's."""
    floor = torch.finfo(dtype).eps
    if dtype == torch.float32:
        return err <= TOL[dtype] and err <= 2 * max(eager, floor)
    return err <= TOL[dtype] and err <= max(eager, floor)


@pytest.mark.parametrize("opset", [18, 20, 23])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_function_body(opset, dtype):
    x = rand(3, 7, 37, scale=3.0, dtype=dtype)
    w = rand(37, offset=1.0, scale=0.3, dtype=dtype)
    model = single_node_model("RMSNorm", {"X": x, "scale": w}, opset, dtype, epsilon=1e-5)
    got = ort_run(model, {"X": x, "scale": w})
    ref = rms_norm.reference(f64(x), f64(w), 1e-5)
    err = rel_err(torch.from_numpy(got), ref)
    eager = rel_err(torch.nn.functional.rms_norm(x, (37,), w, 1e-5), ref)  # PyTorch's own op, same dtype
    assert no_worse_than_eager(err, eager, dtype), (err, eager)


def test_rms_norm_function_body_axis_attribute():
    x, w = rand(2, 3, 4, 5), rand(4, 5, offset=1.0, scale=0.3)
    model = single_node_model("RMSNorm", {"X": x, "scale": w}, 20, torch.float32, axis=-2, epsilon=1e-3)
    assert rel_err(torch.from_numpy(ort_run(model, {"X": x, "scale": w})), rms_norm.reference(f64(x), f64(w), 1e-3, -2)) < 1e-6
    model = single_node_model("RMSNorm", {"X": x, "scale": w}, 20, torch.float32, axis=2)  # default epsilon
    assert rel_err(torch.from_numpy(ort_run(model, {"X": x, "scale": w})), rms_norm.reference(f64(x), f64(w), 1e-6, 2)) < 1e-6


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_adaln_zero_function_body(affine, full, dtype):
    shape = (2, 6, 33)
    x = rand(*shape, scale=2.0, offset=0.5, dtype=dtype)
    mod_shape = shape if full else (2, 33)
    inputs = {"X": x, "shift": rand(*mod_shape, dtype=dtype), "scale": rand(*mod_shape, scale=0.5, dtype=dtype)}
    if affine:
        inputs.update(weight=rand(33, offset=1.0, scale=0.3, dtype=dtype), bias=rand(33, scale=0.3, dtype=dtype))
    model = single_node_model("AdaLNZero", inputs, 20, dtype, epsilon=1e-5)
    got = ort_run(model, inputs)
    ref = adaln_zero.reference(*[f64(v) for v in inputs.values()], epsilon=1e-5)
    err = rel_err(torch.from_numpy(got), ref)
    # eager PyTorch in the same dtype: F.layer_norm + modulate, as DiT writes it
    sh, sc = inputs["shift"], inputs["scale"]
    if not full:
        sh, sc = sh.unsqueeze(1), sc.unsqueeze(1)
    eager = torch.nn.functional.layer_norm(x, (33,), inputs.get("weight"), inputs.get("bias"), 1e-5) * (1 + sc) + sh
    assert no_worse_than_eager(err, rel_err(eager, ref), dtype), (err, rel_err(eager, ref))


def test_function_needs_opset_18():
    with pytest.raises(ValueError, match="opset >= 18"):
        ops.SPECS["RMSNorm"].function_proto(17, 2)


def test_mixed_adaln_arity_is_refused():
    nodes = [helper.make_node("AdaLNZero", ["X", "s", "c"], ["A"], domain=ops.DOMAIN),
             helper.make_node("AdaLNZero", ["A", "s", "c", "w", "b"], ["Y"], domain=ops.DOMAIN)]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("X", "s", "c", "w", "b")]
    model = helper.make_model(helper.make_graph(nodes, "g", vi, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)]),
                              opset_imports=[helper.make_opsetid("", 20)])
    with pytest.raises(ValueError, match="one form"):
        ops.attach_functions(model)


def test_schema_registered_from_spec():
    schema = onnx.defs.get_schema("RMSNorm", 1, ops.DOMAIN)
    assert set(schema.attributes) == {"axis", "epsilon", "plugin_namespace", "plugin_version"}
    assert schema.attributes["epsilon"].default_value.f == pytest.approx(1e-6)
    assert schema.attributes["plugin_namespace"].default_value.s == b"normexport"
    assert schema.attributes["plugin_version"].default_value.s == b"1"
    assert [i.name for i in onnx.defs.get_schema("AdaLNZero", 1, ops.DOMAIN).inputs] == ["X", "shift", "scale", "weight", "bias"]


# ---- torch.onnx (dynamo) export with the translation table ----------------------------------------
class TwoOps(torch.nn.Module):
    def __init__(self, hidden=37, affine=False):
        super().__init__()
        self.norm = RMSNorm(rand(hidden, offset=1.0, scale=0.3), eps=1e-5)
        self.mod = AdaLNZero(hidden, 1e-6, rand(hidden, offset=1.0, scale=0.3) if affine else None,
                             rand(hidden, scale=0.3) if affine else None)
        self.hidden = hidden

    def forward(self, x, c):
        shift, scale = c.chunk(2, dim=-1)
        return self.mod(self.norm(x), shift, scale)


@pytest.mark.parametrize("affine", [False, True])
def test_export_with_dynamic_batch_and_sequence(affine):
    m = TwoOps(affine=affine).eval()
    x, c = rand(2, 5, 37), rand(2, 74)
    b, s = torch.export.Dim("b"), torch.export.Dim("s")
    program = torch.onnx.export(m, (x, c), dynamo=True, custom_translation_table=ops.TRANSLATION_TABLE,
                                dynamic_shapes=({0: b, 1: s}, {0: b}), verbose=False)
    model = ops.attach_functions(program.model_proto)
    onnx.checker.check_model(model, full_check=True)
    custom = [n.op_type for n in ops.custom_nodes(model)]
    assert custom == ["RMSNorm", "AdaLNZero"]
    assert {(f.domain, f.name) for f in model.functions} == {(ops.DOMAIN, "RMSNorm"), (ops.DOMAIN, "AdaLNZero")}
    assert any(o.domain == ops.DOMAIN and o.version == 1 for o in model.opset_import)
    # TensorRT's ONNX parser uses the plugin (not the function body) only for nodes that name it.
    for node in ops.custom_nodes(model):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["plugin_namespace"] == b"normexport" and attrs["plugin_version"] == b"1", node
    x2, c2 = rand(3, 11, 37), rand(3, 74)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, dict(zip([i.name for i in sess.get_inputs()], (x2.numpy(), c2.numpy()))))[0]
    h = rms_norm.reference(f64(x2), f64(m.norm.weight.data), 1e-5)
    ref = adaln_zero.reference(h, f64(c2[:, :37]), f64(c2[:, 37:]),
                               None if m.mod.weight is None else f64(m.mod.weight.data),
                               None if m.mod.bias is None else f64(m.mod.bias.data), 1e-6)
    assert rel_err(torch.from_numpy(got), ref) < 1e-5


def test_plugin_header_generated_from_the_specs():
    """plugins/tensorrt/opSpecs.h (names, fields, defaults of the TensorRT plugins) is what the op
    specs generate, and the plugin sources take every name from it instead of spelling it."""
    import pathlib
    import re

    from normexport.ops import SPECS, plugin_fields

    assert plugin_fields.HEADER.read_text() == plugin_fields.render(), (
        "plugins/tensorrt/opSpecs.h is stale: run python -m normexport.ops.plugin_fields")
    assert plugin_fields.main(["--check"]) == 0
    header = plugin_fields.render()
    for name in ops.PLUGIN_ATTRIBUTES:  # read by the ONNX parser to find the plugin, never plugin fields
        assert name not in header
    for spec in SPECS.values():
        assert f'kNAME{{"{spec.name}"}}' in header
        for a in spec.attributes:
            assert f'k{a.name.upper()}{{"{a.name}"}}' in header
    sources = "".join(p.read_text() for p in (pathlib.Path(plugin_fields.HEADER).parent).glob("*.cpp"))
    spelled = {a.name for s in SPECS.values() for a in s.attributes} | set(SPECS) | {"normexport"}
    for name in spelled:
        assert not re.search(rf'"{name}"', sources), f'plugin sources spell "{name}": use opSpecs.h'


# ---- modulation_axis: a [B, H] modulation following another dim of X -------------------------------
def seq_first_formula(x, shift, scale, w=None, b=None, eps=1e-6):
    """float64 LayerNorm(x) * (1 + scale) + shift with numpy broadcasting aligning the trailing dims:
    a [B, H] shift / scale over x [S, B, H] follows x's dim 1 (written here, not the spec's reference)."""
    x = np.asarray(x, np.float64)
    m = x.mean(-1, keepdims=True)
    y = (x - m) / np.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + eps)
    y = y * (1.0 if w is None else np.asarray(w, np.float64)) + (0.0 if b is None else np.asarray(b, np.float64))
    return y * (1.0 + np.asarray(scale, np.float64)) + np.asarray(shift, np.float64)


def test_reference_modulation_axis():
    x = rand(5, 3, 16, scale=2.0, offset=0.5)
    shift, scale = rand(3, 16), rand(3, 16, scale=0.5)
    np.testing.assert_allclose(adaln_zero.reference(f64(x), f64(shift), f64(scale), epsilon=1e-6, modulation_axis=1),
                               seq_first_formula(f64(x), f64(shift), f64(scale)), rtol=1e-12, atol=1e-12)
    x4 = rand(2, 3, 4, 16)
    s4 = rand(3, 16)  # x's dim 1 of four: [3, H] viewed as [1, 3, 1, H]
    want = seq_first_formula(f64(x4), f64(s4)[None, :, None], f64(s4)[None, :, None])
    np.testing.assert_allclose(adaln_zero.reference(f64(x4), f64(s4), f64(s4), modulation_axis=1), want, rtol=1e-12)
    for bad in (-1, 2):
        with pytest.raises(ValueError, match="modulation_axis"):
            adaln_zero.reference(f64(x), f64(shift), f64(scale), modulation_axis=bad)


@pytest.mark.parametrize("affine", [False, True])
def test_adaln_zero_op_modulation_axis(affine):
    """torch.ops.normexport.adaln_zero(..., modulation_axis=1) on x [S, B, H] (S != B), also as
    prepare.nn.AdaLNZero(modulation_axis=1); a [S, H] modulation does not fit it."""
    x = rand(7, 3, 40, scale=2.0, offset=0.5)
    shift, scale = rand(3, 40), rand(3, 40, scale=0.5)
    w = rand(40, offset=1.0, scale=0.3) if affine else None
    b = rand(40, scale=0.3) if affine else None
    y = torch.ops.normexport.adaln_zero(x, shift, scale, w, b, 1e-6, 1)
    ref = seq_first_formula(f64(x), f64(shift), f64(scale), None if w is None else f64(w),
                            None if b is None else f64(b))
    assert rel_err(y, ref) < 1e-6
    assert rel_err(AdaLNZero(40, 1e-6, w, b, modulation_axis=1)(x, shift, scale), ref) < 1e-6
    with pytest.raises(RuntimeError):
        torch.ops.normexport.adaln_zero(x, rand(7, 40), rand(7, 40), w, b, 1e-6, 1)


@pytest.mark.parametrize("shape, axis", [((5, 3, 33), 1), ((2, 3, 4, 33), 1), ((2, 3, 4, 33), 2), ((5, 1, 33), 1)])
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_adaln_zero_function_body_modulation_axis(shape, axis, affine, dtype):
    """The function body of a node with modulation_axis in plain onnxruntime (the body that declares
    the attribute comes with it), against float64 from numpy broadcasting; no worse than eager
    PyTorch in the same dtype."""
    x = rand(*shape, scale=2.0, offset=0.5, dtype=dtype)
    mod = (shape[axis], shape[-1])
    inputs = {"X": x, "shift": rand(*mod, dtype=dtype), "scale": rand(*mod, scale=0.5, dtype=dtype)}
    if affine:
        inputs.update(weight=rand(33, offset=1.0, scale=0.3, dtype=dtype), bias=rand(33, scale=0.3, dtype=dtype))
    model = single_node_model("AdaLNZero", inputs, 20, dtype, epsilon=1e-5, modulation_axis=axis)
    (fn,) = model.functions
    assert "modulation_axis" in {a.name for a in fn.attribute_proto}
    got = ort_run(model, inputs)
    view = [1] * len(shape)
    view[axis], view[-1] = mod
    sh, sc = inputs["shift"].reshape(view), inputs["scale"].reshape(view)
    w, b = inputs.get("weight"), inputs.get("bias")
    ref = seq_first_formula(f64(x), f64(sh), f64(sc), None if w is None else f64(w), None if b is None else f64(b),
                            1e-5)
    err = rel_err(torch.from_numpy(got), ref)
    eager = torch.nn.functional.layer_norm(x, (33,), w, b, 1e-5) * (1 + sc) + sh
    assert no_worse_than_eager(err, rel_err(eager, ref), dtype), (err, rel_err(eager, ref))


def test_function_body_modulation_axis_catches_the_default_layout():
    """S = B: a body that ignored modulation_axis (the default [B, 1, H] view) would run, and be off."""
    x, shift, scale = rand(4, 4, 16, scale=2.0), rand(4, 16), rand(4, 16, scale=0.5)
    inputs = {"X": x, "shift": shift, "scale": scale}
    ref = seq_first_formula(f64(x), f64(shift), f64(scale), eps=1e-5)
    got = ort_run(single_node_model("AdaLNZero", inputs, 18, torch.float32, epsilon=1e-5, modulation_axis=1), inputs)
    wrong = ort_run(single_node_model("AdaLNZero", inputs, 18, torch.float32, epsilon=1e-5), inputs)
    assert rel_err(torch.from_numpy(got), ref) < 1e-6 and rel_err(torch.from_numpy(wrong), ref) > 1e-2


def test_default_nodes_keep_the_body_without_modulation_axis():
    """A model whose AdaLNZero nodes leave modulation_axis out gets the function as it was before the
    attribute (not declaring it), so its file does not change; one node carrying it gets the other."""
    spec = ops.SPECS["AdaLNZero"]
    plain, full = spec.function_proto(18, 3), spec.function_proto(18, 3, {"epsilon", "modulation_axis"})
    assert {a.name for a in plain.attribute_proto} == {"epsilon", "plugin_namespace", "plugin_version"}
    assert {a.name for a in full.attribute_proto} == {"epsilon", "modulation_axis", "plugin_namespace",
                                                      "plugin_version"}
    assert plain.name == full.name == "AdaLNZero"
    assert spec.function_proto(18, 3, {"epsilon"}).SerializeToString() == plain.SerializeToString()
    # optional in the schema with no default there (torch.onnx would write a default into every node);
    # the default, 0, is the body's
    for op_type in ("AdaLNZero", "GatedAdaLNZero"):
        attr = onnx.defs.get_schema(op_type, 1, ops.DOMAIN).attributes["modulation_axis"]
        assert not attr.required and attr.type == onnx.defs.OpSchema.AttrType.INT
        assert not attr.default_value.HasField("i") and not attr.default_value.name
    assert onnx.helper.get_attribute_value(next(a for a in full.attribute_proto if a.name == "modulation_axis")) == 0


class SeqFirstOps(torch.nn.Module):
    def __init__(self, axis):
        super().__init__()
        self.mod = AdaLNZero(24, 1e-6, rand(24, offset=1.0, scale=0.3), rand(24, scale=0.3), modulation_axis=axis)

    def forward(self, x, c):
        shift, scale = c.chunk(2, dim=-1)
        return self.mod(x, shift, scale)


def test_export_modulation_axis():
    """torch.onnx (dynamo) with the translation table: modulation_axis 1 becomes the node's
    attribute; left out of the node when 0. The file runs at other S and B than exported."""
    x, c = rand(5, 2, 24), rand(2, 48)
    s, b = torch.export.Dim("s"), torch.export.Dim("b")
    m = SeqFirstOps(1).eval()
    program = torch.onnx.export(m, (x, c), dynamo=True, custom_translation_table=ops.TRANSLATION_TABLE,
                                dynamic_shapes=({0: s, 1: b}, {0: b}), verbose=False)
    model = ops.attach_functions(program.model_proto)
    onnx.checker.check_model(model, full_check=True)
    (node,) = ops.custom_nodes(model)
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["modulation_axis"] == 1
    x2, c2 = rand(7, 3, 24), rand(3, 48)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, dict(zip([i.name for i in sess.get_inputs()], (x2.numpy(), c2.numpy()))))[0]
    ref = seq_first_formula(f64(x2), f64(c2[:, :24]), f64(c2[:, 24:]), f64(m.mod.weight.data), f64(m.mod.bias.data))
    assert rel_err(torch.from_numpy(got), ref) < 1e-5
    default = torch.onnx.export(TwoOps().eval(), (rand(2, 5, 37), rand(2, 74)), dynamo=True,
                                custom_translation_table=ops.TRANSLATION_TABLE, verbose=False).model_proto
    for n in ops.custom_nodes(default):
        assert "modulation_axis" not in {a.name for a in n.attribute}, n
