"""The CUDA kernel source, run on the CPU through a small emulation of the CUDA execution model
(tests/cuda_emu/emu.h: one host thread per CUDA thread, barriers for __syncthreads and warp
shuffles, blocks one after another), through the C ABI of plugins/include/normexport_kernels.h.

What this proves without a GPU: for every launch configuration the dispatcher picks (8/16/32
lanes per row, 1/2/4 vectors per thread, one block per row with 2 or 4 vectors per thread, or 8
scalars, the looped kernel), 16-byte vector and scalar paths, every dtype, [B,H] and full-shape
modulation, the fused residual ops (SkipRMSNorm, GatedAdaLNZero: both outputs), the
kernels read and write exactly the row's elements (guard cells around y stay untouched), every
lane reaches every shuffle and barrier (a lane that did not would time the barrier out and
the call would fail), and the results match float64 references written from the formulas within
docs/design.md §7's tolerances. The same kernels also run under AddressSanitizer + UBSan (no access
outside a tensor) and ThreadSanitizer (no race on shared memory between a block's threads). Every
kind of check is shown to fail on a planted kernel bug. What it does not prove: speed, or the
GPU's own arithmetic and memory model (rsqrtf is exact here) - tests/test_kernels_gpu.py does that
on a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess

import ml_dtypes
import numpy as np
import pytest

try:
    from tests._plugin_build import (build_emulated_kernels, build_emulated_sanitized_driver, find_cuda_include,
                                     load_kernels, sanitizer_unsupported)
except ImportError:  # tests/ not importable as a package: it is on sys.path itself
    from _plugin_build import (build_emulated_kernels, build_emulated_sanitized_driver, find_cuda_include, load_kernels,
                               sanitizer_unsupported)

if find_cuda_include() is None:
    pytest.skip("CUDA headers (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h) not found: set CUDA_HOME",
                allow_module_level=True)

DTYPES = {"fp32": (np.float32, 0), "fp16": (np.float16, 1), "bf16": (ml_dtypes.bfloat16, 2)}
REL_TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.6e-2}  # docs/design.md §7, relative to max|ref|
EPS = 1e-5
GUARD = 16
SENTINEL = 1234.5
# The launch each hidden size takes (fp32 vector width 4, half types 8; scalar path for odd sizes
# or misaligned pointers): group kernels with 8/16/32 lanes and 1/2/4 vectors per thread, block
# kernels with 2 or 4 vectors (vector path) or 2/4/8 scalars per thread, the looped kernel past
# them (16384 fp32: 4 vectors per thread; 6001: 8 scalars; 20000 fp32, 40000: looped).
HIDDEN = [1, 8, 37, 64, 128, 256, 512, 1000, 1032, 4096, 6001, 16384, 20000, 40000]
# The fused ops: one size per launch kind (group, scalar, block with 2 / 4 vectors, looped).
FUSED_HIDDEN = [8, 37, 256, 1000, 4096, 6001, 16384, 40000]


@pytest.fixture(scope="module")
def lib():
    try:
        return load_kernels(build_emulated_kernels())
    except RuntimeError as exc:
        pytest.fail(str(exc))


def _rows_for(hidden: int) -> int:
    """Enough rows to leave the last block of the group kernels partly empty (16 rows per block
    at 8 lanes), fewer for long rows (one host thread per CUDA thread)."""
    return 19 if hidden <= 1032 else 3


class Buf:
    """A host array playing device memory: guard cells on both sides, optionally misaligned by
    one element (so the kernels must take their scalar path)."""

    def __init__(self, values: np.ndarray, dtype, misaligned: bool = False, guard: int = GUARD):
        n = values.size
        lead = guard + (1 if misaligned else 0)
        # 64-byte aligned base, then `lead` elements in: aligned to 16 bytes unless misaligned.
        size = (n + 2 * guard + 1) * np.dtype(dtype).itemsize
        raw = np.zeros(size + 64, np.uint8)
        start = (-raw.ctypes.data) % 64
        self.full = raw[start:start + size].view(dtype)
        self.full[:] = SENTINEL
        self.lead, self.n, self.shape = lead, n, values.shape
        self.full[lead:lead + n] = values.reshape(-1).astype(dtype)

    @property
    def ptr(self) -> int:
        return self.full.ctypes.data + self.lead * self.full.itemsize

    @property
    def array(self) -> np.ndarray:
        return self.full[self.lead:self.lead + self.n].reshape(self.shape)

    def guards_intact(self) -> bool:
        outside = np.concatenate([self.full[:self.lead], self.full[self.lead + self.n:]])
        return bool(np.all(outside.astype(np.float64) == np.float64(np.dtype(self.full.dtype).type(SENTINEL))))


def _inputs(shape, dtype, rng, misaligned=False, mean=0.0, std=1.0, guard=GUARD):
    return Buf((rng.standard_normal(shape) * std + mean), dtype, misaligned, guard)


def _f64(buf: Buf | None):
    return None if buf is None else buf.array.astype(np.float64)


def _check(y: Buf, ref: np.ndarray, dtype_id: str, what: str, eager: np.ndarray | None = None):
    """Within docs/design.md §7's tolerance of the float64 reference, or (for ill-conditioned rows, where
    float32 itself cannot do better) within 2x the error of eager PyTorch in float32."""
    assert y.guards_intact(), f"{what}: the kernel wrote outside y"
    got = y.array.astype(np.float64)
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(got - ref).max())
    limit = REL_TOL[dtype_id] * scale + (1e-6 if dtype_id == "fp32" else 0.0)
    if eager is not None:
        limit = max(limit, 2 * float(np.abs(eager - ref).max()))
    assert np.isfinite(got).all() and err <= limit, f"{what}: max abs err {err:.3g} > {limit:.3g} (max|ref| {scale:.3g})"


def ref_rms(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def ref_ln(x, w, b):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + EPS)
    return y * (1 if w is None else w) + (0 if b is None else b)


def eager_ln_fp32(x: Buf, w: Buf | None, b: Buf | None) -> np.ndarray:
    """torch.nn.functional.layer_norm in float32 on the CPU (the eager baseline)."""
    import torch

    def t(buf):
        return None if buf is None else torch.from_numpy(buf.array.astype(np.float32))

    xt = t(x)
    return torch.nn.functional.layer_norm(xt, (xt.shape[-1],), t(w), t(b), EPS).double().numpy()


def ref_adaln(x, shift, scale, w, b, mod_full):
    if not mod_full:  # [B, H] broadcast over the sequence
        shift, scale = shift[:, None, :], scale[:, None, :]
    return ref_ln(x, w, b) * (1 + scale) + shift


@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
def test_rms_norm(lib, hidden, dtype_id, misaligned):
    dtype, code = DTYPES[dtype_id]
    rng = np.random.default_rng(hidden)
    rows = _rows_for(hidden)
    x = _inputs((rows, hidden), dtype, rng, misaligned, mean=0.5, std=2.0)
    w = _inputs((hidden,), dtype, rng, std=0.5, mean=1.0)
    y = Buf(np.zeros((rows, hidden)), dtype, misaligned)
    rc = lib.normexport_rms_norm(x.ptr, w.ptr, y.ptr, rows, hidden, code, EPS, None)
    assert rc == 0, f"cudaError {rc}"
    _check(y, ref_rms(_f64(x), _f64(w)), dtype_id, f"RMSNorm {dtype_id} {rows}x{hidden}")


@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_layer_norm(lib, hidden, dtype_id, affine):
    dtype, code = DTYPES[dtype_id]
    rng = np.random.default_rng(hidden + 1)
    rows = _rows_for(hidden)
    # A large common offset: a one-pass variance (E[x^2] - mean^2) in float32 would be off by
    # about 1e-2 here, far beyond eager float32's own error.
    x = _inputs((rows, hidden), dtype, rng, mean=300.0 if dtype_id == "fp32" else 3.0)
    w = _inputs((hidden,), dtype, rng, mean=1.0, std=0.3) if affine != "none" else None
    b = _inputs((hidden,), dtype, rng, std=0.3) if affine == "both" else None
    y = Buf(np.zeros((rows, hidden)), dtype)
    rc = lib.normexport_layer_norm(x.ptr, w and w.ptr, b and b.ptr, y.ptr, rows, hidden, code, EPS, None)
    assert rc == 0, f"cudaError {rc}"
    eager = eager_ln_fp32(x, w, b) if dtype_id == "fp32" else None
    _check(y, ref_ln(_f64(x), _f64(w), _f64(b)), dtype_id, f"LayerNorm {dtype_id} {rows}x{hidden} {affine}", eager)


@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("mod_full", [0, 1], ids=["modBH", "modFull"])
@pytest.mark.parametrize("affine", [False, True], ids=["noaffine", "affine"])
def test_adaln_zero(lib, hidden, dtype_id, mod_full, affine):
    dtype, code = DTYPES[dtype_id]
    rng = np.random.default_rng(hidden + 2)
    batch, seq = (3, 7) if hidden <= 1032 else (2, 2)
    mod_shape = (batch, seq, hidden) if mod_full else (batch, hidden)
    x = _inputs((batch, seq, hidden), dtype, rng, mean=0.2, std=1.5)
    shift = _inputs(mod_shape, dtype, rng, std=0.3)
    scale = _inputs(mod_shape, dtype, rng, std=0.3)
    w = _inputs((hidden,), dtype, rng, mean=1.0, std=0.2) if affine else None
    b = _inputs((hidden,), dtype, rng, std=0.2) if affine else None
    y = Buf(np.zeros((batch, seq, hidden)), dtype)
    rc = lib.normexport_adaln_zero(x.ptr, shift.ptr, scale.ptr, w and w.ptr, b and b.ptr, y.ptr, batch, seq, hidden,
                                   mod_full, code, EPS, None)
    assert rc == 0, f"cudaError {rc}"
    ref = ref_adaln(_f64(x), _f64(shift), _f64(scale), _f64(w), _f64(b), mod_full)
    _check(y, ref, dtype_id, f"AdaLNZero {dtype_id} {batch}x{seq}x{hidden} mod_full={mod_full} affine={affine}")


def _round(a: np.ndarray, dtype) -> np.ndarray:
    """float64 values rounded to the IO dtype and back (the stored residual sum)."""
    return a.astype(dtype).astype(np.float64)


def _run_skip_rms(lib, x, skip, bias, w, dtype_id, rows, hidden, replace_lib=None):
    dtype, code = DTYPES[dtype_id]
    y = Buf(np.zeros((rows, hidden)), dtype, x.lead != GUARD)
    out_sum = Buf(np.zeros((rows, hidden)), dtype, x.lead != GUARD)
    rc = (replace_lib or lib).normexport_skip_rms_norm(x.ptr, skip.ptr, bias and bias.ptr, w.ptr, y.ptr, out_sum.ptr,
                                                      rows, hidden, code, EPS, None)
    return rc, y, out_sum


def _check_skip_rms(rc, y, out_sum, x, skip, bias, w, dtype_id, what):
    assert rc == 0, f"{what}: cudaError {rc}"
    dtype = DTYPES[dtype_id][0]
    ref_sum = _f64(x) + _f64(skip) + (0 if bias is None else _f64(bias))
    _check(out_sum, ref_sum, dtype_id, f"{what} Sum")
    # docs/design.md §2: Y normalises the sum as stored (rounded to the IO dtype)
    _check(y, ref_rms(_round(ref_sum, dtype), _f64(w)), dtype_id, f"{what} Y")


@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("hidden", FUSED_HIDDEN)
@pytest.mark.parametrize("form", ["bias", "nobias", "misaligned"])
def test_skip_rms_norm(lib, hidden, dtype_id, form):
    dtype, _ = DTYPES[dtype_id]
    rng = np.random.default_rng(hidden + 3)
    rows = _rows_for(hidden)
    mis = form == "misaligned"
    x = _inputs((rows, hidden), dtype, rng, mis, mean=0.5, std=2.0)
    skip = _inputs((rows, hidden), dtype, rng, mis, mean=-0.3, std=1.5)
    bias = _inputs((hidden,), dtype, rng, mis, std=0.5) if form != "nobias" else None
    w = _inputs((hidden,), dtype, rng, mis, mean=1.0, std=0.5)
    rc, y, out_sum = _run_skip_rms(lib, x, skip, bias, w, dtype_id, rows, hidden)
    _check_skip_rms(rc, y, out_sum, x, skip, bias, w, dtype_id, f"SkipRMSNorm {dtype_id} {rows}x{hidden} {form}")


def _run_gated(lib, x, upd, gate, shift, scale, w, b, batch, seq, hidden, mod_full, dtype_id):
    dtype, code = DTYPES[dtype_id]
    y = Buf(np.zeros((batch, seq, hidden)), dtype)
    out_sum = Buf(np.zeros((batch, seq, hidden)), dtype)
    rc = lib.normexport_gated_adaln_zero(x.ptr, upd.ptr, gate.ptr, shift.ptr, scale.ptr, w and w.ptr, b and b.ptr, y.ptr,
                                         out_sum.ptr, batch, seq, hidden, mod_full, code, EPS, None)
    return rc, y, out_sum


def _gated_case(hidden, dtype_id, mod_full, affine, seed):
    dtype, _ = DTYPES[dtype_id]
    rng = np.random.default_rng(seed)
    batch, seq = (3, 7) if hidden <= 1032 else (2, 2)
    mod_shape = (batch, seq, hidden) if mod_full else (batch, hidden)
    x = _inputs((batch, seq, hidden), dtype, rng, mean=0.2, std=1.5)
    upd = _inputs((batch, seq, hidden), dtype, rng, mean=0.4, std=2.0)
    gate = _inputs(mod_shape, dtype, rng, mean=0.5, std=0.5)
    shift = _inputs(mod_shape, dtype, rng, std=0.3)
    scale = _inputs(mod_shape, dtype, rng, std=0.3)
    w = _inputs((hidden,), dtype, rng, mean=1.0, std=0.2) if affine else None
    b = _inputs((hidden,), dtype, rng, std=0.2) if affine else None
    return x, upd, gate, shift, scale, w, b, batch, seq


def _check_gated(rc, y, out_sum, case, mod_full, dtype_id, what):
    x, upd, gate, shift, scale, w, b, batch, seq = case
    assert rc == 0, f"{what}: cudaError {rc}"
    g = _f64(gate) if mod_full else _f64(gate)[:, None, :]
    ref_sum = _f64(x) + g * _f64(upd)
    _check(out_sum, ref_sum, dtype_id, f"{what} Sum")
    ref = ref_adaln(_round(ref_sum, DTYPES[dtype_id][0]), _f64(shift), _f64(scale), _f64(w), _f64(b), mod_full)
    _check(y, ref, dtype_id, f"{what} Y")


@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("hidden", FUSED_HIDDEN)
@pytest.mark.parametrize("mod_full", [0, 1], ids=["modBH", "modFull"])
@pytest.mark.parametrize("affine", [False, True], ids=["noaffine", "affine"])
def test_gated_adaln_zero(lib, hidden, dtype_id, mod_full, affine):
    case = _gated_case(hidden, dtype_id, mod_full, affine, hidden + 4)
    x, upd, gate, shift, scale, w, b, batch, seq = case
    rc, y, out_sum = _run_gated(lib, x, upd, gate, shift, scale, w, b, batch, seq, hidden, mod_full, dtype_id)
    _check_gated(rc, y, out_sum, case, mod_full, dtype_id,
                 f"GatedAdaLNZero {dtype_id} {batch}x{seq}x{hidden} mod_full={mod_full} affine={affine}")


# ---- the kernel variants of issue 48 (norm_common.cuh's switches, off in the default build) ---------
# tools/gpu_compare.sh measures them on a GPU; here one build with all three on checks what they
# compute: a warp per row (65..256 vectors: 4 or 8 per lane), rows staged through shared memory by
# cp.async (block kernel, 2 vectors per thread, 4 rows per block on the emulation's 2-block
# persistent grid, so blocks jump to their next set of rows), the AdaLN kinds' 4 vectors per thread
# from 513 vectors.
VARIANTS = ("NORMEXPORT_WARP_ROWS=256", "NORMEXPORT_ASYNC_ROWS=4", "NORMEXPORT_ADALN_VPT2_MAX_VECS=512")
# hidden -> what it takes there (bf16 / fp16; fp32 has half the vectors)
VARIANT_HIDDEN = [1000, 1152, 2048, 2432, 4096, 8192]


@pytest.fixture(scope="module")
def variant_lib():
    try:
        return load_kernels(build_emulated_kernels(defines=VARIANTS))
    except RuntimeError as exc:
        pytest.fail(str(exc))


def _config(so, op: int, dtype_code: int, rows: int, hidden: int):
    fn = so.normexport_launch_config_for
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                   ctypes.POINTER(_LaunchConfig)]
    cfg = _LaunchConfig()
    assert fn(op, dtype_code, rows, hidden, 1, ctypes.byref(cfg)) == 0
    return cfg


def test_variants_take_their_paths(variant_lib):
    """The variant build's dispatcher sends the test sizes where the variants are (else the tests
    below would check the default kernels again)."""
    half, fp32 = DTYPES["bf16"][1], DTYPES["fp32"][1]
    for hidden, vpt in ((1000, 4), (1152, 8), (2048, 8)):  # 125 / 144 / 256 vectors: a warp per row
        cfg = _config(variant_lib, 0, half, 11, hidden)
        assert (cfg.kernel, cfg.lanes, cfg.vectors_per_thread) == (0, 32, vpt), hidden
    assert _config(variant_lib, 0, fp32, 11, 1000).vectors_per_thread == 8  # 250 fp32 vectors
    for hidden in (2432, 4096):  # block kernel, 2 vectors per thread: the cp.async rows
        cfg = _config(variant_lib, 1, half, 11, hidden)
        assert (cfg.kernel, cfg.vectors_per_thread) == (1, 2), hidden
    assert _config(variant_lib, 2, half, 11, 8192).vectors_per_thread == 4  # AdaLN at 1024 vectors
    assert _config(variant_lib, 0, half, 11, 8192).vectors_per_thread == 2  # (RMSNorm keeps 2)


def test_variants_are_off_by_default(lib):
    half = DTYPES["bf16"][1]
    assert _config(lib, 0, half, 11, 1152).kernel == 1  # one row per block, not a warp per row
    assert _config(lib, 2, half, 11, 8192).vectors_per_thread == 2


@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("hidden", VARIANT_HIDDEN)
def test_variants_match_float64(variant_lib, hidden, dtype_id):
    """Every op through the variant build against float64 (11 rows: blocks of 4 rows with a partial
    last set; [B, H] modulation rows changing inside a block's rows)."""
    dtype, code = DTYPES[dtype_id]
    rng = np.random.default_rng(hidden + 40)
    rows = 11
    x = _inputs((rows, hidden), dtype, rng, mean=0.5, std=2.0)
    w = _inputs((hidden,), dtype, rng, std=0.5, mean=1.0)
    b = _inputs((hidden,), dtype, rng, std=0.3)
    y = Buf(np.zeros((rows, hidden)), dtype)
    assert variant_lib.normexport_rms_norm(x.ptr, w.ptr, y.ptr, rows, hidden, code, EPS, None) == 0
    _check(y, ref_rms(_f64(x), _f64(w)), dtype_id, f"RMSNorm {hidden}")
    y = Buf(np.zeros((rows, hidden)), dtype)
    assert variant_lib.normexport_layer_norm(x.ptr, w.ptr, b.ptr, y.ptr, rows, hidden, code, EPS, None) == 0
    _check(y, ref_ln(_f64(x), _f64(w), _f64(b)), dtype_id, f"LayerNorm {hidden}")
    skip = _inputs((rows, hidden), dtype, rng, mean=-0.3, std=1.5)
    rc, y, out_sum = _run_skip_rms(variant_lib, x, skip, b, w, dtype_id, rows, hidden)
    _check_skip_rms(rc, y, out_sum, x, skip, b, w, dtype_id, f"SkipRMSNorm {hidden}")
    batch, seq = 3, 5  # 15 rows: modulation rows 0..2 change at rows 5 and 10
    xs = _inputs((batch, seq, hidden), dtype, rng, mean=0.2, std=1.5)
    shift, scale = (_inputs((batch, hidden), dtype, rng, std=0.3) for _ in range(2))
    y = Buf(np.zeros((batch, seq, hidden)), dtype)
    assert variant_lib.normexport_adaln_zero(xs.ptr, shift.ptr, scale.ptr, w.ptr, b.ptr, y.ptr, batch, seq, hidden, 0,
                                             code, EPS, None) == 0
    _check(y, ref_adaln(_f64(xs), _f64(shift), _f64(scale), _f64(w), _f64(b), 0), dtype_id, f"AdaLNZero {hidden}")
    gx, upd, gate, gshift, gscale, gw, gb, gbatch, gseq = _gated_case(hidden, dtype_id, 0, True, hidden + 41)
    rc, y, out_sum = _run_gated(variant_lib, gx, upd, gate, gshift, gscale, gw, gb, gbatch, gseq, hidden, 0, dtype_id)
    _check_gated(rc, y, out_sum, (gx, upd, gate, gshift, gscale, gw, gb, gbatch, gseq), 0, dtype_id,
                 f"GatedAdaLNZero {hidden}")


# ---- planted bugs: every in-process planted bug in one build ----------------------------------------
# Each planted bug is compiled into one library behind emu.h's switch (normexport_emu_plant(n, timeout)):
# switched off, the edited lines compute what the source's do; switched on, bug n is the source with
# that bug planted (the same edit as a separately planted build, e.g. `off > 0` -> `off > 1`). One
# compile serves every planted-bug test below (five compiles before). Numbers 11..15: the sanitizer
# driver's switched bugs (1, 2) live in their own builds.
PLANTED_HALF_REDUCTION = 11  # a warp reduction that skips its last butterfly step
PLANTED_PADDING_ROWS = 12  # padding rows of the last group-kernel block treated as real rows
PLANTED_LANE_SKIPS_BARRIER = 13  # a lane that leaves the block reduction early
PLANTED_FUSED = 14  # the three fused-path bugs of test_fused_checks_catch_planted_bugs at once
PLANTED_MOD_AXIS = 15  # the sequence-first modulation row as the default layout's (both kernels)
_ON = "::emu::gPlanted == "
IN_PROCESS_PLANTS = (
    # half-reduction: each row sums half its lanes (`off > 0` -> `off > 1`)
    ("for (int off = LANES / 2; off > 0; off >>= 1)",
     f"for (int off = LANES / 2; off > ({_ON}{PLANTED_HALF_REDUCTION} ? 1 : 0); off >>= 1)"),
    # padding rows: they write past y (`row < rows ? row : 0, row < rows` -> `row, true`)
    ("p, row < rows ? row : 0, row < rows, fresh(tid), LANES, rr[j], aff, reduce);",
     f"p, row < rows || {_ON}{PLANTED_PADDING_ROWS} ? row : 0, row < rows || {_ON}{PLANTED_PADDING_ROWS}, fresh(tid), "
     "LANES, rr[j], aff, reduce);"),
    # lane 1 leaves block_reduce before its shuffles: the others wait for it at the barriers
    ("    v = group_reduce<32>(v, equal);\n    if (lane == 0)",
     f"    if ({_ON}{PLANTED_LANE_SKIPS_BARRIER} && threadIdx.x == 1)\n        return V{{}};\n"
     "    v = group_reduce<32>(v, equal);\n    if (lane == 0)"),
    # fused: the gate ignored in the row kernels (Sum = X + update)
    ("a[k] = get(rr.x[i], k) + g[k] * get(rr.r[i], k);",
     f"a[k] = get(rr.x[i], k) + ({_ON}{PLANTED_FUSED} ? 1.f : g[k]) * get(rr.r[i], k);"),
    # fused: the looped kernel reads the gate of modulation row 0 for every row
    ("gr = static_cast<T const*>(p.gate) + mrow * p.hidden;",
     f"gr = static_cast<T const*>(p.gate) + ({_ON}{PLANTED_FUSED} ? 0 : mrow * p.hidden);"),
    # fused: SkipRMSNorm's bias dropped from the sum
    ("                        a[k] += c[k];\n",
     f"                        a[k] += {_ON}{PLANTED_FUSED} ? 0.f * c[k] : c[k];\n"),
    # sequence-first modulation row r / S instead of r % B: row kernels, then the looped kernel
    ("mrow %= p.mod_rows; // rows < 2^31 here",
     f"{{ if ({_ON}{PLANTED_MOD_AXIS}) mrow /= static_cast<uint32_t>(p.rows) / p.mod_rows; else mrow %= p.mod_rows; }}"
     " // rows < 2^31 here"),
    ("            mrow %= p.mod_rows;\n",
     f"            {{ if ({_ON}{PLANTED_MOD_AXIS}) mrow /= p.rows / p.mod_rows; else mrow %= p.mod_rows; }}\n"),
)


@pytest.fixture(scope="module")
def planted_lib():
    """The kernels with every in-process planted bug behind the switch (off until a test turns one on)."""
    try:
        bad = load_kernels(build_emulated_kernels(IN_PROCESS_PLANTS))
    except RuntimeError as exc:
        pytest.fail(str(exc))
    bad.normexport_emu_plant.argtypes = [ctypes.c_int, ctypes.c_int]
    bad.normexport_emu_plant.restype = None
    return bad


@contextlib.contextmanager
def planted(bad, which: int, barrier_timeout_ms: int):
    """Planted bug `which` switched on in `bad` (barriers giving up after `barrier_timeout_ms`), off after."""
    bad.normexport_emu_plant(which, barrier_timeout_ms)
    try:
        yield bad
    finally:
        bad.normexport_emu_plant(0, 0)


def test_planted_switch_off_is_the_source(planted_lib):
    """Switched off, the planted build computes what the source does: bit for bit the clean build's
    results on the paths the plants edit (group, block and looped kernels; fused ops; sequence-first)."""
    lib = load_kernels(build_emulated_kernels())
    for hidden in (256, 4096, 40000):
        case = _gated_case(hidden, "fp32", 0, True, 21)
        x, upd, gate, shift, scale, w, b, batch, seq = case
        outs = [_run_gated(k, x, upd, gate, shift, scale, w, b, batch, seq, hidden, 0, "fp32")
                for k in (lib, planted_lib)]
        assert outs[0][0] == outs[1][0] == 0
        assert np.array_equal(outs[0][1].full, outs[1][1].full) and np.array_equal(outs[0][2].full, outs[1][2].full)
        case = _gated_seq_first_case(hidden, "fp32", True, 22)
        outs = [_run_gated_axis(k, *case[:7], case[7], "fp32") for k in (lib, planted_lib)]
        assert outs[0][0] == outs[1][0] == 0
        assert np.array_equal(outs[0][1].full, outs[1][1].full) and np.array_equal(outs[0][2].full, outs[1][2].full)
    for hidden in (8, 256):
        rng = np.random.default_rng(23)
        x, skip = _inputs((19, hidden), np.float32, rng), _inputs((19, hidden), np.float32, rng)
        bias, w = _inputs((hidden,), np.float32, rng, std=0.5), _inputs((hidden,), np.float32, rng, mean=1.0, std=0.5)
        outs = [_run_skip_rms(k, x, skip, bias, w, "fp32", 19, hidden) for k in (lib, planted_lib)]
        assert outs[0][0] == outs[1][0] == 0
        assert np.array_equal(outs[0][1].full, outs[1][1].full) and np.array_equal(outs[0][2].full, outs[1][2].full)


def test_fused_checks_catch_planted_bugs(planted_lib):
    """The fused-op checks can fail: gate ignored (row kernel, hidden 256), gate row wrong (looped
    kernel, hidden 40000), SkipRMSNorm bias dropped (hidden 256) each fail their check (all three
    switched on at once: each touches a different path, so each check fails for its own bug)."""
    with planted(planted_lib, PLANTED_FUSED, 2000) as bad:
        for hidden in (256, 40000):
            case = _gated_case(hidden, "fp32", 0, True, 11)
            x, upd, gate, shift, scale, w, b, batch, seq = case
            rc, y, out_sum = _run_gated(bad, x, upd, gate, shift, scale, w, b, batch, seq, hidden, 0, "fp32")
            with pytest.raises(AssertionError):
                _check_gated(rc, y, out_sum, case, 0, "fp32", f"planted {hidden}")
        rng = np.random.default_rng(5)
        dtype = DTYPES["fp16"][0]
        x, skip = _inputs((19, 256), dtype, rng), _inputs((19, 256), dtype, rng)
        bias, w = _inputs((256,), dtype, rng, std=0.5), _inputs((256,), dtype, rng, mean=1.0, std=0.5)
        rc, y, out_sum = _run_skip_rms(bad, x, skip, bias, w, "fp16", 19, 256)
        with pytest.raises(AssertionError):
            _check_skip_rms(rc, y, out_sum, x, skip, bias, w, "fp16", "planted")


# ---- a [B, H] modulation following another dim of x (the ops' modulation_axis) --------------------
# normexport_adaln_zero_axis / normexport_gated_adaln_zero_axis: x [outer, B, inner, H], row r of x
# takes modulation row (r / inner) % B; sequence-first x [S, B, H] (modulation_axis 1) is outer S,
# inner 1: row r % B. The reference broadcasts [B, H] over x's other dims with numpy (no row
# arithmetic), in float64.
def ref_adaln_axis(x, shift, scale, w, b, axis):
    """LayerNorm(x) * (1 + scale) + shift with shift / scale [B, H] viewed as [1.., B, 1.., H], B at
    x's dim `axis`."""
    view = [1] * x.ndim
    view[axis], view[-1] = shift.shape[0], shift.shape[-1]
    return ref_ln(x, w, b) * (1 + scale.reshape(view)) + shift.reshape(view)


def _axis_shape(hidden: int, layout: str) -> tuple[tuple[int, ...], int]:
    """(x's shape, modulation axis) of a layout: "seq_first" [S, B, H] (S = 7, B = 3; S = 3, B = 2 for
    long rows: one host thread per CUDA thread), "rank4_axis1" [2, 3, 4, H], "rank4_axis2" [2, 3, 4, H]
    with B = 4 (inner 1)."""
    if layout == "seq_first":
        return ((7, 3, hidden) if hidden <= 1032 else (3, 2, hidden)), 1
    return (2, 3, 4, hidden), int(layout[-1])


def _run_adaln_axis(lib, x, shift, scale, w, b, shape, axis, dtype_id):
    dtype, code = DTYPES[dtype_id]
    outer, batch = int(np.prod(shape[:axis])), shape[axis]
    inner = int(np.prod(shape[axis + 1:-1]))
    y = Buf(np.zeros(shape), dtype)
    rc = lib.normexport_adaln_zero_axis(x.ptr, shift.ptr, scale.ptr, w and w.ptr, b and b.ptr, y.ptr, outer, batch,
                                        inner, shape[-1], code, EPS, None)
    return rc, y


def _adaln_axis_case(hidden, dtype_id, layout, affine, seed):
    dtype, _ = DTYPES[dtype_id]
    rng = np.random.default_rng(seed)
    shape, axis = _axis_shape(hidden, layout)
    x = _inputs(shape, dtype, rng, mean=0.2, std=1.5)
    shift = _inputs((shape[axis], hidden), dtype, rng, std=0.3)
    scale = _inputs((shape[axis], hidden), dtype, rng, std=0.3)
    w = _inputs((hidden,), dtype, rng, mean=1.0, std=0.2) if affine else None
    b = _inputs((hidden,), dtype, rng, std=0.2) if affine else None
    return x, shift, scale, w, b, shape, axis


@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("affine", [False, True], ids=["noaffine", "affine"])
def test_adaln_zero_seq_first(lib, hidden, dtype_id, affine):
    """x [S, B, H] with [B, H] shift / scale over S (modulation_axis 1): every launch kind."""
    x, shift, scale, w, b, shape, axis = _adaln_axis_case(hidden, dtype_id, "seq_first", affine, hidden + 5)
    rc, y = _run_adaln_axis(lib, x, shift, scale, w, b, shape, axis, dtype_id)
    assert rc == 0, f"cudaError {rc}"
    ref = ref_adaln_axis(_f64(x), _f64(shift), _f64(scale), _f64(w), _f64(b), axis)
    _check(y, ref, dtype_id, f"AdaLNZero seq-first {dtype_id} {shape} affine={affine}")


@pytest.mark.parametrize("dtype_id", ["fp32", "bf16"])
@pytest.mark.parametrize("hidden", [8, 37, 256, 1000, 4096, 40000])
@pytest.mark.parametrize("layout", ["rank4_axis1", "rank4_axis2"])
def test_adaln_zero_rank4_axis(lib, hidden, dtype_id, layout):
    """x [2, 3, 4, H], [B, H] following dim 1 (row (r / 4) % 3) or dim 2 (row r % 4)."""
    x, shift, scale, w, b, shape, axis = _adaln_axis_case(hidden, dtype_id, layout, True, hidden + 6)
    rc, y = _run_adaln_axis(lib, x, shift, scale, w, b, shape, axis, dtype_id)
    assert rc == 0, f"cudaError {rc}"
    ref = ref_adaln_axis(_f64(x), _f64(shift), _f64(scale), _f64(w), _f64(b), axis)
    _check(y, ref, dtype_id, f"AdaLNZero {dtype_id} {shape} modulation axis {axis}")


@pytest.mark.parametrize("shape, axis", [((1, 3, 64), 1), ((5, 1, 64), 1), ((3, 2, 64), 0), ((0, 2, 64), 1)],
                         ids=["S1", "B1", "axis0", "empty"])
def test_adaln_zero_axis_degenerate(lib, shape, axis):
    """outer 1 ([B, H] of x's first dim that is not 1: the default kernels), B = 1 (one modulation row
    for all), axis 0 itself, and no rows (a no-op)."""
    dtype, code = DTYPES["fp32"]
    rng = np.random.default_rng(9)
    x = _inputs(shape, dtype, rng, mean=0.2, std=1.5)
    shift = _inputs((shape[axis], shape[-1]), dtype, rng, std=0.3)
    scale = _inputs((shape[axis], shape[-1]), dtype, rng, std=0.3)
    rc, y = _run_adaln_axis(lib, x, shift, scale, None, None, shape, axis, "fp32")
    assert rc == 0, f"cudaError {rc}"
    if x.n == 0:
        assert y.guards_intact()
        return
    _check(y, ref_adaln_axis(_f64(x), _f64(shift), _f64(scale), None, None, axis), "fp32", f"{shape} axis {axis}")


def _run_gated_axis(lib, x, upd, gate, shift, scale, w, b, shape, dtype_id):
    dtype, code = DTYPES[dtype_id]
    y, out_sum = Buf(np.zeros(shape), dtype), Buf(np.zeros(shape), dtype)
    rc = lib.normexport_gated_adaln_zero_axis(x.ptr, upd.ptr, gate.ptr, shift.ptr, scale.ptr, w and w.ptr, b and b.ptr,
                                              y.ptr, out_sum.ptr, shape[0], shape[1], 1, shape[-1], code, EPS, None)
    return rc, y, out_sum


def _gated_seq_first_case(hidden, dtype_id, affine, seed):
    dtype, _ = DTYPES[dtype_id]
    rng = np.random.default_rng(seed)
    shape = (7, 3, hidden) if hidden <= 1032 else (3, 2, hidden)
    mod = (shape[1], hidden)
    x = _inputs(shape, dtype, rng, mean=0.2, std=1.5)
    upd = _inputs(shape, dtype, rng, mean=0.4, std=2.0)
    gate = _inputs(mod, dtype, rng, mean=0.5, std=0.5)
    shift, scale = _inputs(mod, dtype, rng, std=0.3), _inputs(mod, dtype, rng, std=0.3)
    w = _inputs((hidden,), dtype, rng, mean=1.0, std=0.2) if affine else None
    b = _inputs((hidden,), dtype, rng, std=0.2) if affine else None
    return x, upd, gate, shift, scale, w, b, shape


def _check_gated_seq_first(rc, y, out_sum, case, dtype_id, what):
    x, upd, gate, shift, scale, w, b, shape = case
    assert rc == 0, f"{what}: cudaError {rc}"
    ref_sum = _f64(x) + _f64(gate)[None] * _f64(upd)  # [B, H] broadcast over S
    _check(out_sum, ref_sum, dtype_id, f"{what} Sum")
    ref = ref_adaln_axis(_round(ref_sum, DTYPES[dtype_id][0]), _f64(shift), _f64(scale), _f64(w), _f64(b), 1)
    _check(y, ref, dtype_id, f"{what} Y")


@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("hidden", FUSED_HIDDEN)
@pytest.mark.parametrize("affine", [False, True], ids=["noaffine", "affine"])
def test_gated_adaln_zero_seq_first(lib, hidden, dtype_id, affine):
    """GatedAdaLNZero with x, update [S, B, H] and gate / shift / scale [B, H] over S."""
    case = _gated_seq_first_case(hidden, dtype_id, affine, hidden + 7)
    x, upd, gate, shift, scale, w, b, shape = case
    rc, y, out_sum = _run_gated_axis(lib, x, upd, gate, shift, scale, w, b, shape, dtype_id)
    _check_gated_seq_first(rc, y, out_sum, case, dtype_id,
                           f"GatedAdaLNZero seq-first {dtype_id} {shape} affine={affine}")


def test_adaln_axis_bad_sizes(lib):
    """Negative sizes, a batch past 2^32 and missing modulation pointers are refused."""
    inval = 1  # cudaErrorInvalidValue
    f = Buf(np.zeros(64), np.float32)
    assert lib.normexport_adaln_zero_axis(f.ptr, f.ptr, f.ptr, None, None, f.ptr, -1, 2, 1, 8, 0, EPS, None) == inval
    assert lib.normexport_adaln_zero_axis(f.ptr, f.ptr, f.ptr, None, None, f.ptr, 2, 1 << 32, 0, 8, 0, EPS,
                                          None) == inval
    assert lib.normexport_adaln_zero_axis(f.ptr, None, f.ptr, None, None, f.ptr, 2, 2, 1, 8, 0, EPS, None) == inval
    assert lib.normexport_gated_adaln_zero_axis(f.ptr, f.ptr, None, f.ptr, f.ptr, None, None, f.ptr, f.ptr, 2, 2, 1, 8,
                                                0, EPS, None) == inval


def test_seq_first_checks_catch_planted_bug(planted_lib):
    """The sequence-first checks can fail: modulation row r / S instead of r % B (row kernel at
    hidden 256, looped kernel at 40000; AdaLNZero and GatedAdaLNZero) fails each check."""
    with planted(planted_lib, PLANTED_MOD_AXIS, 2000) as bad:
        for hidden in (256, 40000):
            x, shift, scale, w, b, shape, axis = _adaln_axis_case(hidden, "fp32", "seq_first", True, 12)
            rc, y = _run_adaln_axis(bad, x, shift, scale, w, b, shape, axis, "fp32")
            with pytest.raises(AssertionError):
                assert rc == 0
                _check(y, ref_adaln_axis(_f64(x), _f64(shift), _f64(scale), _f64(w), _f64(b), axis), "fp32", "planted")
            case = _gated_seq_first_case(hidden, "fp32", True, 13)
            rc, y, out_sum = _run_gated_axis(bad, *case[:7], case[7], "fp32")
            with pytest.raises(AssertionError):
                _check_gated_seq_first(rc, y, out_sum, case, "fp32", f"planted {hidden}")


@pytest.mark.parametrize("which", ["shift", "scale", "weight"])
def test_adaln_zero_misaligned_parameter(lib, which):
    """One misaligned parameter pointer sends the whole call to the scalar path."""
    dtype, code = DTYPES["fp16"]
    rng = np.random.default_rng(7)
    batch, seq, hidden = 2, 5, 512
    x = _inputs((batch, seq, hidden), dtype, rng)
    shift = _inputs((batch, hidden), dtype, rng, which == "shift", std=0.3)
    scale = _inputs((batch, hidden), dtype, rng, which == "scale", std=0.3)
    w = _inputs((hidden,), dtype, rng, which == "weight", mean=1.0, std=0.2)
    b = _inputs((hidden,), dtype, rng, std=0.2)
    y = Buf(np.zeros((batch, seq, hidden)), dtype)
    rc = lib.normexport_adaln_zero(x.ptr, shift.ptr, scale.ptr, w.ptr, b.ptr, y.ptr, batch, seq, hidden, 0, code,
                                   EPS, None)
    assert rc == 0
    _check(y, ref_adaln(_f64(x), _f64(shift), _f64(scale), _f64(w), _f64(b), 0), "fp16", f"misaligned {which}")


@pytest.mark.parametrize("which, hidden, rows", [
    (PLANTED_HALF_REDUCTION, 256, 19),  # group kernel, 8 lanes: each row sums half its lanes
    (PLANTED_PADDING_ROWS, 8, 19),  # the last block's padding rows write past y
    (PLANTED_LANE_SKIPS_BARRIER, 4096, 1),  # the block kernel's other lanes wait at the barriers
], ids=["half-reduction", "padding-rows-write", "lane-skips-barrier"])
def test_emulation_catches_planted_kernel_bugs(planted_lib, which, hidden, rows):
    """The emulated tests can fail: each planted bug makes the same checks fail (wrong values,
    writes outside y, or a launch reported as failed)."""
    dtype, code = DTYPES["fp32"]
    rng = np.random.default_rng(0)
    room = 64 * hidden  # wide guards: the planted out-of-bounds accesses stay inside our buffers
    x = _inputs((rows, hidden), dtype, rng, mean=0.5, std=2.0, guard=room)
    w = _inputs((hidden,), dtype, rng, mean=1.0, std=0.5, guard=room)
    y = Buf(np.zeros((rows, hidden)), dtype, guard=room)
    with planted(planted_lib, which, 300) as bad:
        rc = bad.normexport_rms_norm(x.ptr, w.ptr, y.ptr, rows, hidden, code, EPS, None)
    with pytest.raises(AssertionError):
        assert rc == 0, f"cudaError {rc}"
        _check(y, ref_rms(_f64(x), _f64(w)), "fp32", "planted")


# ---- memory safety and races under the sanitizers ------------------------------------------------
# tests/cuda_emu/sanitizer_driver.cpp runs all three ops, aligned and misaligned, with every tensor in
# an allocation of exactly its size. Sizes: every launch path for ASan (group kernels, scalar group
# kernel, vector and scalar block kernels, looped kernel); for TSan the ones whose reductions go
# through shared memory (block kernels) plus a shuffle-only group kernel. Dtypes per size ("f" fp32,
# "h" fp16, "b" bf16): fp16 and bf16 take the same launches (2-byte elements, the same dispatcher
# choice), so each size runs fp32 and one of the two, alternating; the numerics of every dtype at
# every size are the emulated tests' above. test_sanitized_sizes_take_every_launch checks that this
# takes every launch (op, element size, alignment, kernel, vector, vectors per thread, lanes) the
# sizes take in all three dtypes.
ASAN_HIDDEN = ["1:fh", "37:fb", "256:fh", "1000:fb", "6001:fh", "20000:fb"]
TSAN_HIDDEN = ["37:fb", "1000:fh"]
_DTYPE_LETTERS = {"f": DTYPES["fp32"][1], "h": DTYPES["fp16"][1], "b": DTYPES["bf16"][1]}


class _LaunchConfig(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int) for n in ("kernel", "vec", "vectors_per_thread", "lanes", "rows_per_group",
                                            "threads")]


def _launches(lib, sizes: list[str]) -> set[tuple]:
    """The launches the sanitizer driver makes for `sizes` (HIDDEN:DTYPES), as the dispatcher picks them:
    (op, element size, aligned, kernel, vec, vectors per thread, lanes) for every op (NORMEXPORT_OP_*)."""
    fn = lib.normexport_launch_config_for
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                   ctypes.POINTER(_LaunchConfig)]
    fn.restype = ctypes.c_int
    out = set()
    for size in sizes:
        hidden, _, letters = size.partition(":")
        for letter in letters or "fhb":
            dtype = _DTYPE_LETTERS[letter]
            for aligned in (1, 0):
                for op in range(5):
                    c = _LaunchConfig()
                    assert fn(op, dtype, 3, int(hidden), aligned, ctypes.byref(c)) == 0
                    out.add((op, 4 if letter == "f" else 2, aligned, c.kernel, c.vec, c.vectors_per_thread,
                             c.lanes if c.kernel == 0 else 0))
    return out


def test_sanitized_sizes_take_every_launch(lib):
    """The sanitizer runs' dtypes per size drop no launch: the same launches as every dtype at every size,
    and every kernel kind (group, block, looped; vector and scalar) among them."""
    for sizes in (ASAN_HIDDEN, TSAN_HIDDEN):
        every_dtype = [s.partition(":")[0] for s in sizes]
        assert _launches(lib, sizes) == _launches(lib, every_dtype), sizes
    kinds = {(k[3], k[4] > 1) for k in _launches(lib, ASAN_HIDDEN)}
    assert kinds == {(0, True), (0, False), (1, True), (1, False), (2, False)}, kinds
    assert {"f", "h", "b"} <= set("".join(s.partition(":")[2] for s in ASAN_HIDDEN))
    assert {"f", "h", "b"} <= set("".join(s.partition(":")[2] for s in TSAN_HIDDEN))


# The sanitizer tests' planted bugs, compiled into the sanitized driver behind emu.h's runtime switch
# ($NORMEXPORT_EMU_PLANTED): one build per sanitizer serves the clean run (switch off: the edited lines
# compute what the source's do) and the planted run (switch on: the source with the bug planted).
PLANTED_OVERREAD = 1  # a row loop that runs one vector past the row (`< nvec` -> `<= nvec`)
PLANTED_MISSING_BARRIER = 2  # one shared-memory reduction buffer for every row (`parity ^= 1;` dropped)
SWITCHED_BUGS = (
    ("return valid && tid + i * nthr < nvec;", "return valid && tid + i * nthr < nvec + (::emu::gPlanted == 1);"),
    ("        parity ^= 1;\n", "        parity ^= ::emu::gPlanted != 2;\n"),
)


def _sanitized_driver(sanitize: str):
    why = sanitizer_unsupported(sanitize)
    if why:
        pytest.skip(why)
    try:
        return build_emulated_sanitized_driver(sanitize, SWITCHED_BUGS)
    except RuntimeError as exc:
        pytest.fail(str(exc))


def _run_driver(driver, sizes, planted: int = 0, timeout=900, env=None):
    """The driver on `sizes` with planted bug `planted` switched on (0: none)."""
    env = {**{k: v for k, v in os.environ.items() if k != "NORMEXPORT_EMU_PLANTED"}, **(env or {})}
    if planted:
        env["NORMEXPORT_EMU_PLANTED"] = str(planted)
    return subprocess.run([str(driver), *sizes], capture_output=True, text=True, timeout=timeout, env=env)


def test_kernels_memory_safe_under_asan():
    """No emulated thread reads or writes outside the tensors, and no undefined behaviour."""
    run = _run_driver(_sanitized_driver("address,undefined"), ASAN_HIDDEN)
    assert "AddressSanitizer" not in run.stderr and "runtime error" not in run.stderr, run.stderr[-4000:]
    assert run.returncode == 0 and run.stdout.strip().endswith("0 failed"), run.stdout + run.stderr[-2000:]


def test_asan_catches_a_planted_overread():
    """The sanitizer run can fail: a row loop that runs one vector past the row is reported (ASan stops
    at the first error: -fno-sanitize-recover)."""
    run = _run_driver(_sanitized_driver("address,undefined"), ["37"], PLANTED_OVERREAD, timeout=600)
    assert run.returncode != 0 and "heap-buffer-overflow" in run.stderr, run.stdout + run.stderr[-2000:]


def test_kernels_race_free_under_tsan():
    """No data race between the threads of a block: shared-memory reductions are fenced by
    __syncthreads on both sides (ThreadSanitizer sees the emulated barriers' synchronisation)."""
    run = _run_driver(_sanitized_driver("thread"), TSAN_HIDDEN)
    assert "ThreadSanitizer" not in run.stderr, run.stderr[-4000:]
    assert run.returncode == 0 and run.stdout.strip().endswith("0 failed"), run.stdout + run.stderr[-2000:]


def test_tsan_catches_a_planted_missing_barrier():
    """The race check can fail: the row kernels' one barrier per row is enough only because the
    shared-memory buffer of the reduction alternates between rows; with one buffer for every row,
    the next row's writes race with this row's reads (a block of the emulated 2-SM grid takes
    several rows). The first report is enough: halt_on_error stops the run there."""
    run = _run_driver(_sanitized_driver("thread"), ["1000"], PLANTED_MISSING_BARRIER, timeout=600,
                      env={"TSAN_OPTIONS": (os.environ.get("TSAN_OPTIONS", "") + " halt_on_error=1").strip()})
    assert run.returncode != 0 and "data race" in run.stderr and "block_reduce" in run.stderr, run.stderr[-2000:]
