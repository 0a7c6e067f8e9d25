"""Packed projections for `convert --target ort` (issue 31 item 2, normexport/llm/packing.py): MatMuls
reading one input with constant weights become one MatMul + Split, and a GroupQueryAttention fed by
such a split takes the packed query; checked against numpy float64, the unpacked file in
onnxruntime and greedy generation."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from normexport.llm import packing


def _siblings_model(rng, shared: bool = False) -> tuple[onnx.ModelProto, dict]:
    """x [2, 3, 8] -> x @ Wa [8, 6], x @ Wb [8, 4], x @ Wc [8, 5] (outputs through Relu, so they are
    not graph outputs), and x @ Wd [8, 3] with Wd also read by an Add (`shared`) or not."""
    from onnx import helper, numpy_helper

    ws = {k: rng.standard_normal((8, n)).astype(np.float32) for k, n in (("a", 6), ("b", 4), ("c", 5), ("d", 3))}
    nodes = [helper.make_node("MatMul", ["x", f"W{k}"], [f"m{k}"], name=f"mm_{k}") for k in ws]
    nodes += [helper.make_node("Relu", [f"m{k}"], [f"y{k}"]) for k in ws]
    outs = [helper.make_tensor_value_info(f"y{k}", onnx.TensorProto.FLOAT, [2, 3, w.shape[1]]) for k, w in ws.items()]
    if shared:
        nodes.append(helper.make_node("Add", ["Wd", "Wd"], ["wd2"]))
        outs.append(helper.make_tensor_value_info("wd2", onnx.TensorProto.FLOAT, [8, 3]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 8])],
                              outs, [numpy_helper.from_array(w, f"W{k}") for k, w in ws.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), ws


@pytest.mark.parametrize("shared", [False, True])
def test_siblings_packed_match_float64(shared):
    rng = np.random.default_rng(0)
    proto, ws = _siblings_model(rng, shared)
    model = ir.serde.deserialize_model(proto)
    groups = packing.pack_siblings(model)
    packed = ir.serde.serialize_model(model)
    onnx.checker.check_model(packed, full_check=True)
    expected = [6, 4, 5] if shared else [6, 4, 5, 3]  # a weight another node reads stays where it is
    assert [g["split"] for g in groups] == [expected], groups
    assert [n.op_type for n in packed.graph.node].count("MatMul") == (2 if shared else 1)
    x = rng.standard_normal((2, 3, 8))
    sess = ort.InferenceSession(packed.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x.astype(np.float32)})))
    for k, w in ws.items():
        ref = np.maximum(x @ w.astype(np.float64), 0)
        assert np.abs(got[f"y{k}"] - ref).max() < 1e-5, k


def test_a_wrong_split_fails_the_float64_check(monkeypatch):
    """Planted: the packed weights concatenated in the wrong order -> the outputs no longer match."""
    real = packing._concat
    monkeypatch.setattr(packing, "_concat", lambda tensors: real(tensors[::-1]))
    rng = np.random.default_rng(1)
    proto, ws = _siblings_model(rng)
    model = ir.serde.deserialize_model(proto)
    packing.pack_siblings(model)
    x = rng.standard_normal((2, 3, 8))
    sess = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x.astype(np.float32)})))
    assert np.abs(got["ya"] - np.maximum(x @ ws["a"].astype(np.float64), 0)).max() > 1e-2


COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    import transformers as t

    torch.manual_seed(0)
    model = t.LlamaForCausalLM(t.LlamaConfig(**COMMON)).eval()
    root = tmp_path_factory.mktemp("pack") / "llama"
    model.save_pretrained(root)
    return root


def _convert(folder, out, *extra):
    from normexport.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["convert", str(folder), "-o", f"{out}/", "--target", "ort", "--report", str(out / "report.json"),
                     *extra])
    return code, buf.getvalue()


def test_llama_projections_packed_and_generation_passes(llama_folder, tmp_path):
    """One MatMul for q / k / v (GroupQueryAttention's packed query: no key / value input) and one for
    gate / up per layer; the local check and the 16-token generation check pass on the packed file."""
    code, stdout = _convert(llama_folder, tmp_path)
    assert code == 0, stdout
    line = next(ln for ln in stdout.splitlines() if ln.startswith("  projections:"))
    assert "4 group(s)" in line and "2 as GroupQueryAttention's packed query" in line and "PASSED" in line, line
    assert "PASSED: 16/16 steps' logits within limits" in stdout, stdout
    m = onnx.load(str(tmp_path / "model.onnx"))
    gqa = [n for n in m.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(n.input[1] == "" and n.input[2] == "" for n in gqa), [list(n.input) for n in gqa]
    hidden = COMMON["hidden_size"]
    dims = {i.name: list(i.dims) for i in m.graph.initializer}
    packed = [dims[n.input[1]] for n in m.graph.node if n.op_type == "MatMul" and n.input[1] in dims]
    assert packed.count([hidden, hidden + 2 * 2 * 16]) == 2, packed  # q 4 heads + k, v 2 heads of 16
    assert packed.count([hidden, 2 * COMMON["intermediate_size"]]) == 2, packed
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["packing"]["packed"] and report["packing"]["packed_qkv"] == 2
    assert report["packing"]["local_check"]["passed"]


def test_a_planted_packing_bug_is_not_applied(llama_folder, tmp_path, monkeypatch):
    """Planted: q / k / v weights concatenated in the wrong order -> the local check fails, the
    file is written unpacked (the fused attention kept), never silently."""
    real = packing._concat
    monkeypatch.setattr(packing, "_concat", lambda tensors: real(tensors[::-1]))
    code, stdout = _convert(llama_folder, tmp_path)
    assert code == 0, stdout
    line = next(ln for ln in stdout.splitlines() if ln.startswith("  projections:"))
    assert "not packed (local check FAILED" in line, line
    m = onnx.load(str(tmp_path / "model.onnx"))
    assert sum(n.op_type == "GroupQueryAttention" for n in m.graph.node) == 2
    assert not any(n.op_type == "Split" for n in m.graph.node)


def _by_path(monkeypatch):
    """convert's in-memory limit lowered so that the tiny model takes the path of a file over 2 GiB."""
    from normexport import io as nio
    from normexport.convert import record

    monkeypatch.setattr(nio, "EXTERNAL_BYTES", 1000)
    monkeypatch.setattr(record, "PARITY_LIMIT", 1000)
    return record


def test_over_the_limit_packed_fused_and_checked_from_files(llama_folder, tmp_path, monkeypatch):
    """A file over convert's in-memory limit: packed before the fusion, fused and checked by greedy
    generation from files beside the output; the weights are written once (the data file holds
    exactly what the graph references, no unpacked copies) and no temp folder is left."""
    _by_path(monkeypatch)
    out = tmp_path / "o"
    out.mkdir()
    code, stdout = _convert(llama_folder, out)
    assert code == 0, stdout
    assert "before the attention fusion" in stdout and "generation check PASSED on the fused file" in stdout, stdout
    assert "PASSED: 16/16 steps' logits within limits" in stdout and "parity: not run here" not in stdout, stdout
    m = onnx.load(str(out / "model.onnx"), load_external_data=False)
    gqa = [n for n in m.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(n.input[1] == "" for n in gqa)
    ext = [{e.key: e.value for e in t.external_data} for t in m.graph.initializer
           if t.data_location == onnx.TensorProto.EXTERNAL]
    used = sum(int(e["length"]) for e in ext)
    data = (out / "model.onnx.data").stat().st_size
    assert used <= data < used + 65536 * (len(ext) + 1), (used, data)  # alignment padding only
    assert not list(out.glob(".normexport-*")) and not list(tmp_path.glob(".normexport-*"))
    report = json.loads((out / "report.json").read_text())
    assert report["attention"]["fused"] and report["packing"]["groups"] == 4


def test_over_the_memory_share_the_check_is_left_to_check(llama_folder, tmp_path, monkeypatch):
    """Too large to run beside the eager model (available memory planted small): decomposed, the
    whole-model check left to `normexport check`, both said."""
    record = _by_path(monkeypatch)
    monkeypatch.setattr(record, "available_memory", lambda: 1000)
    out = tmp_path / "o"
    out.mkdir()
    code, stdout = _convert(llama_folder, out)
    assert code == 0, stdout
    assert "attention: decomposed (GroupQueryAttention is fused only where convert runs the file" in stdout, stdout
    assert "parity: not run here" in stdout, stdout


@pytest.mark.parametrize("dtype, fits", [(np.float32, True), ("bfloat16", False)])
def test_the_memory_rule_counts_bfloat16_twice(monkeypatch, dtype, fits):
    """onnxruntime's CPU provider runs a bfloat16 file widened to float32: its weights count twice
    against the memory available (1000 bytes of weights, 1700 available, share 0.6: float32's
    1000 <= 1020 fits, bfloat16's 2 x 1000 does not)."""
    from normexport.convert import prewrite, record

    monkeypatch.setattr(record, "available_memory", lambda: 1700)
    t = ir.tensor(np.ones(250, np.float32)) if dtype is np.float32 else \
        ir.tensor(np.ones(500, np.uint16), dtype=ir.DataType.BFLOAT16)
    v = ir.Value(name="w", const_value=t, type=ir.TensorType(t.dtype), shape=ir.Shape(t.shape))
    graph = ir.Graph([], [], nodes=[], initializers=[v], opset_imports={"": 20})
    assert prewrite.fits_by_path(ir.Model(graph, ir_version=10)) is fits
