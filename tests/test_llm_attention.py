"""Attention as onnxruntime's fused GroupQueryAttention for `convert --target ort` with the KV
cache (normexport/llm/attention.py, issue 31 item 2).

Tiny LLaMA and Qwen 3 (q / k norms over the head dim) folders, head size 16 (onnxruntime's
GroupQueryAttention takes multiples of 16), 4 query heads over 2 KV heads, random weights: convert
writes one com.microsoft.GroupQueryAttention per layer and no SDPA chain left, its generation check
(16 greedy tokens, logits per step) passes on the fused file, the report says what was fused and
genai_config.json gets past_present_share_buffer true (the shared-buffer run was checked).

Planted bugs in the fused LLaMA file make the generation check FAIL (wrong kv_num_heads: onnxruntime's
error; a scale off by 10 %, seqlens_k one short: every step's logits), and the local check (fused vs
decomposed in onnxruntime) too;
a fusion that fails the generation check inside convert leaves the decomposed file, said on a line.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
FAMILIES = ("llama", "qwen3")


def _folder(family: str, root: Path) -> Path:
    import transformers as t

    cls, cfg = {"llama": (t.LlamaForCausalLM, t.LlamaConfig(**COMMON)),
                "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(**COMMON, head_dim=16))}[family]
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
    model.save_pretrained(root / family)
    return root / family


def _convert(folder: Path, out: Path, *extra) -> tuple[int, str]:
    from normexport.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["convert", str(folder), "-o", f"{out}/", "--target", "ort", "--report", str(out / "report.json"),
                     *extra])
    return code, buf.getvalue()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{family: (folder, output dir, exit code, stdout)}"""
    from normexport.llm import attention

    root = tmp_path_factory.mktemp("gqa")
    out = {}
    real = attention.for_convert

    def keep(model_ir, lm):  # the decomposed file beside, for the local check of the planted bugs
        ir.save(model_ir, dest / "decomposed.onnx")
        return real(model_ir, lm)

    attention.for_convert = keep
    try:
        for family in FAMILIES:
            folder = _folder(family, root)
            dest = root / f"{family}_out"
            dest.mkdir()
            code, stdout = _convert(folder, dest)
            out[family] = (folder, dest, code, stdout)
    finally:
        attention.for_convert = real
    return out


def _ops(path: Path) -> dict:
    m = onnx.load(str(path))
    counts: dict = {}
    for n in m.graph.node:
        key = f"{n.domain}::{n.op_type}" if n.domain else n.op_type
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("family", FAMILIES)
def test_one_group_query_attention_per_layer_passes_generation(family, converted):
    folder, out, code, stdout = converted[family]
    assert code == 0, stdout
    ops = _ops(out / "model.onnx")
    assert ops.get("com.microsoft::GroupQueryAttention") == COMMON["num_hidden_layers"], ops
    assert "Softmax" not in ops, ops  # the decomposed attention is gone, and the cache is read by GQA alone
    m = onnx.load(str(out / "model.onnx"))
    readers = {n.op_type for n in m.graph.node if any(i.startswith("past_key_values.") for i in n.input)}
    assert readers <= {"GroupQueryAttention", "Shape"}, readers  # Shape: the batch size, read off the cache
    line = next(ln for ln in stdout.splitlines() if ln.startswith("  attention:"))
    assert "2 com.microsoft.GroupQueryAttention" in line and "generation check PASSED on the fused file" in line, stdout
    assert "PASSED: 16/16 steps' logits within limits" in stdout, stdout
    report = json.loads((out / "report.json").read_text())
    att = report["attention"]
    assert att["fused"] and att["group_query_attention"] == 2 and att["local_check"]["passed"], att
    assert att["attributes"]["num_heads"] == 4 and att["attributes"]["kv_num_heads"] == 2
    assert att["attributes"]["scale"] == pytest.approx(0.25) and att["nodes_after"] < att["nodes_before"] / 2
    assert report["passed"] and report["op_counts"]["com.microsoft::GroupQueryAttention"] == 2, report["op_counts"]
    genai = json.loads((out / "genai_config.json").read_text())
    assert genai["search"]["past_present_share_buffer"] is True and att["past_present_share_buffer"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fusion_leaves_optimizes_fixed_point(family, converted):
    """After the fusion the leftovers go by onnxscript optimize's closing passes alone (not a whole
    optimize again, 0.46 s of a 1.1B LLaMA's): the fused graph must be what a whole optimize would
    leave, node for node (planted: the closing passes left out -> unused nodes and Constants stay)."""
    from onnxscript.optimizer import optimize

    from normexport.exporter.optimizer_rules import exact_no_op_rules
    from normexport.llm import attention

    def graph(model):
        return ([(n.op_type, [v.name if v is not None else "" for v in n.inputs], [v.name for v in n.outputs])
                 for n in model.graph], sorted(model.graph.initializers))

    _, out, code, stdout = converted[family]
    assert code == 0, stdout
    decomposed = ir.load(out / "decomposed.onnx")
    fused = attention._fused_copy(decomposed, ir.load(out / "decomposed.onnx"), COMMON["max_position_embeddings"]).model
    assert fused is not None
    before = graph(fused)
    with exact_no_op_rules():
        optimize(fused)
    assert graph(fused) == before
    # convert's way (a spare copy given): first without optimize before the fusions, convert's file being
    # its fixed point already: the same graph (planted: the optimize left out of the retry and the shape
    # inference out of the first try -> no layer fused)
    packed = ir.load(out / "decomposed.onnx")
    fast = attention._fused_copy(packed, attention._copy(packed), COMMON["max_position_embeddings"],
                                 spare=attention._copy(packed))
    assert fast.model is not None and not fast.optimized_first, fast.reason
    assert graph(fast.model) == before


def _planted(path: Path, bug: str) -> onnx.ModelProto:
    m = onnx.load(str(path))
    producers = {o: n for n in m.graph.node for o in n.output}
    for node in m.graph.node:
        if node.op_type != "GroupQueryAttention":
            continue
        attrs = {a.name: a for a in node.attribute}
        if bug == "kv_num_heads":
            attrs["kv_num_heads"].i = 1
        elif bug == "scale":
            attrs["scale"].f *= 1.1
        elif bug == "seqlens_k":  # attention_mask.sum(-1) - 2: one key short
            sub = producers[producers[node.input[5]].input[0]]
            assert sub.op_type == "Sub", sub
            if not any(t.name == "planted_two" for t in m.graph.initializer):
                m.graph.initializer.append(onnx.numpy_helper.from_array(np.array(2, np.int64), "planted_two"))
            sub.input[1] = "planted_two"
    return m


def _lm(folder: Path):
    import transformers

    from normexport.llm import CacheLM, probe_layout

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    return CacheLM(model, probe_layout(model))


@pytest.mark.parametrize("bug", ["kv_num_heads", "scale", "seqlens_k"])
def test_planted_bug_fails_the_checks(bug, converted):
    from normexport.llm.share_buffer import share_buffer_check
    from normexport.llm.verify import compare
    from normexport.parity.generate import check_generation

    folder, out, code, _ = converted["llama"]
    assert code == 0
    planted = _planted(out / "model.onnx", bug)
    result = check_generation(planted, _lm(folder), command="convert")
    assert not result.passed, result.table()
    if bug == "kv_num_heads":  # onnxruntime refuses the key's (packed: the query's) hidden size for 1 KV head
        assert any(w in (result.error or "") for w in ("kv_num_heads", "Packed query hidden")), result.table()
    else:  # the logits of every step off (2 x eager's error to float64 exceeded)
        assert result.error is None and not any(s.row.passed for s in result.steps), result.table()
    decomposed = ir.load(str(out / "decomposed.onnx"))
    assert compare(decomposed, ir.load(str(out / "model.onnx")))["passed"]
    assert not compare(decomposed, ir.serde.deserialize_model(planted))["passed"]
    # convert's local check: the fused file against eager; the decomposed file run only to say which is wrong
    lm = _lm(folder)
    keep: dict = {}
    good = compare(decomposed, ir.load(str(out / "model.onnx")), reference=lm, keep=keep)
    assert good["passed"] and good["against"] == "eager" and good["max_abs_err"] < 1e-4, good
    assert good["outputs_compared"] == 3 * (1 + 2 * COMMON["num_hidden_layers"])  # logits + every present, 3 steps
    assert share_buffer_check(ir.load(str(out / "model.onnx")), session=keep["fused"],
                              reference=keep["run"]) == (True, None)
    feeds, outs = keep["run"]  # the reference's step-2 logits 1 % off: the shared-buffer run no longer agrees
    off = [[o * 1.01 if k == 2 and j == 0 else o for j, o in enumerate(step)] for k, step in enumerate(outs)]
    assert share_buffer_check(ir.load(str(out / "model.onnx")), session=keep["fused"],
                              reference=(feeds, off))[1].startswith("step 2: the shared-buffer run's logits")
    bad = compare(decomposed, ir.serde.deserialize_model(planted), reference=lm)
    assert not bad["passed"] and not bad.get("eager_failed"), bad
    assert bad["reason"].startswith("the fused file against eager (the decomposed file within tolerance"), bad


def test_failed_generation_keeps_decomposed_file(converted, tmp_path, monkeypatch):
    """A fusion that passes its local check but fails the generation check (planted: the fused file's
    scale changed after the local check) leaves the decomposed file, said on a line."""
    from normexport.llm import attention

    real = attention.for_convert

    def planted(model_ir, lm):
        f = real(model_ir, lm)
        for node in f.model.graph:
            if node.op_type == "GroupQueryAttention":
                node.attributes["scale"] = ir.AttrFloat32("scale", 0.5)
        return f

    monkeypatch.setattr(attention, "for_convert", planted)
    folder = converted["llama"][0]
    code, stdout = _convert(folder, tmp_path / "out")
    assert code == 0, stdout
    assert "attention: decomposed (not fused as GroupQueryAttention: the fused file FAILED the generation check" in stdout
    assert stdout.count("generation check:") == 2 and "FAILED: " in stdout and "PASSED: 16/16" in stdout, stdout
    ops = _ops(tmp_path / "out" / "model.onnx")
    assert "com.microsoft::GroupQueryAttention" not in ops and ops.get("Softmax") == 2, ops
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["attention"]["fused"] is False and report["passed"]
    genai = json.loads((tmp_path / "out" / "genai_config.json").read_text())
    assert genai["search"]["past_present_share_buffer"] is False


def decomposed_by_convert(tmp_path_factory):
    """(folder, output dir, exit code, stdout) of `convert LLAMA -o DIR/ --target ort --report
    DIR/report.json --no-fuse attention --no-check`: one conversion per run, shared with
    test_llm_bypath (_llm_models.shared_dir; nothing may write into it)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from _llm_models import shared_dir

    def build(root: Path) -> None:
        folder = _folder("llama", root)
        (root / "out").mkdir()
        code, stdout = _convert(folder, root / "out", "--no-fuse", "attention", "--no-check")
        (root / "stdout.txt").write_text(stdout)
        (root / "code.txt").write_text(str(code))

    root = shared_dir(tmp_path_factory, "gqa-llama-no-fuse", build)
    return (root / "llama", root / "out", int((root / "code.txt").read_text()),
            (root / "stdout.txt").read_text())


def test_no_fuse_attention_keeps_it_decomposed(tmp_path_factory):
    """--no-fuse attention (for left-padded batches, which GroupQueryAttention's seqlens_k cannot
    express): the decomposed attention, said on the attention line and recorded in the report."""
    _, out, code, stdout = decomposed_by_convert(tmp_path_factory)
    assert code == 0, stdout
    assert "  attention: decomposed (--no-fuse attention)" in stdout.splitlines(), stdout
    ops = _ops(out / "model.onnx")
    assert "com.microsoft::GroupQueryAttention" not in ops and ops.get("Softmax") == 2, ops
    assert json.loads((out / "report.json").read_text())["fusion_off"] == {"attention": "--no-fuse attention"}
