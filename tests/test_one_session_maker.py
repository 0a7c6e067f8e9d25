"""One module makes every onnxruntime session (issue 39 item 3): `InferenceSession(` is called only
in normexport/ortrun.py (`inference_session`), read off the source with ast (comments and
docstrings do not count); and the runners of `check` come from one table."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import onnx
import pytest

ROOT = Path(__file__).resolve().parents[1] / "normexport"
SESSION_MAKER = ROOT / "ortrun.py"


def session_calls(path: Path) -> list[int]:
    """Lines of `path` that call something named InferenceSession (ort.InferenceSession(...),
    InferenceSession(...), a getattr spelling of it)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if name == "InferenceSession":
            found.append(node.lineno)
        elif name == "getattr" and any(isinstance(a, ast.Constant) and a.value == "InferenceSession" for a in node.args):
            found.append(node.lineno)
    return found


def test_inference_session_is_made_in_ortrun_only():
    assert session_calls(SESSION_MAKER), "normexport/ortrun.py makes the sessions"
    elsewhere = {str(p.relative_to(ROOT.parent)): lines for p in sorted(ROOT.rglob("*.py"))
                 if p != SESSION_MAKER and (lines := session_calls(p))}
    assert not elsewhere, f"onnxruntime sessions made outside normexport/ortrun.py: {elsewhere}"


def test_the_planted_call_is_found(tmp_path):
    """The reader sees a call, and not a mention in a comment or docstring."""
    p = tmp_path / "m.py"
    p.write_text('"""ort.InferenceSession(x) in a docstring"""\n# InferenceSession(x)\nimport onnxruntime as ort\n'
                 "def f(b):\n    return ort.InferenceSession(b, providers=['CPUExecutionProvider'])\n")
    assert session_calls(p) == [5]
    p.write_text('"""InferenceSession(x)"""\n# ort.InferenceSession(x)\n')
    assert session_calls(p) == []


def _add_model() -> onnx.ModelProto:
    h = onnx.helper
    g = h.make_graph([h.make_node("Add", ["x", "x"], ["y"])], "g",
                     [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                     [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def test_inference_session_takes_a_proto_bytes_or_a_path(tmp_path):
    pytest.importorskip("onnxruntime")
    from normexport.ortrun import inference_session

    model = _add_model()
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    x = np.array([1.0, 2.0], np.float32)
    for source, kw in ((model, {}), (model.SerializeToString(), {"threads": 1, "prepacking": False}),
                       (path, {"log_level": None}), (str(path), {"providers": ["CPUExecutionProvider"]})):
        sess = inference_session(source, **kw)
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], 2 * x)
        assert sess.get_providers() == ["CPUExecutionProvider"]


def test_check_picks_runners_from_one_table():
    from normexport.parity import runners

    assert runners.BACKENDS == ("ort", "ort-cuda", "trt")
    assert set(runners.RUNNERS) == set(runners.BACKENDS)
    for name, cls in runners.RUNNERS.items():
        assert issubclass(cls, runners.Runner) and cls.name == name
        for method in ("activate", "infer", "deactivate", "availability"):
            assert callable(getattr(cls, method))
    assert runners._availability("ort") is None
    assert runners._availability("nope") == "unknown backend 'nope'"
    src = (ROOT / "parity" / "driver.py").read_text()
    assert "_OrtBackend" not in src and "_TrtBackend" not in src and "runner_for(" in src


def test_eager_float64_and_ort_runners_share_the_interface(tmp_path):
    pytest.importorskip("onnxruntime")
    import torch

    from normexport.parity import runners

    class Twice(torch.nn.Module):
        def forward(self, x):
            return x + x

    x = torch.tensor([1.0, 2.0])
    source = runners._ModelSource(_add_model())
    try:
        outs = {}
        for runner in (runners.EagerRunner(Twice()), runners.Float64Runner(Twice()), runners.runner_for("ort", source)):
            with runner:
                assert runner.is_active
                outs[runner.name] = runner.infer([x])[0]
            assert not runner.is_active
        assert outs["float64"].dtype == torch.float64 and outs["eager"].dtype == torch.float32
        for v in outs.values():
            np.testing.assert_array_equal(np.asarray(v, np.float64), [2.0, 4.0])
        session = runners.OrtRunner(source)
        session.activate()
        again = runners.OrtRunner.of_session(session.session)
        np.testing.assert_array_equal(again.infer([x])[0], [2.0, 4.0])
    finally:
        source.close()

    class NoDouble(torch.nn.Module):
        def forward(self, x):
            if x.dtype == torch.float64:
                raise RuntimeError("no float64 here")
            return x

    with pytest.raises(runners.NoFloat64, match="does not run in float64"):
        runners.Float64Runner(NoDouble()).infer([x])
