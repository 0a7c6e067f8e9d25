"""The parity verdict (docs/design.md §7) on outputs whose right answer is known without normexport: small
ONNX graphs written here with onnx.helper, eager modules computing the same thing, and every
expected error recomputed in float64 numpy. Nothing here trusts normexport's own verdict to judge
itself: each test first establishes the facts in numpy (where the values are NaN / inf, eager's
error, the file's error), then asks `check` and compares.

- NaN / inf in the file only, in eager only, in both, and in all three (eager, file and the
  float64 reference), with the verdict each should get
- the 2x-eager rule at its boundary: a file just under and just over 2x eager's own error, in
  float32 and float16, where the floor of the rule is far below and does not decide
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from normexport.parity import check
from normexport.parity.report import Row
from normexport.parity.verdict import _compare

H = 8
_ELEM = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}


def _graph(nodes, inits: dict, shape, dtype=np.float32) -> onnx.ModelProto:
    elem = _ELEM[dtype]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, list(shape))],
                          [helper.make_tensor_value_info("y", elem, list(shape))],
                          [numpy_helper.from_array(np.asarray(v, dtype if np.asarray(v).dtype.kind == "f" else None), k)
                           for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def affine_file(scale: np.ndarray, shift: np.ndarray, shape) -> onnx.ModelProto:
    """y = x * scale + shift (broadcast over the last axis)."""
    return _graph([helper.make_node("Mul", ["x", "s"], ["t"]), helper.make_node("Add", ["t", "b"], ["y"])],
                  {"s": scale, "b": shift}, shape)


class Affine(nn.Module):
    """The eager model of affine_file."""

    def __init__(self, scale, shift):
        super().__init__()
        self.register_buffer("s", torch.tensor(np.asarray(scale, np.float32)))
        self.register_buffer("b", torch.tensor(np.asarray(shift, np.float32)))

    def forward(self, x):
        return x * self.s + self.b


def _x(rows=4, seed=0, lo=0.5, hi=2.0):
    return torch.tensor(np.random.default_rng(seed).uniform(lo, hi, (rows, H)).astype(np.float32))


def _only_row(report):
    (row,) = report.rows
    return row


# ---- NaN / inf ---------------------------------------------------------------------------------------
S = np.linspace(0.5, 1.5, H).astype(np.float32)
B = np.linspace(-1.0, 1.0, H).astype(np.float32)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_in_the_file_only_fails(bad):
    """eager and the float64 reference are finite everywhere; the file has one column of NaN / inf
    (a shift of NaN / inf in its initializer): FAIL, the error is inf, the reason names the place."""
    x = _x()
    shift = B.copy()
    shift[3] = bad
    file = affine_file(S, shift, x.shape)
    ref64 = x.numpy().astype(np.float64) * S.astype(np.float64) + B.astype(np.float64)
    assert np.isfinite(ref64).all()  # the facts, from numpy
    report = check(file, Affine(S, B), (x,))
    r = _only_row(report)
    assert not r.passed and not report.passed, report.table()
    assert r.max_abs_err == math.inf
    assert r.worst_index[1] == 3 and r.worst_ref == pytest.approx(ref64[tuple(r.worst_index)])
    assert "non-finite" in r.reason and "FAILED" in report.table()
    assert report.fp64_reference["available"] and r.ref_err_fp64 is not None and math.isfinite(r.ref_err_fp64)


def test_nan_in_the_file_where_the_reference_is_inf_fails():
    """All three should be +inf in column 0 (a scale of inf); the file has NaN there instead (a
    different non-finite value): FAIL. The same file with +inf passes; with -inf it fails."""
    x = _x(seed=1)
    scale = S.copy()
    scale[0] = np.inf
    ref64 = x.numpy().astype(np.float64) * scale.astype(np.float64) + B
    assert np.isposinf(ref64[:, 0]).all() and np.isfinite(ref64[:, 1:]).all()
    eager = Affine(scale, B)
    same = check(affine_file(scale, B, x.shape), eager, (x,))
    assert same.passed and _only_row(same).max_abs_err < 1e-5, same.table()  # matching +inf counts 0
    for bad in (np.nan, -np.inf):
        file_scale = scale.copy()
        file_scale[0] = bad
        report = check(affine_file(file_scale, B, x.shape), eager, (x,))
        r = _only_row(report)
        assert not r.passed and r.max_abs_err == math.inf and r.worst_index[1] == 0, report.table()
        assert "non-finite" in r.reason


class NaiveSoftmax(nn.Module):
    """exp(x) / sum(exp(x)) without subtracting the max: float32 overflows (inf / inf = NaN) for
    rows with values near 100, float64 does not."""

    def forward(self, x):
        e = torch.exp(x)
        return e / e.sum(-1, keepdim=True)


def _softmax_inputs():
    x = np.random.default_rng(2).standard_normal((4, H)).astype(np.float32)
    x[1] += 95.0  # exp(95 + 1.x) > float32 max: this row overflows in float32
    return torch.tensor(x)


def _softmax64(x: torch.Tensor) -> np.ndarray:
    x64 = x.numpy().astype(np.float64)
    e = np.exp(x64)
    return e / e.sum(-1, keepdims=True)


def _softmax_facts(x):
    ref64 = _softmax64(x)
    eager = NaiveSoftmax()(x).numpy()
    assert np.isfinite(ref64).all()
    assert np.isnan(eager[1]).any() and np.isfinite(eager[[0, 2, 3]]).all()
    return ref64, eager


def test_nan_in_eager_only_passes_judged_where_eager_is_finite():
    """Eager float32 overflows to NaN in one row, float64 does not, and the file (a stable
    Softmax node) is right everywhere: PASS by the 2x-eager rule, with eager's error taken where
    eager is finite, and a warning that eager itself is non-finite."""
    x = _softmax_inputs()
    ref64, eager = _softmax_facts(x)
    file = _graph([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], {}, x.shape)
    fine = np.isfinite(eager)
    eager_err = float(np.abs(eager[fine].astype(np.float64) - ref64[fine]).max())
    report = check(file, NaiveSoftmax(), (x,))
    r = _only_row(report)
    assert r.ref_err_fp64 == pytest.approx(eager_err, rel=1e-9, abs=1e-15)
    assert report.passed and r.passed and r.rule == "2x eager", report.table()
    assert r.max_abs_err < 1e-6  # onnxruntime's stable softmax against float64
    assert r.warning and "non-finite" in r.warning and "eager" in r.warning


def test_nan_in_eager_and_in_the_file_where_the_reference_is_finite_fails():
    """The naive softmax exported as it is: the file overflows in the same row as eager. The file
    has NaN where the float64 reference is finite: FAIL (a NaN output is no parity, whatever eager
    does), and the reason says that eager is non-finite there too."""
    x = _softmax_inputs()
    ref64, eager = _softmax_facts(x)
    file = _graph([helper.make_node("Exp", ["x"], ["e"]),
                   helper.make_node("ReduceSum", ["e", "axes"], ["s"], keepdims=1),
                   helper.make_node("Div", ["e", "s"], ["y"])], {"axes": np.array([-1], np.int64)}, x.shape)
    report = check(file, NaiveSoftmax(), (x,))
    r = _only_row(report)
    assert not r.passed and not report.passed and r.max_abs_err == math.inf, report.table()
    assert r.worst_index[0] == 1 and np.isnan(eager[tuple(r.worst_index)])
    assert "non-finite" in r.reason and "eager nan" in r.reason


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


def test_nan_and_inf_in_eager_file_and_reference_alike_pass():
    """log of negative numbers (NaN) and of 0 (-inf) in float32, float64 and onnxruntime alike:
    matching non-finite values count 0, the finite ones are judged as usual: PASS."""
    x = _x(seed=3)
    x[0, :2] = -1.0
    x[2, 5] = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        ref64 = np.log(x.numpy().astype(np.float64))
    assert np.isnan(ref64[0, :2]).all() and np.isneginf(ref64[2, 5])
    report = check(_graph([helper.make_node("Log", ["x"], ["y"])], {}, x.shape), Log(), (x,))
    r = _only_row(report)
    assert report.passed and r.passed and math.isfinite(r.max_abs_err), report.table()
    assert r.max_abs_err <= max(2 * r.ref_err_fp64, r.floor)


# ---- the 2x-eager rule at its boundary ------------------------------------------------------------
class RoundTrip(nn.Module):
    """(x + big) - big: exact in float64, rounded to the grid of `big` in float32 / float16, so
    eager's own error is known in advance (up to half the spacing of that grid)."""

    def __init__(self, big: float):
        super().__init__()
        self.big = big

    def forward(self, x):
        return (x + self.big) - self.big


#: dtype -> (numpy dtype, big). The grids: 2^-17 at 64 (float32), 2^-9 at 2 (float16); with
#: max|x| = 1.25, eager's own error (up to 3.8e-6, 9.8e-4) sits below half the tolerance and above
#: the floor (4 eps32 x max|ref| = 6e-7; eps16 x max|ref| = 1.2e-3, below 2x eager's error).
_BOUNDARY = {"float32": (np.float32, 64.0), "float16": (np.float16, 2.0)}


def _boundary_case(dtype: str, factor: float):
    np_dtype, big = _BOUNDARY[dtype]
    rng = np.random.default_rng(7)
    x = rng.uniform(0.05, 1.0, (8, H)).astype(np_dtype)
    x[0, 0] = 0.01  # the element the file moves: small, so its own rounding is far below the margin
    x[7, 7] = 1.25  # max|ref|, and so the tolerance and the floor
    x64 = x.astype(np.float64)
    eager = ((x + np_dtype(big)) - np_dtype(big)).astype(np.float64)  # numpy in the dtype
    eager_err = float(np.abs(eager - x64).max())
    delta = np.zeros((8, H), np_dtype)
    delta[0, 0] = factor * eager_err
    file_out = (x + delta).astype(np.float64)  # the file: y = x + delta, one rounding in the dtype
    file_err = float(np.abs(file_out - x64).max())
    file = _graph([helper.make_node("Add", ["x", "d"], ["y"])], {"d": delta}, x.shape, np_dtype)
    return x, file, eager_err, file_err, float(np.abs(x64).max())


@pytest.mark.parametrize("factor", [1.9, 2.1], ids=["just-under-2x", "just-over-2x"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_twice_eager_boundary(dtype, factor):
    x, file, eager_err, file_err, max_ref = _boundary_case(dtype, factor)
    t = getattr(torch, dtype)
    floor = (4 if dtype == "float32" else 1) * torch.finfo(t).eps * max_ref
    # the facts, from numpy: the file's error is within 3% of factor x eager's, the floor is far below
    assert file_err == pytest.approx(factor * eager_err, rel=0.03)
    assert floor < 1.5 * eager_err  # the limit is 2x eager's error, not the floor, on both sides
    expected = file_err <= 2 * eager_err
    assert expected is (factor < 2)
    report = check(file, RoundTrip(_BOUNDARY[dtype][1]), (torch.tensor(x),))
    r = _only_row(report)
    assert r.dtype == dtype and r.rule == "2x eager"
    assert r.ref_err_fp64 == pytest.approx(eager_err, rel=1e-6)
    assert r.max_abs_err == pytest.approx(file_err, rel=1e-6)
    assert r.floor == pytest.approx(floor, rel=1e-6)
    assert r.limit == pytest.approx(2 * eager_err, rel=1e-6)
    assert r.passed is expected and report.passed is expected, report.table()
    if not expected:
        assert "2 x eager" in r.reason and "no plain export" in r.reason
    assert r.max_abs_err < r.tolerance  # within the tolerance either way: the 2x rule alone decides


@pytest.mark.parametrize("dtype, max_ref, eager_err", [("float32", 3.0, 2e-6), ("float16", 2.0, 2.5e-3)])
def test_twice_eager_boundary_in_compare(dtype, max_ref, eager_err):
    """The same boundary on arrays: float64 reference, eager off by eager_err, the file off by
    1.95x and 2.05x that (floor well below 2x eager)."""
    t = getattr(torch, dtype)
    ref = np.linspace(-max_ref, max_ref, 64)
    floor = (4 if dtype == "float32" else 1) * torch.finfo(t).eps * max_ref
    assert floor < eager_err
    for factor, expected in ((1.95, True), (2.05, False)):
        got = ref.copy()
        got[10] += factor * eager_err
        row = _compare(Row("ort", 0, {"x": [64]}, "y", dtype), got, ref, ref + eager_err, t, eager_err, None, None)
        assert row.max_abs_err == pytest.approx(factor * eager_err)
        assert row.passed is expected and row.rule == "2x eager", (factor, row)
        assert row.limit == pytest.approx(2 * eager_err)


# ---- the floor, the plain-export rule and the tolerance rule at their boundaries (arrays) ---------
def _row(dtype: str, n: int) -> Row:
    return Row("ort", 0, {"x": [n]}, "y", dtype)


@pytest.mark.parametrize("dtype, k", [("float32", 4), ("float16", 1)])
def test_floor_boundary_in_compare(dtype, k):
    """eager exact: the limit is the floor, k x eps(dtype) x max|ref| (§7: k = 4 in float32, 1 in
    float16); 0.99x passes, 1.01x fails."""
    t = getattr(torch, dtype)
    eps = {"float32": 2.0 ** -23, "float16": 2.0 ** -10}[dtype]
    ref = np.linspace(-3.0, 2.0, 64)
    floor = k * eps * 3.0
    for factor, expected in ((0.99, True), (1.01, False)):
        got = ref.copy()
        got[20] += factor * floor
        row = _compare(_row(dtype, 64), got, ref, ref.copy(), t, 0.0, None, None)
        assert row.floor == pytest.approx(floor, rel=1e-12) and row.limit == pytest.approx(floor, rel=1e-12)
        assert row.passed is expected and row.rule == "2x eager", (factor, row)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_plain_export_boundary_in_compare(dtype):
    """Rule 1 failed (the file 10x eager's error): rule 2 passes at 0.999 x (1.25 x the plain export's
    error + floor) and fails at 1.001x, asked once, with the reason naming the plain export."""
    t = getattr(torch, dtype)
    eps, k = {"float32": (2.0 ** -23, 4), "float16": (2.0 ** -10, 1)}[dtype]
    ref = np.linspace(-2.0, 2.0, 64)
    eager_err = 30 * eps
    plain_err = 200 * eps
    limit = 1.25 * plain_err + k * eps * 2.0
    for factor, expected in ((0.999, True), (1.001, False)):
        got = ref.copy()
        got[33] += factor * limit
        asked = []
        row = _compare(_row(dtype, 64), got, ref, ref + eager_err, t, eager_err, None, None,
                       plain=lambda: asked.append(1) or (plain_err, None))
        assert asked == [1] and row.plain_err == plain_err
        assert row.limit == pytest.approx(limit, rel=1e-12) and row.rule == "plain export"
        assert row.passed is expected, (factor, row)
        if not expected:
            assert "adds error" in row.reason


@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-5), ("float16", 2e-3)])
def test_tolerance_rule_boundary_without_a_float64_reference(dtype, rtol):
    """No float64 reference (eager_err None): the limit is the tolerance, rtol x max|ref| + atol
    (§7: 1e-5 / 1e-6 in float32, 2e-3 / 0 in float16); 0.99x passes, 1.01x fails."""
    t = getattr(torch, dtype)
    atol = 1e-6 if dtype == "float32" else 0.0
    ref = np.linspace(-1.0, 4.0, 64)
    tol = rtol * 4.0 + atol
    for factor, expected in ((0.99, True), (1.01, False)):
        got = ref.copy()
        got[1] += factor * tol
        row = _compare(_row(dtype, 64), got, ref, ref.copy(), t, None, None, None)
        assert row.rule == "tolerance" and row.limit == pytest.approx(tol, rel=1e-12)
        assert row.passed is expected, (factor, row)


def test_non_finite_reference_where_eager_is_finite_judged_against_eager():
    """The float64 reference NaN in one row where eager is finite (a float64 run overflowing in masked
    attention rows): there |file - eager| <= tolerance decides (float32: 1e-5 x max + 1e-6), the rest
    by 2x eager; just inside passes with a warning, just past fails, and a whole NaN reference is
    judged by the tolerance alone (rule 'tolerance'). Never passed or failed on NaN itself."""
    ref = np.linspace(-2.0, 2.0, 64).reshape(8, 8)
    eager = ref + 1e-6
    ref[5] = np.nan
    eager[5] = np.linspace(-3.0, 3.0, 8)
    tol = 1e-5 * 3.0 + 1e-6
    base = eager.copy()
    base[np.isfinite(ref)] = ref[np.isfinite(ref)] + 1.5e-6
    for factor, expected in ((0.99, True), (1.01, False)):
        got = base.copy()
        got[5, 6] += factor * tol
        row = _compare(Row("ort", 0, {"x": [8, 8]}, "y", "float32"), got, ref, eager, torch.float32, 1e-6, None, None)
        assert row.max_abs_err == pytest.approx(1.5e-6, rel=1e-6) and row.rule == "2x eager"
        assert row.passed is expected, (factor, row)
        text = row.warning if expected else row.reason
        assert "non-finite at 8 element(s) where eager is finite" in text and f"{tol:.3g}" in text
    got = base.copy()
    got[0, 0] += 2.1e-6  # the rest: past 2x eager, whatever the NaN row does
    assert _compare(Row("ort", 0, {"x": [8, 8]}, "y", "float32"), got, ref, eager, torch.float32, 1e-6, None,
                    None).passed is False
    whole = np.full_like(ref, np.nan)
    for factor, expected in ((0.99, True), (1.01, False)):
        got = eager.copy()
        got[2, 2] += factor * tol
        row = _compare(Row("ort", 0, {"x": [8, 8]}, "y", "float32"), got, whole, eager, torch.float32, 0.0, None, None)
        assert row.rule == "tolerance" and row.passed is expected, (factor, row)


def test_non_finite_plain_export_excuses_nothing():
    """A plain export with NaN / inf where the float64 reference is finite has an infinite error; 1.25
    x inf would excuse any file: it excuses nothing (rule 1 decides, the reason says why)."""
    ref = np.linspace(-1.0, 1.0, 64)
    got = ref.copy()
    got[9] += 1e-3  # far past 2x eager's 1e-6
    for plain_err in (math.inf, math.nan):
        row = _compare(_row("float32", 64), got, ref, ref + 1e-6, torch.float32, 1e-6, None, None,
                       plain=lambda plain_err=plain_err: (plain_err, None))
        assert row.passed is False and row.rule == "2x eager", row
        assert "excuses nothing" in row.reason
