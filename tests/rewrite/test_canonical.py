"""normexport/rewriter/canonical.py: each canonical step on a small graph (its structure after, and
its outputs equal to the original's in onnxruntime), and the driver around it (issue 29, docs/design.md §11)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common  # noqa: F401
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from normexport.rewriter import RewriteReport, canonical, rewrite

F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), opset=13):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _vi(name, shape, t=F):
    return helper.make_tensor_value_info(name, t, shape)


def _init(name, a):
    return numpy_helper.from_array(np.asarray(a), name)


def _canon(proto, notes=None):
    m = ir.serde.deserialize_model(proto)
    ir.passes.common.ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(m)
    done = canonical.canonicalize(m, notes)
    return ir.serde.serialize_model(m), done


def _run(proto, feeds):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _same(a, b, feeds, atol=1e-6):
    for x, y in zip(_run(a, feeds), _run(b, feeds)):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=atol)


def _ops(proto):
    return [n.op_type for n in proto.graph.node]


X = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)


def test_constant_nodes_become_initializers():
    c = helper.make_node("Constant", [], ["c"], value=_init("cv", np.float32(2.0)))
    p = _model([c, helper.make_node("Add", ["x", "c"], ["y"])], [_vi("x", [3, 8])], [_vi("y", [3, 8])])
    out, done = _canon(p)
    assert "Constant" not in _ops(out) and done.get("constants") == 1
    assert [i.name for i in out.graph.initializer] == ["c"]
    _same(p, out, {"x": X})


def test_fold_keeps_under_the_size_cap():
    """ConstantOfShape of a small shape folds to an initializer; one of 64 x 4096 elements (over
    FOLD_LIMIT) stays a node: a file is never inflated by a constant written out."""
    small = helper.make_node("ConstantOfShape", ["s_small"], ["z_small"], value=_init("v", np.array([1.0], np.float32)))
    big = helper.make_node("ConstantOfShape", ["s_big"], ["z_big"], value=_init("v2", np.array([1.0], np.float32)))
    nodes = [small, big, helper.make_node("Add", ["x", "z_small"], ["y"]),
             helper.make_node("ReduceSum", ["z_big"], ["t"], keepdims=0)]
    p = _model(nodes, [_vi("x", [3, 8])], [_vi("y", [3, 8]), _vi("t", [])],
               [_init("s_small", np.array([8], np.int64)), _init("s_big", np.array([64, 4096], np.int64))])
    out, _ = _canon(p)
    assert _ops(out).count("ConstantOfShape") == 1
    assert max(numpy_helper.to_array(i).size for i in out.graph.initializer) <= canonical.FOLD_LIMIT
    _same(p, out, {"x": X})


def test_identity_removed_by_the_fold():
    p = _model([helper.make_node("Identity", ["x"], ["i"]), helper.make_node("Relu", ["i"], ["y"])],
               [_vi("x", [3, 8])], [_vi("y", [3, 8])])
    out, done = _canon(p)
    assert _ops(out) == ["Relu"] and done.get("fold") == 1, done


def _keepdims0_ln_like(reshape=True):
    """tf2onnx (jax2tf) spelling: Σx over axis 1 with keepdims=0, · 1/n, Reshape to a run-time shape
    [N, 1] (from Shape(x)) and Expand to it, then Sub from x."""
    nodes = [
        helper.make_node("ReduceSum", ["x", "ax"], ["s"], keepdims=0),
        helper.make_node("Mul", ["s", "inv_n"], ["m"]),
        helper.make_node("Shape", ["x"], ["shp"]),
        helper.make_node("Slice", ["shp", "z", "o", "z"], ["n"]),
        helper.make_node("Concat", ["n", "o"], ["tgt"], axis=0),
    ]
    if reshape:
        nodes += [helper.make_node("Reshape", ["m", "tgt"], ["r"]), helper.make_node("Expand", ["r", "tgt"], ["e"])]
    else:
        nodes += [helper.make_node("Unsqueeze", ["m", "o"], ["e"])]
    nodes.append(helper.make_node("Sub", ["x", "e"], ["y"]))
    inits = [_init("ax", np.array([1], np.int64)), _init("inv_n", np.float32(1 / 8)),
             _init("z", np.array([0], np.int64)), _init("o", np.array([1], np.int64))]
    return _model(nodes, [_vi("x", ["N", 8])], [_vi("y", ["N", 8])], inits)


@pytest.mark.parametrize("reshape", [True, False], ids=["reshape_expand", "unsqueeze"])
def test_keepdims0_broadcast_back_becomes_keepdims1(reshape):
    p = _keepdims0_ln_like(reshape)
    out, done = _canon(p)
    assert done.get("keepdims") == 1, done
    ops = _ops(out)
    assert "Reshape" not in ops and "Expand" not in ops and "Unsqueeze" not in ops, ops
    red = next(n for n in out.graph.node if n.op_type.startswith("Reduce"))
    assert red.op_type == "ReduceMean" and helper.get_attribute_value(red.attribute[-1]) == 1  # keepdims=1
    _same(p, out, {"x": X})


def test_keepdims0_read_as_a_vector_stays():
    """A keepdims=0 statistic read by a MatMul (not a broadcast back) keeps its shape."""
    nodes = [helper.make_node("ReduceSum", ["x", "ax"], ["s"], keepdims=0), helper.make_node("MatMul", ["s", "w"], ["y"])]
    p = _model(nodes, [_vi("x", [3, 8, 4])], [_vi("y", [3, 2])],
               [_init("ax", np.array([1], np.int64)), _init("w", np.ones((4, 2), np.float32))])
    out, done = _canon(p)
    assert "keepdims" not in done
    assert helper.get_attribute_value(out.graph.node[0].attribute[0]) == 0


def test_expand_before_a_broadcasting_op_removed():
    """Expand(mean, Shape(x)) before Sub(x, ·): the Sub broadcasts the mean anyway."""
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[1]), helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Expand", ["m", "s"], ["e"]), helper.make_node("Sub", ["x", "e"], ["y"])]
    p = _model(nodes, [_vi("x", ["N", 8])], [_vi("y", ["N", 8])])
    out, done = _canon(p)
    assert "Expand" not in _ops(out) and done["broadcast"] == 1
    _same(p, out, {"x": X})


def test_div_by_a_constant_becomes_mul():
    p = _model([helper.make_node("Div", ["x", "c"], ["y"])], [_vi("x", [3, 8])], [_vi("y", [3, 8])],
               [_init("c", np.float32(4.0))])
    out, done = _canon(p)
    assert _ops(out) == ["Mul"] and done["div_constant"] == 1
    assert float(numpy_helper.to_array(out.graph.initializer[0])) == 0.25
    _same(p, out, {"x": X})


@pytest.mark.parametrize("opset", [13, 18])
def test_reduce_sum_times_one_over_n_is_reduce_mean(opset):
    axes = [_init("ax", np.array([-1], np.int64))]
    nodes = [helper.make_node("ReduceSum", ["x", "ax"], ["s"], keepdims=1), helper.make_node("Mul", ["k", "s"], ["y"])]
    p = _model(nodes, [_vi("x", [3, 8])], [_vi("y", [3, 1])], axes + [_init("k", np.float32(1 / 8))], opset=opset)
    out, done = _canon(p)
    assert _ops(out) == ["ReduceMean"] and done["sum_to_mean"] == 1
    _same(p, out, {"x": X})


def test_reduce_sum_times_another_factor_stays_with_a_note():
    nodes = [helper.make_node("ReduceSum", ["x", "ax"], ["s"], keepdims=1), helper.make_node("Mul", ["s", "k"], ["y"])]
    p = _model(nodes, [_vi("x", [3, 8])], [_vi("y", [3, 1])],
               [_init("ax", np.array([-1], np.int64)), _init("k", np.float32(1 / 7))])
    notes: list[str] = []
    out, done = _canon(p, notes)
    assert "ReduceSum" in _ops(out) and "sum_to_mean" not in done
    assert any("is not 1/n" in n for n in notes), notes


def test_global_average_pool_is_reduce_mean_and_restored_when_unused():
    p = _model([helper.make_node("GlobalAveragePool", ["x"], ["y"])], [_vi("x", [2, 3, 4, 5])], [_vi("y", [2, 3, 1, 1])])
    out, done = _canon(p)
    assert _ops(out) == ["ReduceMean"] and done["gap_to_mean"] == 1
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 5)).astype(np.float32)
    _same(p, out, {"x": x})
    m = ir.serde.deserialize_model(out)
    assert canonical.restore(m) == 1
    assert _ops(ir.serde.serialize_model(m)) == ["GlobalAveragePool"]


@pytest.mark.parametrize("form", ["pow", "div1"])
def test_inverse_roots_are_reciprocal_of_sqrt(form):
    if form == "pow":
        nodes = [helper.make_node("Pow", ["x", "h"], ["y"])]
        inits = [_init("h", np.float32(-0.5))]
    else:
        nodes = [helper.make_node("Sqrt", ["x"], ["r"]), helper.make_node("Div", ["one", "r"], ["y"])]
        inits = [_init("one", np.float32(1.0))]
    p = _model(nodes, [_vi("x", [3, 8])], [_vi("y", [3, 8])], inits)
    out, done = _canon(p)
    assert _ops(out) == ["Sqrt", "Reciprocal"] and done["inverse_root"] == 1
    _same(p, out, {"x": np.abs(X) + 0.1})


def _conv_model(op="Conv", tail=("bias",), weight_input=False):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 3, 3, 3) if op == "Conv" else (3, 4, 3, 3)).astype(np.float32)
    nodes = [helper.make_node(op, ["x", "w"], ["c0"], pads=[1, 1, 1, 1] if op == "Conv" else [0, 0, 0, 0])]
    inits = [] if weight_input else [_init("w", w)]
    cur = "c0"
    for i, t in enumerate(tail):
        out = f"t{i}"
        if t == "bias":
            nodes.append(helper.make_node("Add", [cur, f"b{i}"], [out]))
            inits.append(_init(f"b{i}", rng.standard_normal((1, 4, 1, 1)).astype(np.float32)))
        elif t in ("mul", "add"):  # paddle2onnx's learnable affine: a scalar each
            nodes.append(helper.make_node(t.capitalize(), [cur, f"k{i}"], [out]))
            inits.append(_init(f"k{i}", np.array([1.7 if t == "mul" else 0.4], np.float32)))
        elif t == "bn":
            nodes.append(helper.make_node("BatchNormalization", [cur, "bs", "bb", "bm", "bv"], [out], epsilon=1e-5))
            inits += [_init("bs", rng.uniform(0.5, 1.5, 4).astype(np.float32)), _init("bb", rng.standard_normal(4).astype(np.float32)),
                      _init("bm", rng.standard_normal(4).astype(np.float32)), _init("bv", rng.uniform(0.5, 2, 4).astype(np.float32))]
        cur = out
    nodes.append(helper.make_node("Relu", [cur], ["y"]))
    ins = [_vi("x", [1, 3, 6, 6])] + ([_vi("w", list(w.shape))] if weight_input else [])
    return _model(nodes, ins, [_vi("y", None)], inits), w


X4 = np.random.default_rng(3).random((1, 3, 6, 6)).astype(np.float32)


def test_conv_bias_add_becomes_the_conv_bias():
    p, _ = _conv_model(tail=("bias",))
    out, done = _canon(p)
    assert _ops(out) == ["Conv", "Relu"] and len(out.graph.node[0].input) == 3 and done["conv_bias"] == 1
    _same(p, out, {"x": X4})


def test_conv_transpose_bias_add_batchnorm_folds():
    """paddle2onnx: ConvTranspose, its bias as an Add, then BatchNormalization: one ConvTranspose after rewrite."""
    p, _ = _conv_model("ConvTranspose", ("bias", "bn"))
    rep = RewriteReport()
    out = rewrite(p, target="ort", report=rep)
    assert _ops(out) == ["ConvTranspose", "Relu"], rep.summary()
    _same(p, out, {"x": X4}, atol=1e-5)


def test_conv_learnable_affine_folds_into_the_conv():
    """paddle2onnx's learnable affine block: Conv (+ bias Add) -> Mul(c) -> Add(c): one Conv after rewrite."""
    p, _ = _conv_model(tail=("bias", "mul", "add"))
    rep = RewriteReport()
    out = rewrite(p, target="ort", report=rep)
    assert _ops(out) == ["Conv", "Relu"], rep.summary()
    assert rep.rules["FoldConvBN"].applied == 1
    _same(p, out, {"x": X4}, atol=1e-5)


def test_conv_affine_with_a_weight_input_is_left_as_it_was():
    p, w = _conv_model(tail=("mul", "add"), weight_input=True)
    out, done = _canon(p)
    assert "conv_affine" not in done and "BatchNormalization" not in _ops(out)


def test_batchnorm_without_a_conv_before_is_left_for_ort():
    """A BatchNormalization behind a Relu (openwakeword's embedding model): nothing to fold into; for
    --target ort the file comes back as it was."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("BatchNormalization", ["r", "s", "b", "m", "v"], ["y"])]
    inits = [_init(k, rng.uniform(0.5, 1.5, 3).astype(np.float32)) for k in "sbmv"]
    p = _model(nodes, [_vi("x", [1, 3, 4, 4])], [_vi("y", [1, 3, 4, 4])], inits)
    out = rewrite(p, target="ort")
    assert out.SerializeToString() == p.SerializeToString()


def test_nothing_fused_gives_the_model_as_it_came():
    """Canonical forms are applied (Div by a constant -> Mul) but no rule fuses: the original."""
    p = _model([helper.make_node("Div", ["x", "c"], ["y"])], [_vi("x", [3, 8])], [_vi("y", [3, 8])],
               [_init("c", np.float32(4.0))])
    rep = RewriteReport()
    out = rewrite(p, report=rep)
    assert rep.applied == 0 and rep.canonical.get("div_constant") == 1
    assert out.SerializeToString() == p.SerializeToString()


def test_an_empty_file_is_refused_and_nothing_written(tmp_path, cli):
    """An empty file parses as an empty ModelProto (no graph): exit 2, one line, no output file."""
    src, dst = tmp_path / "empty.onnx", tmp_path / "out.onnx"
    src.write_bytes(b"")
    code, out, err = cli("rewrite", src, "-o", dst)
    assert code == 2 and not dst.exists()
    assert len(err.strip().splitlines()) == 1 and "no nodes and no outputs" in err, err


def test_batchnorm_statistics_from_constant_of_shape_fold_into_the_conv():
    """BN running mean / var written as ConstantOfShape (zeros / ones) and the scale as a Constant node:
    constants after the fold, so Conv + BN folds (before issue 29: 'non-constant running stats')."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("ConstantOfShape", ["four"], ["mean"], value=_init("z", np.array([0.0], np.float32))),
             helper.make_node("ConstantOfShape", ["four"], ["var"], value=_init("o", np.array([1.0], np.float32))),
             helper.make_node("Constant", [], ["scale"], value=_init("sv", rng.uniform(0.5, 1.5, 4).astype(np.float32))),
             helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["b"]),
             helper.make_node("Relu", ["b"], ["y"])]
    p = _model(nodes, [_vi("x", [1, 3, 6, 6])], [_vi("y", [1, 4, 6, 6])],
               [_init("w", w), _init("four", np.array([4], np.int64)), _init("bias", rng.standard_normal(4).astype(np.float32))])
    rep = RewriteReport()
    out = rewrite(p, target="ort", report=rep)
    assert _ops(out) == ["Conv", "Relu"], rep.summary()
    _same(p, out, {"x": X4}, atol=1e-5)


def test_layer_norm_with_global_average_pool_means_over_a_transposed_tensor_fuses():
    """A LayerNorm over the last axis of [N, C, L] written with GlobalAveragePool for both means,
    over Transpose(x): GlobalAveragePool is ReduceMean over the trailing axis in canonical forms, and
    the layer_norm rule takes it."""
    rng = np.random.default_rng(6)
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
             helper.make_node("GlobalAveragePool", ["t"], ["m"]),
             helper.make_node("Sub", ["t", "m"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["d2"]),
             helper.make_node("GlobalAveragePool", ["d2"], ["v"]),
             helper.make_node("Add", ["v", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["s"]),
             helper.make_node("Div", ["d", "s"], ["n"]),
             helper.make_node("Mul", ["n", "w"], ["nw"]),
             helper.make_node("Add", ["nw", "b"], ["y"])]
    p = _model(nodes, [_vi("x", [2, 8, 6])], [_vi("y", [2, 6, 8])],
               [_init("eps", np.float32(1e-5)), _init("w", rng.uniform(0.5, 1.5, 8).astype(np.float32)),
                _init("b", rng.standard_normal(8).astype(np.float32))])
    rep = RewriteReport()
    out = rewrite(p, target="onnx", report=rep)
    assert _ops(out) == ["Transpose", "LayerNormalization"], rep.summary()
    x = (rng.standard_normal((2, 8, 6)) * 3 + 1).astype(np.float32)
    _same(p, out, {"x": x}, atol=1e-5)
