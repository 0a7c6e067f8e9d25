"""Numeric verification of a rewrite: run two models in onnxruntime (CPU) on the same random
inputs and compare every graph output within DESIGN §7 tolerances."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import tempfile
from typing import Any

import ml_dtypes
import numpy as np
import onnx

#: relative part / absolute part of the tolerance per output dtype (DESIGN §7)
_TOL = {
    np.dtype(np.float32): (1e-5, 1e-6),
    np.dtype(np.float64): (1e-5, 1e-6),
    np.dtype(np.float16): (2e-3, 0.0),
}
BF16_TOL = (1.6e-2, 0.0)
#: numpy has no bfloat16: onnx's own dependency ml_dtypes provides it; onnxruntime takes and gives
#: it as raw 16-bit OrtValues
BF16 = np.dtype(ml_dtypes.bfloat16)


def np_dtype(elem_type: int) -> np.dtype | None:
    if elem_type == onnx.TensorProto.BFLOAT16:
        return BF16
    try:
        dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except Exception:  # float8 and friends
        return None
    return dt if dt.kind in "fiub" else None


def session(model: onnx.ModelProto):
    """A quiet onnxruntime CPU session for `model` (one thread, logs nothing: its errors come
    back as exceptions, which the callers quote in one line)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    # a one-off run: no second, pre-packed copy of the MatMul / Conv weights
    so.add_session_config_entry("session.disable_prepacking", "1")
    if model.ByteSize() < 1_500_000_000:
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory() as tmp:  # protobuf limit: go through a file with external data
        path = os.path.join(tmp, "m.onnx")
        onnx.save(model, path, save_as_external_data=True, location="m.data")
        return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def run_session(sess, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of `sess` on `feeds` (bfloat16 in and out as ml_dtypes arrays)."""
    import onnxruntime as ort

    ro = ort.RunOptions()
    ro.log_severity_level = 4
    names = [o.name for o in sess.get_outputs()]
    if not any(a.dtype == BF16 for a in feeds.values()) and all(o.type != "tensor(bfloat16)" for o in sess.get_outputs()):
        return dict(zip(names, sess.run(names, feeds, ro)))
    values = {k: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint16), onnx.TensorProto.BFLOAT16)
              if a.dtype == BF16 else ort.OrtValue.ortvalue_from_numpy(a) for k, a in feeds.items()}
    return {n: _from_ort(v) for n, v in zip(names, sess.run_with_ort_values(names, values, ro))}


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return run_session(session(model), feeds)


def _from_ort(v) -> np.ndarray:
    """A CPU OrtValue as numpy; bfloat16 copied out bit for bit as ml_dtypes.bfloat16."""
    if v.data_type() != "tensor(bfloat16)":
        return v.numpy()
    shape = tuple(v.shape())
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return np.zeros(shape, dtype=BF16)
    raw = np.ctypeslib.as_array((ctypes.c_uint16 * n).from_address(v.data_ptr()))
    return raw.copy().view(BF16).reshape(shape)


@dataclasses.dataclass
class Comparison:
    output: str
    max_abs_err: float
    max_rel_err: float
    mean_abs_err: float
    tolerance: float
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ref_err_fp64"] = None  # the reference is the original graph, not an fp64 formula
        return d


def compare(ref: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> list[Comparison]:
    out = []
    for name, r in ref.items():
        if name not in got:
            out.append(Comparison(name, float("inf"), float("inf"), float("inf"), 0.0, False))
            continue
        g = got[name]
        if g.shape != r.shape or g.dtype != r.dtype:
            out.append(Comparison(name, float("inf"), float("inf"), float("inf"), 0.0, False))
            continue
        if r.dtype.kind not in "fc" and r.dtype != BF16:
            ok = bool(np.array_equal(r, g))
            e = 0.0 if ok else float("inf")
            out.append(Comparison(name, e, e, e, 0.0, ok))
            continue
        rel, ab = _TOL.get(r.dtype, BF16_TOL)
        r64, g64 = r.astype(np.float64), g.astype(np.float64)
        if r64.size == 0:
            out.append(Comparison(name, 0.0, 0.0, 0.0, 0.0, True))
            continue
        err = np.abs(r64 - g64)
        finite = np.isfinite(r64)
        same_nonfinite = bool(np.array_equal(r64[~finite], g64[~finite], equal_nan=True))
        errf = err[finite] if finite.any() else np.zeros(1)
        scale = float(np.max(np.abs(r64[finite]))) if finite.any() else 0.0
        tol = rel * scale + ab
        max_abs = float(errf.max())
        max_rel = float((errf / np.maximum(np.abs(r64[finite]), 1e-12)).max()) if finite.any() else 0.0
        out.append(Comparison(name, max_abs, max_rel, float(errf.mean()), tol,
                              bool(max_abs <= tol and same_nonfinite)))
    return out


def describe_failure(comps: list[Comparison]) -> str:
    bad = [c for c in comps if not c.passed]
    return "; ".join(f"output {c.output!r}: max abs err {c.max_abs_err:.3g} > tol {c.tolerance:.3g}" for c in bad)
