"""normexport.rewrite driver: per-rule verification, report, idempotence, files, CLI handler."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import onnx
import pytest

import normexport.rewriter as rw
from normexport.errors import UsageError
from normexport.rewriter import RewriteReport, cli, rewrite, rewrite_file
from normexport.rewriter.rules import rms_norm

sys.path.insert(0, os.path.dirname(__file__))
import _graphs as G  # noqa: E402


class _Mixed(__import__("torch").nn.Module):
    """LayerNorm + LLaMA-style RMSNorm blocks in one graph."""

    def __init__(self):
        super().__init__()
        self.ln = G.torch_layer_norm()
        self.rms = G.Stack(G.LlamaLikeRMSNorm, n=2)

    def forward(self, x):
        return self.rms(self.ln(x))


@pytest.fixture(scope="module")
def mixed():
    return G.legacy_export(_Mixed(), 11)


def test_input_not_mutated_and_idempotent(mixed):
    before = mixed.SerializeToString()
    rep = RewriteReport()
    once = rewrite(mixed, report=rep)
    assert mixed.SerializeToString() == before
    # the second RMSNorm's residual Add is fused too (SkipRMSNorm) since the canonical forms fold the
    # exporter's no-op Cast between them (issue 29)
    assert G.count(once, "LayerNormalization") == 1 and G.count(once, "RMSNorm", "normexport") == 1
    assert G.count(once, "SkipRMSNorm", "normexport") == 1
    assert rep.fused_ops()["layer_norm"] == 1 and rep.fused_ops()["rms_norm"] == 2
    rep2 = RewriteReport()
    twice = rewrite(once, report=rep2)
    assert twice == once and rep2.applied == 0
    x = G.xin(2, 3, G.H)
    G.assert_close(G.run(once, x=x)[0], G.run(mixed, x=x)[0], "mixed")


def test_report_dict_and_summary(mixed):
    rep = RewriteReport()
    rewrite(mixed, report=rep)
    d = rep.to_dict()
    assert d["command"] == "rewrite" and d["normexport_version"] and d["target"] == "trt"
    # x is [b, s, 8]: batch 2, the sequence 8 doubled (unlike the hidden size), found at the first try
    assert d["inputs"] == [{"name": "x", "shape": [2, 16, G.H], "dtype": "float"}]
    assert d["sizes"] == "discovered: tried 1 size set(s)"
    assert d["opset"] == {"before": 11, "after": 18}
    by_name = {r["name"]: r for r in d["rules"]}
    assert by_name["layer_norm_affine"]["applied"] == 1 and by_name["rms_norm_scale_left"]["applied"] == 2
    assert all({"name", "module", "matched", "applied", "rejected"} <= set(r) for r in d["rules"])
    out = d["backends"]["ort"]["y"]
    assert out["passed"] and {"max_abs_err", "max_rel_err", "mean_abs_err", "tolerance", "ref_err_fp64"} <= set(out)
    json.dumps(d)
    s = rep.summary()
    assert "4 fusion(s)" in s and "rms_norm_scale_left: matched 2, applied 2" in s
    assert "  verified at x: 2x16x8 (discovered: tried 1 size set(s))" in s.splitlines()


class _WrongEps(rms_norm.RMSNormFusion):
    def check(self, context, **kw):
        r = super().check(context, **kw)
        self._eps = 0.5  # a wrong fusion: verification must catch it
        return r


def test_numeric_verification_reverts_a_bad_rule(monkeypatch):
    bad = [_WrongEps.rule("rms_norm_scale_right", root="scale")]
    monkeypatch.setattr(rms_norm, "rules_for", lambda target: bad)
    model = G.rms_graph(scale="right")
    rep = RewriteReport()
    out = rewrite(model, report=rep)
    assert out == model and G.count(out, "RMSNorm") == 0
    rec = rep.rules["rms_norm_scale_right"]
    assert rec.matched == 1 and rec.applied == 0
    assert rec.rejected[0]["reason"].startswith("local verification: max abs err"), rec.rejected
    assert "NOT APPLIED: 1 fusion(s) failed local verification" in rep.summary()
    assert rep.nothing_verifiable
    # without verification the bad rewrite is kept (and is wrong)
    out2 = rewrite(model, verify=False)
    assert G.count(out2, "RMSNorm", "normexport") == 1
    x = G.xin(2, 3, G.H)
    assert np.abs(G.run(out2, x=x)[0] - G.rms_ref(x, G.WEIGHT)).max() > 1e-2


def test_missing_rule_module_reported(monkeypatch):
    monkeypatch.setattr(rw, "RULE_MODULES", ("no_such_rule_module",) + tuple(rw.RULE_MODULES))
    rep = RewriteReport()
    out = rewrite(G.rms_graph(), report=rep)
    assert rep.modules["no_such_rule_module"] == "not installed"
    assert G.count(out, "RMSNorm") == 1
    assert "module no_such_rule_module: not installed" in rep.summary()


def test_bad_target():
    with pytest.raises(ValueError, match="unknown target"):
        rewrite(G.rms_graph(), target="tensorrt")


def test_rewrite_file_external_data(tmp_path, mixed):
    src = tmp_path / "in" / "m.onnx"
    src.parent.mkdir()
    copy = onnx.ModelProto()
    copy.CopyFrom(mixed)  # onnx.save_model moves the data of the proto it saves
    onnx.save_model(copy, str(src), save_as_external_data=True, location="m.weights", size_threshold=0)
    assert (src.parent / "m.weights").exists()
    dst = tmp_path / "out.onnx"
    rep = rewrite_file(src, dst, report_path=tmp_path / "r.json")
    assert rep.applied == 4  # LayerNorm, 2 RMSNorm, one residual Add into SkipRMSNorm
    assert (tmp_path / "out.onnx.data").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".normexport-")]
    out = onnx.load(str(dst))
    assert G.count(out, "RMSNorm", "normexport") == 1 and G.count(out, "LayerNormalization") == 1
    x = G.xin(2, 3, G.H)
    G.assert_close(G.run(out, x=x)[0], G.run(mixed, x=x)[0])
    assert json.loads((tmp_path / "r.json").read_text())["rules"]


def _args(*argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_cli_default_output_and_report(tmp_path, capsys):
    src = tmp_path / "ln.onnx"
    onnx.save(G.ln_graph(), str(src))
    assert cli.run(_args(str(src), "--report", str(tmp_path / "rep.json"))) == 0
    out = onnx.load(str(tmp_path / "ln.trt.onnx"))
    assert G.op_types(out) == ["LayerNormalization"]
    assert "1 fusion(s)" in capsys.readouterr().out
    assert json.loads((tmp_path / "rep.json").read_text())["command"] == "rewrite"
    assert cli.run(_args(str(src), "--target", "onnx", "--no-verify")) == 0
    std = onnx.load(str(tmp_path / "ln.onnx.onnx"))  # <stem>.<target>.onnx
    assert G.op_types(std) == ["LayerNormalization"] and not std.functions


@pytest.mark.parametrize("problem", ["missing", "corrupt", "unwritable"])
def test_cli_usage_errors(tmp_path, problem):
    src = tmp_path / "m.onnx"
    if problem != "missing":
        src.write_bytes(b"not an onnx file" if problem == "corrupt" else G.ln_graph().SerializeToString())
    out = tmp_path / "no_such_dir" / "o.onnx" if problem == "unwritable" else tmp_path / "o.onnx"
    with pytest.raises(UsageError) as e:
        cli.run(_args(str(src), "-o", str(out)))
    assert "\n" not in str(e.value)
    assert not out.exists()


def test_bfloat16_model_is_verified_and_fused():
    """numpy has no bfloat16: the verifier feeds and reads it as raw 16-bit OrtValues
    (ml_dtypes), so a bf16 model's rewrites are verified, not rejected as unrunnable."""
    import ml_dtypes

    g = G.G(18)
    g.inputs[0] = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.BFLOAT16, ["B", "S", G.H])
    xf = g.node("Cast", "x", to=onnx.TensorProto.FLOAT)
    m = g.reduce_mean(xf, [-1])
    d = g.node("Sub", xf, m)
    var = g.reduce_mean(g.node("Mul", d, d), [-1])
    n = g.node("Div", d, g.node("Sqrt", g.node("Add", var, g.init(np.array(1e-5, np.float32)))))
    y = g.node("Cast", g.node("Mul", n, g.init(G.WEIGHT, "w")), to=onnx.TensorProto.BFLOAT16)
    g.nodes[-1].output[0] = "y"
    model = g.model()
    model.graph.output.append(onnx.helper.make_tensor_value_info("y", onnx.TensorProto.BFLOAT16, None))
    rep = RewriteReport()
    out = rewrite(model, target="trt", report=rep)
    assert G.count(out, "LayerNormalization") == 1, rep.summary()
    assert rep.verification and all(c.passed for c in rep.verification)
    x = G.xin(2, 3, G.H).astype(ml_dtypes.bfloat16)
    got = rw._verify.run(out, {"x": x})["y"]
    assert got.dtype == ml_dtypes.bfloat16
    ref = G.ln_ref(x.astype(np.float32), G.WEIGHT, None, 1e-5)
    assert np.max(np.abs(got.astype(np.float64) - ref)) <= 1.6e-2 * np.max(np.abs(ref))


class _WrongEpsAtOneSite(rms_norm.RMSNormFusion):
    """Fuses every site, but the one whose epsilon is 1e-3 with a wrong epsilon."""

    def check(self, context, **kw):
        r = super().check(context, **kw)
        if r and abs(self._eps - 1e-3) < 1e-9:
            self._eps = 0.5
        return r


def test_one_bad_site_does_not_revert_the_good_ones(monkeypatch):
    """Verification goes site by site when a rule's sites fail together: the good sites are kept,
    the bad one is reported with its node."""
    bad = [_WrongEpsAtOneSite.rule("rms_norm_scale_right", root="scale")]
    monkeypatch.setattr(rms_norm, "rules_for", lambda target: bad)
    g = G.G(18)
    x = "x"
    for eps in (1e-6, 1e-5, 1e-3):  # the bad one last: a later RMSNorm would hide its row scale
        ms = g.reduce_mean(g.node("Mul", x, x), [-1])
        n = g.node("Div", x, g.node("Sqrt", g.node("Add", ms, g.init(np.array(eps, np.float32), "eps"))))
        x = g.node("Mul", n, g.init(G.WEIGHT, "w"))
    model = g.model(x)
    rep = RewriteReport()
    out = rewrite(model, report=rep)
    rec = rep.rules["rms_norm_scale_right"]
    assert rec.applied == 2 and G.count(out, "RMSNorm", "normexport") == 2, rep.summary()
    assert len(rec.rejected) == 1 and rec.rejected[0]["reason"].startswith("local verification: max abs err")
    assert rec.rejected[0]["node"].startswith("Mul -> ")
    xin = G.xin(2, 3, G.H)
    ref = G.rms_ref(G.rms_ref(G.rms_ref(xin, G.WEIGHT, 1e-6), G.WEIGHT, 1e-5), G.WEIGHT, 1e-3)
    G.assert_close(G.run(out, x=xin)[0], ref)


def test_onnx_cpp_passes_run_without_the_weights():
    """The version converter gets the model with its large initializers as typed graph inputs (no
    C++ round trip of the weights): the converted model holds the very same tensor objects (lazy,
    memory-mapped ones stay so), an initializer that was also a graph input stays one, and the
    rewritten result runs."""
    import onnx_ir as ir

    big_w = np.random.default_rng(0).standard_normal((64, G.H)).astype(np.float32)  # > 1 KB
    g = G.G(14)
    g.inputs[0] = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", 64])
    y = g.node("MatMul", "x", g.init(big_w, "w"))
    ms = g.reduce_mean(g.node("Mul", y, y), [-1])
    n = g.node("Div", y, g.node("Sqrt", g.node("Add", ms, g.init(np.array(1e-6, np.float32), "eps"))))
    model = g.model(g.node("Mul", n, g.init(G.WEIGHT, "scale")))
    w_name = next(t.name for t in model.graph.initializer if t.name.startswith("w"))
    for overridable in (False, True):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        if overridable:  # an overridable initializer (also a graph input) stays an input
            proto.graph.input.append(onnx.helper.make_tensor_value_info(w_name, onnx.TensorProto.FLOAT, [64, G.H]))
        m = ir.serde.deserialize_model(proto)
        tensors = {k: v.const_value for k, v in m.graph.initializers.items()}
        inputs = [v.name for v in m.graph.inputs]
        up, how = rw.upgrade_opset(m, 18)
        assert "version_converter" in how and up.opset_imports[""] == 18
        assert all(up.graph.initializers[k].const_value is t for k, t in tensors.items())
        assert [v.name for v in up.graph.inputs] == inputs
        out = ir.serde.serialize_model(up)
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(next(t for t in out.graph.initializer if t.name == w_name)), big_w)
    rep = RewriteReport()
    out = rewrite(model, report=rep)
    assert G.count(out, "RMSNorm", "normexport") == 1, rep.summary()
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    G.assert_close(G.run(out, x=x)[0], G.rms_ref(x.astype(np.float64) @ big_w, G.WEIGHT))


def test_fused_nodes_name_the_plugin_and_hand_made_ones_get_it(mixed):
    """TensorRT's ONNX parser runs our plugin instead of the function body only for nodes with
    plugin_namespace / plugin_version: fused nodes have them, and nodes another tool wrote without
    them get them (said in the notes), with the same outputs in onnxruntime."""
    from normexport import ops

    first = RewriteReport()
    fused = rewrite(mixed, target="trt", report=first)
    assert ops.custom_nodes(fused)
    assert not any("plugin_namespace" in note for note in first.notes), first.notes  # our own nodes: no note
    for node in ops.custom_nodes(fused):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["plugin_namespace"] == b"normexport" and attrs["plugin_version"] == b"1"

    bare = onnx.ModelProto()
    bare.CopyFrom(fused)
    for node in ops.custom_nodes(bare):
        kept = [a for a in node.attribute if a.name not in ops.PLUGIN_ATTRIBUTES]
        del node.attribute[:]
        node.attribute.extend(kept)
    report = RewriteReport()
    again = rewrite(bare, target="trt", report=report)
    n = len(ops.custom_nodes(bare))
    assert any(f"to {n} normexport node(s)" in note for note in report.notes), report.notes
    assert all({a.name for a in node.attribute} >= set(ops.PLUGIN_ATTRIBUTES) for node in ops.custom_nodes(again))
    onnx.checker.check_model(again, full_check=True)
    x = G.xin(2, 3, G.H)
    np.testing.assert_array_equal(G.run(again, x=x)[0], G.run(bare, x=x)[0])


def _rms_then_sevens():
    """An RMSNorm whose output is reshaped to [-1, 7]: B * S * 8 must be a multiple of 7, which no
    common size makes it."""
    g = G.G(18)
    ms = g.reduce_mean(g.node("Mul", "x", "x"), [-1])
    n = g.node("Div", "x", g.node("Sqrt", g.node("Add", ms, g.init(np.array(1e-6, np.float32), "eps"))))
    y = g.node("Mul", n, g.init(G.WEIGHT, "w"))
    return g.model(g.node("Reshape", y, g.init(np.array([-1, 7], np.int64), "shape")))


def test_verification_sizes_given_or_none_found():
    """A model that runs at none of the common sizes: the fusion is verified locally all the same
    (docs/design.md §8: the local check needs only the RMSNorm's own shapes) and the whole-model extra says
    why it did not run; at sizes the caller gives, both run there; sizes that do not fit the
    model are a UsageError."""
    model = _rms_then_sevens()
    rep = RewriteReport()
    out = rewrite(model, report=rep)
    assert G.count(out, "RMSNorm", "normexport") == 1 and rep.applied == 1, rep.summary()
    (check,) = rep.local.checks
    assert check.passed and check.shapes == {"in0": [2, 16, G.H]} and check.err_fused <= check.tolerance
    assert rep.whole_model.startswith("not run: cannot run the original model") and "none of" in rep.whole_model
    assert "  whole-model comparison: not run" in rep.summary()
    x = G.xin(1, 7, G.H)
    G.assert_close(G.run(out, x=x)[0], G.rms_ref(x, G.WEIGHT).reshape(-1, 7))

    rep = RewriteReport()
    out = rewrite(model, report=rep, inputs={"x": [1, 7, G.H]})
    assert G.count(out, "RMSNorm", "normexport") == 1 and rep.applied == 1, rep.summary()
    assert rep.local.checks[0].shapes == {"in0": [1, 7, G.H]} and rep.whole_model == "passed"
    assert rep.to_dict()["inputs"] == [{"name": "x", "shape": [1, 7, G.H], "dtype": "float"}]
    assert "  verified at x: 1x7x8 (--input)" in rep.summary().splitlines()
    x = G.xin(1, 7, G.H)
    G.assert_close(G.run(out, x=x)[0], G.rms_ref(x, G.WEIGHT).reshape(-1, 7))

    with pytest.raises(UsageError, match="axis 2 is fixed to 8"):
        rewrite(model, inputs={"x": [1, 7, 4]})
    with pytest.raises(UsageError, match="does not run at the --input sizes"):
        rewrite(model, inputs={"x": [1, 3, G.H]})


def test_rewrite_file_twice_to_one_output_with_external_data(tmp_path, mixed):
    """-o over an existing output with external data works (the old .data replaced, not read), and
    both files get the umask's permissions (0644 under umask 022), like every tool users know."""
    src = tmp_path / "m.onnx"
    copy = onnx.ModelProto()
    copy.CopyFrom(mixed)
    onnx.save_model(copy, str(src), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    dst = tmp_path / "rw.onnx"
    old = os.umask(0o022)
    try:
        for _ in range(2):
            rep = rewrite_file(src, dst)
            assert rep.applied == 4
            for f in (dst, tmp_path / "rw.onnx.data"):
                assert (os.stat(f).st_mode & 0o777) == 0o644, oct(os.stat(f).st_mode)
    finally:
        os.umask(old)
    out = onnx.load(str(dst))
    x = G.xin(2, 3, G.H)
    G.assert_close(G.run(out, x=x)[0], G.run(mixed, x=x)[0])
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".normexport-")]


def test_cli_nothing_verifiable_exits_1_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """Never silent: a rewrite whose every match fails local verification says so in one line with
    the count and the cause, writes no file and exits 1."""
    monkeypatch.setattr(rms_norm, "rules_for", lambda target: [_WrongEps.rule("rms_norm_scale_right", root="scale")])
    src = tmp_path / "r.onnx"
    onnx.save(G.rms_graph(scale="right"), str(src))
    assert cli.run(_args(str(src), "-o", str(tmp_path / "o.onnx"))) == 1
    out = capsys.readouterr().out
    assert "NOT APPLIED: 1 fusion(s) failed local verification" in out and "not written" in out, out
    assert not (tmp_path / "o.onnx").exists()


def _typed_ops_then_rms(opset: int) -> onnx.ModelProto:
    """Reshape, Transpose, Cast, Cos (ops whose schemas changed between 20 and 23 by types only)
    around an RMSNorm pattern."""
    g = G.G(opset)
    r = g.node("Reshape", "x", g.init(np.array([0, 0, G.H], np.int64), "shape"))
    t = g.node("Transpose", g.node("Transpose", r, perm=[1, 0, 2]), perm=[1, 0, 2])
    c = g.node("Cast", g.node("Cos", g.node("Cast", t, to=onnx.TensorProto.DOUBLE)), to=onnx.TensorProto.FLOAT)
    y = g.node("Add", t, c)
    ms = g.reduce_mean(g.node("Mul", y, y), [-1])
    n = g.node("Div", y, g.node("Sqrt", g.node("Add", ms, g.init(np.array(1e-6, np.float32), "eps"))))
    return g.model(g.node("Mul", n, g.init(G.WEIGHT, "scale")))


def test_opset_raised_in_place_where_the_converter_only_relabels(monkeypatch):
    """An opset-20 graph whose changed ops (Reshape, Transpose, Cast, Cos) the version converter
    leaves as they are is bumped to 23 in place (the same model, its nodes' metadata kept: no
    protobuf round trip), and the RMSNormalization it gets computes the float64 reference. An op
    the converter rewrites (Split's attribute -> input, 12 -> 18) still goes through the converter,
    and GroupNormalization 18 -> 21, which it relabels though its meaning changed, is refused."""
    import onnx_ir as ir

    from normexport.rewriter import opset

    m = ir.serde.deserialize_model(_typed_ops_then_rms(20))
    up, how = rw.upgrade_opset(m, 23)
    assert up is m and up.opset_imports[""] == 23 and "leaves the ops that changed" in how, how
    assert "Cast" in how and "Reshape" in how and "Transpose" in how
    rep = RewriteReport()
    out = rewrite(_typed_ops_then_rms(20), target="ort", report=rep)
    assert G.count(out, "RMSNormalization") == 1 and out.opset_import[0].version >= 23, rep.summary()
    x = G.xin(2, 3, G.H)
    y = x.astype(np.float64) + np.cos(x.astype(np.float64))
    G.assert_close(G.run(out, x=x)[0], G.rms_ref(y, G.WEIGHT))

    g = G.G(12)
    g.inputs[0] = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, G.H])
    s = g.name("split")
    g.nodes.append(onnx.helper.make_node("Split", ["x"], [s + "a", s + "b"], axis=0, split=[1, 3]))
    split = ir.serde.deserialize_model(g.model(s + "a", s + "b"))
    up, how = rw.upgrade_opset(split, 18)
    assert up is not split and "version_converter" in how, how
    assert [len(n.inputs) for n in up.graph if n.op_type == "Split"] == [2]  # the sizes now an input

    g = G.G(18)
    g.inputs[0] = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4, 3])
    gn = g.node("GroupNormalization", "x", g.init(np.ones(2, np.float32)), g.init(np.zeros(2, np.float32)), num_groups=2)
    with pytest.raises(ValueError, match="GroupNormalization changed meaning at opset 21"):
        rw.upgrade_opset(ir.serde.deserialize_model(g.model(gn)), 23)
    # the probe decides: a converter that changes Reshape sends the model through it
    real = onnx.version_converter.convert_version

    def adds_identity(model, version):
        out = real(model, version)
        out.graph.node.append(onnx.helper.make_node("Identity", [out.graph.node[0].output[0]], ["extra"]))
        return out

    monkeypatch.setattr(opset.onnx.version_converter, "convert_version", adds_identity)
    m = ir.serde.deserialize_model(_typed_ops_then_rms(20))
    up, how = rw.upgrade_opset(m, 23)
    assert up is not m and "converted" in how, how
