"""Local verification where ONNX shape inference stops (issue 22 item 7): the shapes and types of the
values it did not reach come from one onnxruntime run of the model with them as extra outputs, and
the fusions behind them (the Conv + BatchNormalization folds of a paddle2onnx PP-OCR model) are
verified and applied. Two ways inference stops: an op of a domain onnx does not know
(com.microsoft Gelu: no shape, no type after it) and a Reshape to a shape computed in float at run
time (type known, rank unknown). Judged against float64 torch / numpy."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from normexport.rewriter import RewriteReport, rewrite

RNG = np.random.default_rng(0)


def _bn(prefix, c):
    return {f"{prefix}_s": (RNG.standard_normal(c) * 0.5 + 1).astype(np.float32),
            f"{prefix}_b": (RNG.standard_normal(c) * 0.3).astype(np.float32),
            f"{prefix}_m": (RNG.standard_normal(c) * 0.4).astype(np.float32),
            f"{prefix}_v": RNG.uniform(0.5, 2, c).astype(np.float32)}


W = {"w1": (RNG.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32),
     "w2": (RNG.standard_normal((8, 8, 1, 1)) * 0.3).astype(np.float32), **_bn("bn1", 8), **_bn("bn2", 8)}


def graph(stop: str) -> onnx.ModelProto:
    """stop -> Conv 3x3 -> BN -> Relu -> Conv 1x1 -> BN, x: [N, 3, 8, 16]."""
    nodes, extra = [], {}
    if stop == "contrib":
        nodes.append(helper.make_node("Gelu", ["x"], ["g"], domain="com.microsoft"))
    else:  # Reshape to Cast(Cast(Shape(x), float) * [1, 1, 0.5, 2], int64): [N, 3, 4, 32] at run time
        extra["f"] = np.array([1, 1, 0.5, 2], np.float32)
        nodes += [helper.make_node("Shape", ["x"], ["sh"]),
                  helper.make_node("Cast", ["sh"], ["shf"], to=TP.FLOAT),
                  helper.make_node("Mul", ["shf", "f"], ["tf"]),
                  helper.make_node("Cast", ["tf"], ["t"], to=TP.INT64),
                  helper.make_node("Reshape", ["x", "t"], ["g"])]
    nodes += [helper.make_node("Conv", ["g", "w1"], ["c1"], pads=[1, 1, 1, 1]),
              helper.make_node("BatchNormalization", ["c1", "bn1_s", "bn1_b", "bn1_m", "bn1_v"], ["b1"], epsilon=1e-5),
              helper.make_node("Relu", ["b1"], ["r1"]),
              helper.make_node("Conv", ["r1", "w2"], ["c2"]),
              helper.make_node("BatchNormalization", ["c2", "bn2_s", "bn2_b", "bn2_m", "bn2_v"], ["y"], epsilon=1e-3)]
    inits = [numpy_helper.from_array(a, k) for k, a in {**W, **extra}.items()]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, ["N", 3, 8, 16])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    opsets = [helper.make_opsetid("", 13)] + ([helper.make_opsetid("com.microsoft", 1)] if stop == "contrib" else [])
    m = helper.make_model(g, opset_imports=opsets)
    m.ir_version = 8
    return onnx.shape_inference.infer_shapes(m, data_prop=True)


def reference(x: np.ndarray, stop: str) -> np.ndarray:
    t = torch.from_numpy(x.astype(np.float64))
    if stop == "contrib":
        t = t * 0.5 * (1 + torch.erf(t / math.sqrt(2.0)))
    else:
        t = t.reshape(x.shape[0], 3, 4, 32)

    def bn(v, p, eps):
        s = torch.from_numpy(W[f"{p}_s"].astype(np.float64))[:, None, None]
        b = torch.from_numpy(W[f"{p}_b"].astype(np.float64))[:, None, None]
        m = torch.from_numpy(W[f"{p}_m"].astype(np.float64))[:, None, None]
        var = torch.from_numpy(W[f"{p}_v"].astype(np.float64))[:, None, None]
        return (v - m) / torch.sqrt(var + eps) * s + b

    t = bn(torch.nn.functional.conv2d(t, torch.from_numpy(W["w1"].astype(np.float64)), padding=1), "bn1", 1e-5).relu()
    return bn(torch.nn.functional.conv2d(t, torch.from_numpy(W["w2"].astype(np.float64))), "bn2", 1e-3).numpy()


@pytest.mark.parametrize("stop", ["contrib", "runtime_reshape"])
def test_folds_apply_where_shape_inference_stops(stop):
    model = graph(stop)
    known = {vi.name for vi in model.graph.value_info if vi.type.tensor_type.HasField("shape")}
    assert not {"g", "c1", "b1", "r1", "c2"} & known, known  # the premise: inference stopped before the Conv
    rep = RewriteReport()
    out = rewrite(model, report=rep)
    assert [n.op_type for n in out.graph.node if n.op_type == "BatchNormalization"] == [], rep.summary()
    assert rep.rules["FoldConvBN"].applied == 2, rep.summary()
    assert all(c.passed and not c.reused for c in rep.local.checks), rep.local.checks
    shapes = sorted(tuple(d) for c in rep.local.checks for d in c.shapes.values())
    want = [(2, 3, 8, 16), (2, 8, 8, 16)] if stop == "contrib" else [(2, 3, 4, 32), (2, 8, 4, 32)]
    assert shapes == want, shapes  # the probe's sizes, not the default 3 of an unknown dim
    import onnxruntime as ort

    x = (RNG.standard_normal((3, 3, 8, 16)) * 1.5 + 0.3).astype(np.float32)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    y = ort.InferenceSession(out.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ref = reference(x, stop)
    err = np.abs(y - ref).max()
    assert err <= 1e-5 * np.abs(ref).max() + 1e-6, err


def test_the_caller_model_is_left_as_it_was():
    """The probe adds outputs to the caller's ModelProto for its run and removes them."""
    model = graph("contrib")
    before = model.SerializeToString(deterministic=True)
    rewrite(model, report=RewriteReport())
    assert model.SerializeToString(deterministic=True) == before


def test_large_model_is_probed_when_a_fusion_needs_it(tmp_path, monkeypatch):
    """A model over the whole-model limit (the limit set to 0 here), weights in external data: no
    proto copy of it is made up front; the first fusion whose inputs inference did not reach runs
    the probe once, onnxruntime reading the weights from the model's folder; both folds apply."""
    from normexport.rewriter import driver, rewrite_file

    monkeypatch.setattr(driver, "WHOLE_MODEL_LIMIT", 0)
    src = tmp_path / "ocr.onnx"
    onnx.save(graph("contrib"), str(src), save_as_external_data=True, all_tensors_to_one_file=True,
              location="ocr.onnx.data", size_threshold=0)
    calls = []
    real = driver.probe_ir
    monkeypatch.setattr(driver, "probe_ir", lambda *a: calls.append(1) or real(*a))
    monkeypatch.chdir(tmp_path / "..")  # the weights are found from the model's folder, not the cwd
    rep = rewrite_file(src, tmp_path / "out.onnx")
    assert rep.rules["FoldConvBN"].applied == 2 and calls == [1], rep.summary()
    assert rep.whole_model.startswith("not run"), rep.whole_model
    out = onnx.load(str(tmp_path / "out.onnx"))
    assert not [n for n in out.graph.node if n.op_type == "BatchNormalization"]
    import onnxruntime as ort

    x = (RNG.standard_normal((2, 3, 8, 16))).astype(np.float32)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    y = ort.InferenceSession(str(tmp_path / "out.onnx"), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ref = reference(x, "contrib")
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max() + 1e-6


def test_large_model_without_a_fusion_in_need_runs_no_probe(tmp_path, monkeypatch):
    """Shapes known everywhere (no com.microsoft op): the large-model path never runs the model."""
    from normexport.rewriter import driver, rewrite_file

    monkeypatch.setattr(driver, "WHOLE_MODEL_LIMIT", 0)
    m = graph("contrib")
    m.graph.node[0].CopyFrom(helper.make_node("Relu", ["x"], ["g"]))
    del m.opset_import[1:]
    m = onnx.shape_inference.infer_shapes(m)
    src = tmp_path / "plain.onnx"
    onnx.save(m, str(src), save_as_external_data=True, location="plain.onnx.data", size_threshold=0)
    monkeypatch.setattr(driver, "probe_ir", lambda *a: pytest.fail("probe ran"))
    rep = rewrite_file(src, tmp_path / "out.onnx")
    assert rep.rules["FoldConvBN"].applied == 2, rep.summary()
