"""`convert MODEL --target trt --quantize int8|fp8` (docs/design.md §15, issue 45 items 2 and 3): Q/DQ on
MatMul / Gemm / Conv by onnxruntime's quantize_static (QDQ, per-channel symmetric weights, per-tensor
symmetric activations; float8e4m3fn for fp8), the normexport nodes never wrapped, judged against eager
fp32, written only when it passes. The repo's reference DiT and LLaMA blocks (models/), random weights.
Planted (each seen failing): Q/DQ left around a normexport node, a weight scale halved, the verdict loosened."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).parent))

CASES = [("dit", "int8"), ("llama", "int8"), ("dit", "fp8"), ("llama", "fp8")]


def _convert(argv):
    from normexport.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("qdq")
    done = {}
    for name, kind in CASES:
        out, report = root / f"{name}_{kind}.onnx", root / f"{name}_{kind}.json"
        code, text, _ = _convert(["convert", f"normexport.models.{name}:tiny", "-o", str(out), "--target", "trt",
                                  "--quantize", kind, "--report", str(report)])
        done[name, kind] = (out, code, text, json.loads(report.read_text()))
    return done


@pytest.mark.parametrize("name,kind", CASES)
def test_numerics_against_eager(converted, name, kind):
    from normexport.quantize.verdict import OUTPUT_THRESHOLDS

    out, code, text, report = converted[name, kind]
    assert code == 0, text
    q = report["quantized"]
    assert q["passed"] and q["kind"] == kind
    t = OUTPUT_THRESHOLDS[kind]
    for row in q["verdict"]["rows"]:
        assert row["cosine"] >= t["cosine"] and row["psnr"] >= t["psnr"]
        assert row["float_max_err"] < 1e-4 < row["max_err"]  # the float file is eager's; the quantized one is not
    assert "PASSED (quantized verdict" in text


@pytest.mark.parametrize("name,kind", CASES)
def test_qdq_on_every_matmul_never_on_normexport(converted, name, kind):
    model = onnx.load(str(converted[name, kind][0]))
    prod = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: t for t in model.graph.initializer}
    wtype = onnx.TensorProto.INT8 if kind == "int8" else onnx.TensorProto.FLOAT8E4M3FN
    ops = [n for n in model.graph.node if n.op_type in ("MatMul", "Gemm", "Conv")]
    assert ops
    weights = 0
    for n in ops:
        for i in n.input[:2]:
            dq = prod.get(i)
            assert dq is not None and dq.op_type == "DequantizeLinear", (n.name, i)
            if dq.input[0] in inits:  # a weight: stored quantized, one DequantizeLinear feeding the op, per channel
                assert inits[dq.input[0]].data_type == wtype
                assert numpy_helper.to_array(inits[dq.input[1]]).size > 1
                weights += 1
            else:  # an activation: its own Q -> DQ pair, per tensor
                assert prod[dq.input[0]].op_type == "QuantizeLinear"
                assert numpy_helper.to_array(inits[dq.input[1]]).size == 1
            if len(dq.input) > 2:  # symmetric: zero points 0
                assert not np.asarray(numpy_helper.to_array(inits[dq.input[2]]), dtype=np.float32).any()
    assert weights >= len(ops) - 2  # DiT's two attention MatMuls (q.k, p.v) have no weight
    nx = [n for n in model.graph.node if n.domain == "normexport"]
    assert len(nx) == 2
    for n in nx:
        assert all(i not in prod or prod[i].op_type not in ("DequantizeLinear", "QuantizeLinear") for i in n.input)


def test_engines_build(converted, plugin_lib, tmp_path):
    """TensorRT for RTX builds the int8 LLaMA file (function bodies) and the fp8 DiT file (plugin layers)."""
    from normexport import trt

    def profiles(model):
        prof = {}
        for i in model.graph.input:
            d = [x.dim_value or None for x in i.type.tensor_type.shape.dim]
            if None in d:
                prof[i.name] = tuple(tuple(v if v else s for v in d) for s in (1, 8, 16))
        return prof

    for (name, kind), plugin in ((("llama", "int8"), None), (("dit", "fp8"), plugin_lib)):
        path = converted[name, kind][0]
        r = trt.build(trt.BuildSpec(str(path), str(tmp_path / f"{name}.engine"), plugin=plugin,
                                    profiles=profiles(onnx.load(str(path)))), timeout=280)
        assert r.engine_bytes > 0 and r.normexport_nodes == 2
        assert len(r.plugin_layers) == (2 if plugin else 0)


def _planted(monkeypatch, tmp_path, what):
    from normexport.quantize import qdq

    if what == "wrapped":
        monkeypatch.setattr(qdq, "unwrap_normexport", lambda model: 0)
    else:
        real = qdq.quantize

        def halved(src, dst, kind, inputs):
            model = real(src, dst, kind, inputs)
            inits = {t.name: t for t in model.graph.initializer}
            dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
                      and inits[n.input[0]].data_type == onnx.TensorProto.INT8)
            s = inits[dq.input[1]]
            s.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(s) * 0.5, s.name))
            return model

        monkeypatch.setattr(qdq, "quantize", halved)
    out = tmp_path / "m.onnx"
    code, text, _ = _convert(["convert", "normexport.models.llama:tiny", "-o", str(out), "--target", "trt",
                              "--quantize", "int8"])
    return code, text, out


@pytest.mark.parametrize("what", ["wrapped", "halved"])
def test_planted_bugs_refused(monkeypatch, tmp_path, what):
    code, text, out = _planted(monkeypatch, tmp_path, what)
    assert code == 1 and "not written" in text
    assert not out.exists() and not list(tmp_path.glob("*.onnx*")) and not list(tmp_path.glob(".qdq-*"))
    if what == "wrapped":
        assert "wrapped in Q/DQ" in text
    else:
        assert "FAILED its agreement check" in text


def test_fp8_for_ort_refused(tmp_path):
    out = tmp_path / "m.onnx"
    code, text, err = _convert(["convert", "normexport.models.llama:tiny", "-o", str(out), "--target", "ort",
                                "--quantize", "fp8"])
    assert code == 2 and "does not serve --target ort" in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


NO_MATMUL = '''
import torch
class Norm(torch.nn.Module):
    input_names = ["x"]
    dynamic_axes = {"x": [0]}
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64))
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
    def example_inputs(self):
        return (torch.randn(2, 8, 64),)
def tiny():
    return Norm().eval()
'''


def test_int8_without_matmul_refused(tmp_path, monkeypatch):
    (tmp_path / "nomatmul_mod.py").write_text(NO_MATMUL)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out" / "m.onnx"
    out.parent.mkdir()
    code, text, err = _convert(["convert", "nomatmul_mod:tiny", "-o", str(out), "--target", "trt", "--quantize", "int8"])
    assert code == 2 and "exports no MatMul / Gemm / Conv" in err and len(err.strip().splitlines()) == 1, (text, err)
    assert not list(out.parent.iterdir())
