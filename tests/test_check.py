"""normexport.check / normexport.testing: parity against a float64 reference, skipped backends,
dynamic shapes, tolerances (docs/design.md §5, §7) and the `check` command handler."""

from __future__ import annotations

import argparse
import json
import logging
import warnings

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import normexport.prepare.nn as nnn
from normexport import parity as check_cmd
from normexport.parity import check, limit_for, tolerance_for
from normexport.parity.runners import _availability
from normexport.parity.tolerances import plain_limit_for
from normexport.errors import UsageError
from normexport.ops import TRANSLATION_TABLE, attach_functions
from normexport.testing import assert_parity

try:  # the bundled reference models: normexport/models/, moving to the checkout's top-level models/
    from normexport.models.llama import tiny as llama_tiny
    LLAMA_TINY = "normexport.models.llama:tiny"
except ImportError:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, where models/ is
    from models.llama import tiny as llama_tiny
    LLAMA_TINY = "models.llama:tiny"


# ---- small models (also importable as `test_check:<factory>` by the CLI loader) -------------
class RMSBlock(nn.Module):
    """Linear -> normexport RMSNorm (torch custom op) -> Linear."""

    input_names = ["x"]

    def __init__(self, hidden: int = 32):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.fc = nn.Linear(hidden, hidden)
        self.norm = nnn.RMSNorm(1.0 + 0.2 * torch.randn(hidden, generator=g))
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.out(self.norm(self.fc(x)))


class MLP(nn.Module):
    """Two outputs (a tuple), two inputs."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 48)
        self.fc2 = nn.Linear(48, 16)

    def forward(self, x, y):
        h = torch.relu(self.fc1(x + y))
        return self.fc2(h), h


def make_rms_block():
    torch.manual_seed(0)
    return RMSBlock().eval()


def make_mlp():
    torch.manual_seed(0)
    return MLP().eval()


def make_mlp_with_inputs():
    m = make_mlp()
    g = torch.Generator().manual_seed(5)
    m.example_inputs = lambda: (torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g))
    return m


def export(module, args, path=None, dynamic_shapes=None, names=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        prog = torch.onnx.export(module, args, dynamo=True, custom_translation_table=TRANSLATION_TABLE,
                                 dynamic_shapes=dynamic_shapes, input_names=names, verbose=False)
    model = attach_functions(prog.model_proto)
    if path is not None:
        onnx.save(model, str(path))
    return model


def perturb(model: onnx.ModelProto, rel: float = 1e-3) -> onnx.ModelProto:
    """A copy with the largest float initializer scaled by (1 + rel)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    init = max((t for t in m.graph.initializer if t.data_type in floats), key=lambda t: int(np.prod(t.dims)))
    arr = onnx.numpy_helper.to_array(init)
    init.CopyFrom(onnx.numpy_helper.from_array((arr.astype(np.float64) * (1 + rel)).astype(arr.dtype), init.name))
    return m


@pytest.fixture(scope="module")
def rms(tmp_path_factory):
    m = make_rms_block()
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(2))
    dyn = ({0: torch.export.Dim("batch", max=64), 1: torch.export.Dim("seq", max=512)},)
    path = tmp_path_factory.mktemp("rms") / "rms.onnx"
    model = export(m, (x,), path, dynamic_shapes=dyn, names=["x"])
    return m, x, model, path


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    m = make_mlp_with_inputs()
    x, y = m.example_inputs()
    d = tmp_path_factory.mktemp("mlp")
    model = export(m, (x, y), d / "mlp.onnx", names=["x", "y"])
    onnx.save(perturb(model), str(d / "mlp_bad.onnx"))
    return m, (x, y), model, d


def _cli_args(*argv):
    p = argparse.ArgumentParser()
    check_cmd.add_arguments(p)
    return p.parse_args([str(a) for a in argv])


# ---- passing models ---------------------------------------------------------------------------
def test_rmsnorm_model_passes_with_custom_op(rms):
    m, x, model, path = rms
    assert any(n.domain == "normexport" for n in model.graph.node)
    report = check(path, m, (x,))
    assert report.passed, report.table()
    rows = report.rows
    assert rows and all(r.backend == "ort" and r.passed for r in rows)
    # the float64 reference is a real one: the custom op's float32 statistics show as eager error
    assert report.fp64_reference["available"]
    assert all(r.ref_err_fp64 is not None and r.ref_err_fp64 > 0 for r in rows)


def test_plain_mlp_two_outputs_passes(mlp):
    m, (x, y), model, _ = mlp
    report = check(model, m, (x, y))
    assert report.passed, report.table()
    assert [r.output for r in report.rows] == [o.name for o in model.graph.output]
    assert len(report.rows) == 2
    # a dict keyed by ONNX input name works too
    assert check(model, m, {"y": y, "x": x}).passed


def test_dynamic_axes_check_extra_shapes(rms):
    m, x, _, path = rms
    report = check(path, m, (x,), dynamic_axes={"x": [0, 1]}, extra_shapes=2)
    assert report.passed, report.table()
    shapes = [s["inputs"]["x"] for s in report.shapes]
    assert len(shapes) >= 3 and len({tuple(s) for s in shapes}) == len(shapes)
    assert {r.shape_index for r in report.rows} == set(range(len(shapes)))
    assert all(s[2] == 32 for s in shapes)  # only the dynamic axes change
    assert len(report.to_dict()["shapes"]) >= 3


# ---- failing models -----------------------------------------------------------------------------
def test_perturbed_model_fails(mlp):
    m, inputs, model, _ = mlp
    report = check(perturb(model), m, inputs)
    assert not report.passed
    bad = report.failures
    assert bad and all(r.max_abs_err > r.limit for r in bad if r.max_abs_err is not None)
    assert "FAIL" in report.table() and "FAILED" in report.table()
    assert report.to_dict()["passed"] is False


def test_cli_exit_codes(mlp, tmp_path, capsys):
    _, _, _, d = mlp
    out = tmp_path / "r.json"
    assert check_cmd.run(_cli_args(d / "mlp.onnx", "--reference", "test_check:make_mlp_with_inputs", "--json", out)) == 0
    assert json.loads(out.read_text())["passed"] is True
    code = check_cmd.run(_cli_args(d / "mlp_bad.onnx", "--reference", "test_check:make_mlp",
                                   "--input", "x:4x16", "--input", "y:4x16"))
    assert code == 1
    assert "FAILED" in capsys.readouterr().out


def test_cli_usage_errors(mlp, tmp_path):
    _, _, _, d = mlp
    with pytest.raises(UsageError, match="has no input 'z'"):
        check_cmd.run(_cli_args(d / "mlp.onnx", "--reference", "test_check:make_mlp", "--input", "z:4x16"))
    with pytest.raises(UsageError, match="axis 1 is fixed to 16"):
        check_cmd.run(_cli_args(d / "mlp.onnx", "--reference", "test_check:make_mlp",
                                "--input", "x:4x15", "--input", "y:4x15"))
    with pytest.raises(UsageError, match="not found"):
        check_cmd.run(_cli_args(tmp_path / "missing.onnx", "--reference", "test_check:make_mlp"))
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"\x08\x07garbage" * 10)
    with pytest.raises(UsageError):
        check_cmd.run(_cli_args(corrupt, "--reference", "test_check:make_mlp"))
    with pytest.raises(UsageError, match="reference model rejected"):  # a reference of another model
        check_cmd.run(_cli_args(d / "mlp.onnx", "--reference", "test_check:make_rms_block", "--input", "x:4x16",
                                "--input", "y:4x16"))


def test_assert_parity_messages(mlp, rms):
    m, inputs, model, _ = mlp
    assert_parity(m, model, inputs)
    with pytest.raises(AssertionError) as e:
        assert_parity(m, perturb(model, 1e-2), inputs)
    msg = str(e.value)
    out_name = model.graph.output[0].name
    assert f"output '{out_name}'" in msg
    assert "max_abs_err" in msg and "> limit" in msg and "tolerance" in msg
    assert "worst at index (" in msg and "got " in msg and "reference " in msg
    # the plain export of the module was built for the second rule, and the file adds error
    assert "rule 'plain export'" in msg and "normexport's file adds error" in msg and "not built" not in msg
    with pytest.raises(AssertionError) as e:
        assert_parity(m, perturb(model, 1e-2), inputs, plain_export=None)
    assert "rule '2x eager'" in str(e.value) and "no plain export to compare with" in str(e.value)
    m2, x, _, path = rms
    assert_parity(m2, path, (x,), dynamic_axes={"x": [1]})


# ---- backends --------------------------------------------------------------------------------
TRT_WHY = _availability("trt")  # None where TensorRT can build and run engines


@pytest.mark.skipif(TRT_WHY is None, reason="TensorRT runs here")
def test_trt_skipped_never_passed(mlp):
    m, inputs, model, _ = mlp
    report = check(model, m, inputs, backends=("ort", "trt"))
    assert report.skipped["trt"] == TRT_WHY and TRT_WHY  # e.g. no tensorrt, or no CUDA GPU to run engines
    assert not [r for r in report.rows if r.backend == "trt"]
    d = report.to_dict()
    assert d["backends"]["trt"] == {"status": "skipped", "reason": TRT_WHY}
    assert {"backend": "trt", "reason": TRT_WHY} in d["skipped"]
    assert "trt" not in d["results"]
    assert report.passed  # ort ran and passed
    only_trt = check(model, m, inputs, backends=("trt",))
    assert not only_trt.passed and not only_trt.rows
    assert "no backend could run" in only_trt.table()
    everything = check(model, m, inputs, backends="all")
    assert set(everything.backends) == {"ort", "ort-cuda", "trt"} and "trt" in everything.skipped


# ---- report -----------------------------------------------------------------------------------
def test_json_report_fields(rms, tmp_path):
    m, x, _, path = rms
    report = check(path, m, (x,), backends=("ort", "trt"), dynamic_axes={"x": [0]}, extra_shapes=2)
    out = report.write_json(tmp_path / "report.json")
    d = json.loads(out.read_text())
    for key in ("normexport_version", "command", "inputs", "results", "skipped", "passed"):
        assert key in d
    assert d["command"] == "check"
    assert d["inputs"] == [{"name": "x", "shape": [2, 6, 32], "dtype": "float32"}]
    per_output = d["results"]["ort"]
    assert len(per_output) == 1
    rows = next(iter(per_output.values()))
    assert len(rows) == 3
    for r in rows:
        for key in ("max_abs_err", "max_rel_err", "mean_abs_err", "ref_err_fp64", "tolerance", "passed"):
            assert key in r
        assert r["max_rel_err"] == pytest.approx(r["max_abs_err"] / r["max_abs_ref"])
    assert d["passed"] is True
    assert not list(tmp_path.glob(".normexport-*"))  # atomic write left no temp file


def test_no_float64_reference_is_null_with_reason(mlp):
    class Float32Only(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            if x.dtype != torch.float32:
                raise TypeError("float32 only")
            return self.inner(x, y)

    m, inputs, model, _ = mlp
    report = check(model, Float32Only(m), inputs)
    assert report.fp64_reference["available"] is False and "float32 only" in report.fp64_reference["reason"]
    assert all(r.ref_err_fp64 is None for r in report.rows)
    assert report.passed  # judged against eager with the tolerance alone


# ---- tolerances ---------------------------------------------------------------------------------
def test_tolerance_rules():
    assert tolerance_for(torch.float32, 2.0) == pytest.approx(2e-5 + 1e-6)
    assert tolerance_for(torch.float16, 2.0) == pytest.approx(4e-3)
    assert tolerance_for(torch.bfloat16, 2.0) == pytest.approx(3.2e-2)
    assert tolerance_for(torch.float32, 2.0, rtol=1e-3, atol=0.0) == pytest.approx(2e-3)
    assert tolerance_for(torch.int64, 5.0) == 0.0
    tol = tolerance_for(torch.float32, 1.0)
    eps32 = torch.finfo(torch.float32).eps
    # whole models (docs/design.md §7): <= max(2x eager, floor), floored at 4 eps x max|ref|; the tolerance
    # is the limit only without a float64 reference
    assert limit_for(torch.float32, tol, 1.0, 0.0) == pytest.approx(4 * eps32)  # floor
    assert limit_for(torch.float32, tol, 2.0, 1e-7) == pytest.approx(8 * eps32)  # floor scales with max|ref|
    assert limit_for(torch.float32, tol, 1.0, 1e-6) == pytest.approx(2e-6)  # 2x eager
    assert limit_for(torch.float32, tol, 1.0, 1e-4) == pytest.approx(2e-4)  # not capped: the tolerance only warns
    assert limit_for(torch.float32, tol, 1.0, None) == tol  # no float64 reference: tolerance alone
    t16 = tolerance_for(torch.float16, 1.0)
    assert limit_for(torch.float16, t16, 1.0, 1e-4) == pytest.approx(torch.finfo(torch.float16).eps)  # floor
    assert limit_for(torch.float16, t16, 1.0, 6e-4) == pytest.approx(1.2e-3)  # 2x eager
    assert limit_for(torch.float16, t16, 1.0, None) == t16
    assert plain_limit_for(torch.float32, 1.0, 1e-5) == pytest.approx(1.25e-5 + 4 * eps32)


def test_float16_model_tolerance_path():
    torch.manual_seed(0)
    m = RMSBlock(hidden=64).eval().half()
    x = torch.randn(2, 8, 64).half()
    model = export(m, (x,))
    report = check(model, m, (x,))
    assert report.passed, report.table()
    (row,) = report.rows
    assert row.dtype == "float16"
    assert row.tolerance == pytest.approx(2e-3 * row.max_abs_ref)
    assert row.ref_err_fp64 > 0 and row.limit <= row.tolerance
    bad = check(perturb(model, 1e-2), m, (x,))
    assert not bad.passed and bad.failures[0].max_abs_err > bad.failures[0].limit


def test_twice_eager_rule_fails_within_tolerance():
    """fp16: an error inside the tolerance but beyond 2x eager's own error fails, with the reason;
    the floor (eps16 x max|ref| = 1.95e-3) is below both the failing and the passing error, so the
    2x rule decides both."""
    from normexport.parity import Row
    from normexport.parity.verdict import _compare

    ref = np.linspace(-2.0, 2.0, 101)
    eager = ref + 1.5e-3  # eager's own error 1.5e-3; limit = max(3e-3, floor 1.95e-3) = 3e-3
    tol = tolerance_for(torch.float16, 2.0)  # 4e-3
    floor = torch.finfo(torch.float16).eps * 2.0
    row = _compare(Row("ort", 0, {"x": [101]}, "y", "float16"), ref + 3.3e-3, ref, eager, torch.float16, 1.5e-3, None, None)
    assert floor < 2.7e-3 < 3e-3 < row.max_abs_err < tol and not row.passed
    assert row.limit == pytest.approx(3e-3) and row.rule == "2x eager"
    assert "2 x eager" in row.reason and "worst at index" in row.reason
    ok = _compare(Row("ort", 0, {"x": [101]}, "y", "float16"), ref + 2.7e-3, ref, eager, torch.float16, 1.5e-3, None, None)
    assert ok.passed and ok.max_abs_err > ok.floor


def test_float64_reference_keeps_float32_casts_in_float64():
    """`.float()` / dtype=float32 inside forward stay float64 in the reference run, so eager's
    float32 rounding shows as its own error instead of hiding in the reference."""

    class Casts(nn.Module):
        def forward(self, x):
            third = torch.full(x.shape, 1.0, dtype=torch.float32) / 3
            return x.float() * 3.1 + third

    m = Casts().eval()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    report = check(export(m, (x,)), m, (x,))
    assert report.passed and report.fp64_reference["available"]
    assert report.rows[0].ref_err_fp64 > 0


# ---- docs/design.md §7: within tolerance *and* <= 2x eager's own error (fp32 too) -------------------------
def _perturb_initializer(model: onnx.ModelProto, name: str, delta: float, index: int = 0) -> onnx.ModelProto:
    """A copy with element `index` of initializer `name` moved by `delta`."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    init = next(t for t in m.graph.initializer if t.name == name)
    arr = onnx.numpy_helper.to_array(init).copy()
    arr.reshape(-1)[index] += delta
    init.CopyFrom(onnx.numpy_helper.from_array(arr, name))
    return m


def test_within_tolerance_but_beyond_twice_eager_fails_fp32(mlp, tmp_path, capsys):
    """An fp32 ONNX file whose output bias is off by 0.4 x tolerance: inside the absolute
    tolerance, far beyond 2x eager's own error (and the 4 eps floor) -> fails, exit 1."""
    m, inputs, model, _ = mlp
    good = check(model, m, inputs)
    assert good.passed, good.table()
    row0 = good.rows[0]  # output 0 = fc2(...), whose bias we move
    assert row0.limit < row0.tolerance  # the 2x rule is in force in fp32
    assert row0.limit == pytest.approx(max(2 * row0.ref_err_fp64, 4 * torch.finfo(torch.float32).eps * row0.max_abs_ref))
    bias = next(t.name for t in model.graph.initializer if t.name.endswith("fc2.bias"))
    delta = 0.4 * row0.tolerance
    assert delta > 4 * row0.limit
    bad_model = _perturb_initializer(model, bias, delta)
    bad = check(bad_model, m, inputs, plain_export=True)  # the plain export does not rescue it
    r = bad.rows[0]
    assert r.max_abs_err < r.tolerance and r.max_abs_err > 2 * r.ref_err_fp64 and r.max_abs_err > r.limit
    assert not r.passed and not bad.passed
    assert r.rule == "plain export" and r.plain_err is not None and r.plain_err < r.max_abs_err / 4
    assert "2 x eager" in r.reason and "adds error" in r.reason
    assert bad.plain_export["built"] is True
    assert bad.rows[1].plain_err is None and bad.rows[1].rule == "2x eager"  # computed only where rule 1 fails
    assert bad.rows[1].passed  # the other output is untouched
    d = bad.to_dict()
    row_json = d["results"]["ort"][r.output][0]
    for key in ("max_abs_err", "max_rel_err", "mean_abs_err", "ref_err_fp64", "tolerance", "passed", "limit",
                "plain_err", "rule", "floor", "warning"):
        assert key in row_json
    assert row_json["passed"] is False and row_json["rule"] == "plain export"
    assert "2 x ref_err_fp64" in d["limit_rule"] and d["plain_export"]["built"] is True
    path = tmp_path / "mlp_bias.onnx"
    onnx.save(bad_model, str(path))
    capsys.readouterr()
    assert check_cmd.run(_cli_args(path, "--reference", "test_check:make_mlp_with_inputs")) == 1
    assert "2 x eager" in capsys.readouterr().out


# ---- dtype: judge an fp16 ONNX file in fp16 ----------------------------------------------------------
@pytest.fixture(scope="module")
def llama16(tmp_path_factory):
    import normexport

    block = llama_tiny().half()
    (x,) = block.example_inputs()
    model = normexport.convert_module(block, (x,), target="trt", input_names=["x"], dynamic_axes={"x": [0, 1]})
    d = tmp_path_factory.mktemp("llama16")
    onnx.save(model, str(d / "llama16.onnx"))
    onnx.save(perturb(model, 1e-2), str(d / "llama16_bad.onnx"))
    return model, d


def test_cli_check_float16_file_in_float16(llama16, tmp_path, capsys):
    """`normexport check llama16.onnx --reference normexport.models.llama:tiny` (an fp32 factory): the dtype
    comes from the ONNX input; eager runs in fp16 and the 2x rule compares with eager fp16."""
    model, d = llama16
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    out = tmp_path / "r.json"
    assert check_cmd.run(_cli_args(d / "llama16.onnx", "--reference", LLAMA_TINY, "--json", out)) == 0
    text = capsys.readouterr().out
    assert "eager in float16 (ONNX input 'x')" in text and "PASSED" in text
    rep = json.loads(out.read_text())
    assert rep["dtype"] == "float16" and rep["inputs"][0]["dtype"] == "float16"
    (rows,) = rep["results"]["ort"].values()
    assert len(rows) == 3 and all(r["passed"] for r in rows)
    # eager's own error is that of float16 (~1e-3), not float32 (~1e-6)
    assert all(r["ref_err_fp64"] > 1e-4 and r["limit"] <= r["tolerance"] for r in rows)
    # explicit --dtype, and the perturbed fp16 file fails
    assert check_cmd.run(_cli_args(d / "llama16.onnx", "--reference", LLAMA_TINY, "--dtype", "float16")) == 0
    assert "eager in float16 (--dtype)" in capsys.readouterr().out
    assert check_cmd.run(_cli_args(d / "llama16_bad.onnx", "--reference", LLAMA_TINY,
                                   "--dtype", "float16")) == 1
    assert "FAILED" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        _cli_args(d / "llama16.onnx", "--reference", LLAMA_TINY, "--dtype", "int8")


def test_float32_file_is_not_cast(mlp):
    m, inputs, model, _ = mlp
    report = check(model, m, inputs)
    assert report.dtype is None and report.to_dict()["dtype"] is None
    assert check(model, m, inputs, dtype="float32").dtype == "float32"


# ---- shapes: skipped / static / nothing compared --------------------------------------------------
class _OnlyShape(nn.Module):
    """Accepts only the shape it was made for (the ONNX file is dynamic)."""

    def __init__(self, inner, shape):
        super().__init__()
        self.inner, self.shape = inner, tuple(shape)

    def forward(self, x):
        if tuple(x.shape) != self.shape:
            raise ValueError(f"only {self.shape}")
        return self.inner(x)


def test_summary_says_shapes_checked_and_skipped(rms, mlp):
    m, x, _, path = rms
    report = check(path, _OnlyShape(m, x.shape), (x,), dynamic_axes={"x": [0, 1]}, extra_shapes=2)
    assert report.passed, report.table()  # skipped shapes stay skipped, the given one passed
    last = report.table().splitlines()[-1]
    assert "1 shape(s) checked (2 skipped: the reference model rejects" in last, last
    assert report.to_dict()["shapes_summary"].startswith("1 shape(s) checked (2 skipped")
    full = check(path, m, (x,), dynamic_axes={"x": [0, 1]}, extra_shapes=2)
    assert "3 shape(s) checked (0 skipped)" in full.table().splitlines()[-1]
    m2, inputs, model, _ = mlp  # static ONNX inputs: no extra shape can be checked
    static = check(model, m2, inputs)
    assert "1 shape(s) checked (no extra shapes: no dynamic axes" in static.table().splitlines()[-1]
    assert "extra_shapes is 0" in check(path, m, (x,), dynamic_axes={"x": [0]}, extra_shapes=0).table()


def test_zero_rows_compared_is_a_failure(rms):
    """Empty outputs: every row 'passes' trivially, but nothing was compared -> fail."""
    m, _, _, path = rms
    empty = torch.zeros(0, 6, 32)
    report = check(path, m, (empty,))
    assert report.rows and all(r.passed and r.elements == 0 for r in report.rows)
    assert not report.passed
    assert "nothing compared in ort" in report.table().splitlines()[-1]
    assert report.to_dict()["backends"]["ort"] == {"status": "failed", "rows_compared": 0,
                                                   "error": "nothing was compared"}
    with pytest.raises(AssertionError, match="nothing was compared"):
        assert_parity(m, path, (empty,))


def test_cli_usage_errors_exit_2_in_a_subprocess(mlp, tmp_path):
    """Through the installed entry point (cli.main): exit 2, one stderr line, no traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    _, _, _, d = mlp
    exe = Path(sys.executable).with_name("normexport")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "normexport"]
    cases = [
        (["check", str(tmp_path / "missing.onnx"), "--reference", LLAMA_TINY], "ONNX file not found"),
        (["check", str(d / "mlp.onnx"), "--reference", str(tmp_path / "missing.pt2")], "not found"),
        (["check", str(d / "mlp.onnx"), "--reference", "test_check:make_mlp", "--input", "x:4xq16",
          "--input", "y:4x16"], "malformed"),
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    for argv, needle in cases:
        r = subprocess.run(cmd + argv, capture_output=True, text=True, env=env, cwd=Path(__file__).parent.parent)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert lines[0].startswith("normexport: error:") and needle in lines[0], lines[0]


# ---- sizes: --input, or sizes the ONNX file runs at (issue 14 item 7) --------------------------
class TinyUNet(nn.Module):
    """Conv + BatchNorm (non-default stats), two stride-2 levels, nearest upsample + Add skips: runs
    only when H and W are multiples of 4 (elsewhere the Add cannot broadcast). No example inputs."""

    def __init__(self, c: int = 4):
        super().__init__()

        def block(i, o, stride):
            bn = nn.BatchNorm2d(o)
            with torch.no_grad():
                bn.running_mean.normal_(0.0, 0.5)
                bn.running_var.uniform_(0.5, 2.0)
                bn.weight.normal_(1.0, 0.3)
                bn.bias.normal_(0.0, 0.3)
            return nn.Sequential(nn.Conv2d(i, o, 3, stride, 1), bn, nn.ReLU())

        self.stem = block(3, c, 1)
        self.down = nn.ModuleList([block(c, c, 2), block(c, c, 2)])
        self.head = nn.Conv2d(c, 2, 1)

    def forward(self, x):
        x = self.stem(x)
        skips = []
        for down in self.down:
            skips.append(x)
            x = down(x)
        for skip in reversed(skips):
            x = nn.functional.interpolate(x, scale_factor=2.0, mode="nearest") + skip
        return self.head(x)


def make_unet():
    torch.manual_seed(14)
    return TinyUNet().eval()


@pytest.fixture(scope="module")
def unet(tmp_path_factory):
    """make_unet() through the TorchScript-based exporter (opset 17), N, H, W dynamic."""
    import io

    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(make_unet(), (torch.randn(1, 3, 32, 32),), f, dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "N", 2: "H", 3: "W"}})
    path = tmp_path_factory.mktemp("unet") / "unet.onnx"
    path.write_bytes(f.getvalue())
    return path


def test_cli_check_without_input_finds_sizes_and_says_which(unet, rms, tmp_path, capfd):
    """No --input and a reference without example inputs: check runs at sizes the ONNX file takes
    (image dims in multiples of 32, a sequence of 8 by a fixed width 32), says which, and compares
    there (and at the extra shapes the reference accepts); onnxruntime writes nothing to stderr."""
    out = tmp_path / "r.json"
    assert check_cmd.run(_cli_args(unet, "--reference", "test_check:make_unet", "--json", out)) == 0
    text, err = capfd.readouterr()
    assert "  verified at x: 2x3x64x96 (discovered: tried 1 size set(s))" in text.splitlines()
    assert "PASSED" in text and err == ""
    rep = json.loads(out.read_text())
    assert rep["sizes"] == "discovered: tried 1 size set(s)"
    assert rep["inputs"] == [{"name": "x", "shape": [2, 3, 64, 96], "dtype": "float32"}]
    (rows,) = rep["results"]["ort"].values()
    # extra shapes step image dims by their power-of-two alignment (96x128, not 65x97, which it cannot take)
    assert [r["input_shapes"]["x"] for r in rows] == [[2, 3, 64, 96], [3, 3, 96, 128], [4, 3, 128, 192]]
    # passed by either legitimate rule (tests/test_verdict*.py test which rule decides where)
    assert all(r["passed"] and r["rule"] in ("2x eager", "plain export") and r["max_abs_err"] > 0 for r in rows)
    assert not any("skipped" in s for s in rep["shapes"])

    _, x, _, path = rms  # dims N x S x 32: batch 2, sequence 8
    assert check_cmd.run(_cli_args(path, "--reference", "test_check:make_rms_block")) == 0
    text, err = capfd.readouterr()
    assert "  verified at x: 2x8x32 (discovered: tried 1 size set(s))" in text.splitlines() and err == ""


def test_cli_check_input_sizes_are_used(unet, capfd):
    assert check_cmd.run(_cli_args(unet, "--reference", "test_check:make_unet", "--input", "x:1x3x32x40",
                                   "--extra-shapes", "0")) == 0
    text, err = capfd.readouterr()
    assert "  verified at x: 1x3x32x40 (--input)" in text.splitlines() and err == ""
    assert "ort      x=1x3x32x40" in text and "1/1 rows" in text
    # extra shapes: batch + 1, and H, W by their alignment (32 -> 64, 40 = 8 x 5 -> 48)
    assert check_cmd.run(_cli_args(unet, "--reference", "test_check:make_unet", "--input", "x:1x3x32x40",
                                   "--extra-shapes", "1")) == 0
    text, err = capfd.readouterr()
    assert "ort      x=2x3x64x48" in text and "(0 skipped), 2/2 rows" in text and err == ""


def test_cli_check_example_inputs_say_so(mlp, capsys):
    _, _, _, d = mlp
    assert check_cmd.run(_cli_args(d / "mlp.onnx", "--reference", "test_check:make_mlp_with_inputs")) == 0
    assert "  verified at x: 4x16, y: 4x16 (example inputs of test_check:make_mlp_with_inputs)" in capsys.readouterr().out
    # a file with fixed dims and a reference without example inputs: its static dims
    assert check_cmd.run(_cli_args(d / "mlp.onnx", "--reference", "test_check:make_mlp")) == 0
    assert "  verified at x: 4x16, y: 4x16 (static dims)" in capsys.readouterr().out
    # one input given by name, the other found
    assert check_cmd.run(_cli_args(d / "mlp.onnx", "--reference", "test_check:make_mlp", "--input", "y:4x16")) == 0
    assert "  verified at x: 4x16, y: 4x16 (--input)" in capsys.readouterr().out  # x's dims are fixed


def test_cli_check_bad_input_is_one_line_exit_2(unet, tmp_path, cli):
    """A wrong name, a wrong rank, and sizes neither the model nor the file take are one stderr
    line, exit 2; no --json file is left. The first through the entry point (a process), the others
    by main() in this process (a Python start per case costs seconds of CI, docs/design.md §16)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("normexport")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "normexport"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "r.json"
    cases = [
        ("image:1x3x64x64", "--input 'image': the model has no input 'image' (its inputs: x); use one of those names"),
        ("x:1x64x64", "--input 'x': the model's input 'x' has rank 4 (Nx3xHxW), --input gives 3 dims; give 4 sizes"),
        ("x:1x4x64x64", "--input 'x': axis 1 is fixed to 3 in the model (Nx3xHxW), --input says 4; give 3 there"),
        ("x:1x3x30x30", "the reference model rejected inputs of shape 1x3x30x30"),
    ]
    for i, (given, needle) in enumerate(cases):
        argv = ["check", str(unet), "--reference", "test_check:make_unet", "--input", given, "--json", str(out)]
        if i == 0:
            r = subprocess.run(cmd + argv, capture_output=True, text=True, env=env)
            code, stdout, stderr = r.returncode, r.stdout, r.stderr
        else:
            code, stdout, stderr = cli(*argv)
        assert code == 2, (given, stdout, stderr)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("normexport: error: ") and needle in lines[0], stderr
        assert not out.exists()
