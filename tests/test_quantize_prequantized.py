"""A pre-quantized folder -> int4 MatMulNBits (docs/design.md §15, issue 45 item 1):
`convert QUANT_DIR -o OUT/ --target ort` repacks the folder's packed tensors (normexport.quantize.prequantized).

The folders (tests/fixtures/prequantized/, tools/make_prequantized_fixtures.py) were written on the
CPU by a real library, auto-round 0.16.1, in its auto_gptq (GPTQ v1: qzeros = zero - 1; symmetric
and asymmetric), auto_awq (AutoAWQ gemm, interleaved) and llm_compressor (compressed-tensors 0.20.0
pack-quantized) formats, tiny LLaMA, random weights; reference.npz beside each is the writing
library's own dequantization of every packed Linear (auto-round's GPTQ QuantLinear, its AWQ
dequantize_gemm, compressed-tensors' PackedQuantizationCompressor.decompress), in float64 and exact
in float32. The libraries are no dependency of normexport: their numbers travel in the fixture.

Planted, each seen failing (the repacked tensors against the library's dequantization, and the
converted folder's weight check): GPTQ's +1 zero-point offset dropped, the nibble order swapped
(within a word; AWQ's interleave undone), one group's scale wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "prequantized"
KINDS = ("gptq_sym", "gptq_asym", "awq", "ct")


def _source(kind: str):
    from normexport.quantize import prequantized as pq

    folder = FIXTURES / kind
    return pq.Source(folder, pq.describe(pq.quantization_config(folder)))


def _reference(kind: str) -> dict:
    with np.load(FIXTURES / kind / "reference.npz") as ref:
        return {k: ref[k].astype(np.float64) for k in ref.files}


def _matmulnbits_weights(source) -> dict:
    """Each packed Linear as MatMulNBits tensors (prequantized.matmulnbits_tensors), unpacked again by
    the op's reference rule (weights.dequantize): W [N, K] float64."""
    from normexport.quantize import prequantized as pq, weights

    out = {}
    for lin in source.linears:
        b, scales, zp, k, n, block = pq.matmulnbits_tensors([source.unpack(lin)])
        w, _ = weights.dequantize(b, scales, zp, k, n, block)
        out[lin] = w.astype(np.float64)
    return out


def _worst(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max(float(np.abs(got[k] - want[k]).max()) for k in want)


@pytest.mark.parametrize("kind", KINDS)
def test_repacked_matmulnbits_equal_the_libraries_dequantization(kind):
    """Every block of every repacked MatMulNBits, unpacked by the op's rule, is the writing library's
    dequantization to the last bit (0 steps): nothing went through float."""
    source = _source(kind)
    assert len(source.linears) == 14  # 2 layers x q k v o gate up down; the LM head left in float by the writer
    assert _worst(_matmulnbits_weights(source), _reference(kind)) == 0.0


@pytest.mark.parametrize("kind", ["gptq_asym", "awq", "ct"])
def test_onnxruntime_matmulnbits_computes_the_libraries_weights(kind):
    """onnxruntime's MatMulNBits kernel (accuracy level 0: float32) on the repacked tensors of one
    projection, against x @ W.T in float64 with the library's W."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from normexport.quantize import prequantized as pq

    source = _source(kind)
    lin = "model.layers.1.mlp.down_proj"
    b, scales, zp, k, n, block = pq.matmulnbits_tensors([source.unpack(lin)])
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "S")]
    inputs = ["x", "B", "S"]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "Z"))
        inputs.append("Z")
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=block)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    x = np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = x.astype(np.float64) @ _reference(kind)[lin].T
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()


def _plant(monkeypatch, bug: str) -> None:
    from normexport.quantize import prequantized as pq

    if bug == "offset dropped":  # GPTQ v1's qzeros read as the zero point itself
        real = pq.unpack_gptq
        monkeypatch.setattr(pq, "unpack_gptq", lambda *a: real(*a[:-1], False))
    elif bug == "nibbles swapped":  # the 8 values of a word read high nibble first
        monkeypatch.setattr(pq, "SHIFTS", pq.SHIFTS[::-1].copy())
    elif bug == "awq interleave undone":
        monkeypatch.setattr(pq, "AWQ_NIBBLE_OF", np.arange(8))
    elif bug == "a group's scale":
        real = pq.unpack_awq

        def wrong(*a):
            p = real(*a)
            p.scale = p.scale.copy()
            p.scale[5, 1] *= 1.5
            return p

        monkeypatch.setattr(pq, "unpack_awq", wrong)


@pytest.mark.parametrize("kind,bug", [("gptq_sym", "offset dropped"), ("gptq_asym", "offset dropped"),
                                      ("ct", "nibbles swapped"), ("awq", "awq interleave undone"),
                                      ("awq", "a group's scale")])
def test_planted_packing_bugs_fail_against_the_library(monkeypatch, kind, bug):
    _plant(monkeypatch, bug)
    assert _worst(_matmulnbits_weights(_source(kind)), _reference(kind)) > 0.0


def _convert(src, out, *extra):
    import contextlib
    import io

    from normexport.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["convert", str(src), "-o", f"{out}/", "--target", "ort", "--report", str(out) + ".json",
                     "--no-anchor", *extra])
    report = Path(str(out) + ".json")
    return code, buf.getvalue(), json.loads(report.read_text()) if report.exists() else None


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The GPTQ (v1, asymmetric) folder converted: (exit code, stdout, report, output folder)."""
    out = tmp_path_factory.mktemp("pq") / "gptq_asym_int4"
    return (*_convert(FIXTURES / "gptq_asym", out), out)


def test_gptq_folder_converts_to_repacked_matmulnbits(converted):
    code, stdout, report, out = converted
    assert code == 0, stdout
    q = report["quantized"]
    assert q["passed"] and q["options"]["algorithm"] == "gptq" and q["options"]["block_size"] == 32, q
    assert q["prequantized"] == {"folder": str(FIXTURES / "gptq_asym"), "method": "gptq", "group_size": 32,
                                 "symmetric": False, "linears": 14} and report["model"] == str(FIXTURES / "gptq_asym")
    # the weight check: every MatMulNBits block against the float file's (the dequantized) weights: 0 steps
    # exact: the float file holds the packed weights' dequantization (1e-6 steps: float32 rounding of float / scale)
    assert q["weights"]["passed"] and q["weights"]["worst_steps"] < 1e-5 and q["weights"]["limit_steps"] == 0.0
    model = onnx.load(str(out / "model.onnx"))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 8  # per layer: packed q/k/v, o, packed gate/up, down
    inits = {t.name for t in model.graph.initializer}
    from normexport.quantize.int4 import lm_head

    # the one MatMul left with a float weight: the LM head, which the writer left in float
    assert [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits] == [lm_head(model)]
    assert "repacked from the folder's gptq tensors, no float round trip" in stdout
    assert "quantization_config" not in json.loads((out / "config.json").read_text())  # the ONNX file is the model


def test_gptq_folder_generates_as_eager_on_its_dequantized_weights(converted):
    """The verdict of verdict.py: eager fp32 on the folder's dequantized weights (the model) against
    the int4 file: teacher-forced top-1 and cosine, and the file's own greedy tokens."""
    _, stdout, report, _ = converted
    v = report["quantized"]["verdict"]
    assert v["passed"], stdout
    ours = v["ours"]
    assert ours["top1"] == 1.0 and ours["cosine_mean"] > 0.9999 and ours["greedy_equal"] >= 30, ours


def test_genai_generates_from_the_folder(converted):
    """onnxruntime-genai's generator on the folder as it is gives the file's own greedy tokens."""
    pytest.importorskip("onnxruntime_genai")
    import torch
    from _llm_models import genai_generate, own_greedy

    _, _, _, out = converted
    ids = [5, 17, 42, 9, 100, 7]
    got = genai_generate(out, ids, 12)
    assert got == own_greedy(out / "model.onnx", ids, 12, [torch.zeros(1, 2, 0, 16) for _ in range(4)])


def test_check_takes_the_prequantized_folder_as_reference(converted, cli, tmp_path):
    """`check OUT/model.onnx --reference QUANT_DIR`: eager on the folder's dequantized weights, the
    same verdict as convert's."""
    _, _, report, out = converted
    code, stdout, err = cli("check", out / "model.onnx", "--reference", FIXTURES / "gptq_asym", "--no-anchor",
                            "--json", tmp_path / "c.json")
    assert code == 0, stdout + err
    q = json.loads((tmp_path / "c.json").read_text())["quantized"]
    assert q["verdict"]["passed"] and q["options"]["block_size"] == 32 and not q["options"]["symmetric"]
    assert q["verdict"]["ours"] == report["quantized"]["verdict"]["ours"]  # the same prompt, model and file


def _edited(tmp_path, kind: str, edit) -> Path:
    """A copy of a fixture folder (its files linked) whose config.json's quantization_config is edited."""
    folder = tmp_path / f"{kind}_edited"
    folder.mkdir()
    for f in (FIXTURES / kind).iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    cfg = json.loads((FIXTURES / kind / "config.json").read_text())
    edit(cfg["quantization_config"])
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("edit,says", [
    (lambda q: q.update(quant_method="bitsandbytes"), "quant_method bitsandbytes"),
    (lambda q: q.update(bits=8), "gptq with bits 8"),
    (lambda q: q.update(desc_act=True), "desc_act true (act-order)"),
    (lambda q: q.update(group_size=-1), "group size -1"),
    (lambda q: q.update(checkpoint_format="marlin"), "checkpoint_format marlin"),
])
def test_unsupported_prequantized_folders_are_refused_in_one_line(cli, tmp_path, edit, says):
    folder = _edited(tmp_path, "gptq_sym", edit)
    out = tmp_path / "out"
    code, stdout, err = cli("convert", folder, "-o", f"{out}/", "--target", "ort")
    assert code == 2 and says in err and "supported are gptq" in err and err.count("\n") == 1, stdout + err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("flags,says", [(["--target", "trt"], "pass --target ort"),
                                        (["--target", "ort", "--quantize", "int8"], "not --quantize int8"),
                                        (["--target", "ort", "--block-size", "64"], "--block-size: "),
                                        (["--target", "ort", "--quant-algo", "hqq"], "--quant-algo: ")])
def test_prequantized_folder_with_flags_it_cannot_take_is_refused(cli, tmp_path, flags, says):
    out = tmp_path / "out"
    code, stdout, err = cli("convert", FIXTURES / "awq", "-o", f"{out}/", *flags)
    assert code == 2 and says in err and err.count("\n") == 1, stdout + err
    assert not out.exists()


def test_damaged_packing_is_refused_in_one_line(cli, tmp_path):
    """A folder whose config says GPTQ but whose tensors are not GPTQ's (the AWQ folder's, relabelled)."""
    folder = _edited(tmp_path, "awq", lambda q: q.update(quant_method="gptq", desc_act=False))
    out = tmp_path / "out"
    code, stdout, err = cli("convert", folder, "-o", f"{out}/", "--target", "ort")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, stdout + err
    assert not out.exists()
