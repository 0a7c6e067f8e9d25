"""GPU correctness of the CUDA kernels through their C ABI (ctypes + torch CUDA tensors).

Compared against a float64 numpy reference written from the formulas (docs/design.md §2), with the
tolerances of docs/design.md §7 relative to max|ref|. Covers float32/float16/bfloat16, hidden sizes
from 1 to beyond register capacity (looped kernel), vectorised and scalar paths (pointers
offset by one element, odd hidden), [B,H] and full-shape modulation, with/without weight/bias.

Uses $NORMEXPORT_KERNELS_LIB when set, else builds plugins/ with CMake (shared helper).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("CUDA GPU not available (torch.cuda.is_available() is False)", allow_module_level=True)

try:
    from tests._plugin_build import build_plugins, find_nvcc, load_kernels
except ImportError:
    from _plugin_build import build_plugins, find_nvcc, load_kernels

DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ABS_TOL = {torch.float32: 1e-6, torch.float16: 0.0, torch.bfloat16: 0.0}
# 6001: scalar block kernel (8 per thread; the fused ops: looped) for every op; 32768: the half-precision vector block
# kernel at 1024 threads (its 64-register configuration)
HIDDEN = [1, 3, 7, 8, 64, 127, 128, 256, 1000, 1024, 1032, 2048, 4095, 4096, 6001, 8192, 8200, 16384, 32768]
ROWS = 37  # not a multiple of the rows per block


@pytest.fixture(scope="module")
def lib():
    path = os.environ.get("NORMEXPORT_KERNELS_LIB")
    if not path:
        if find_nvcc() is None:
            pytest.skip("nvcc not found and NORMEXPORT_KERNELS_LIB not set")
        path = str(build_plugins().kernels_lib)
    return load_kernels(path)


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------
def _tensor(shape, dtype, *, unaligned=False, gen=None, mean=0.0, std=1.0):
    """Random CUDA tensor; with unaligned=True its data pointer is offset by one element."""
    n = int(np.prod(shape))
    buf = torch.randn(n + 1, generator=gen, dtype=torch.float32) * std + mean
    buf = buf.to(device="cuda", dtype=dtype)
    t = buf[1:] if unaligned else buf[:n]
    return t.view(*shape)


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _np64(t):
    return None if t is None else t.detach().float().cpu().numpy().astype(np.float64)


def _check(y, ref, dtype, what):
    got = _np64(y)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output"
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    tol = REL_TOL[dtype] * scale + ABS_TOL[dtype]
    err = float(np.max(np.abs(got - ref))) if ref.size else 0.0
    assert err <= tol, f"{what}: max abs err {err:.3g} > tol {tol:.3g} (max|ref| {scale:.3g})"


def _stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def ref_rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def ref_ln(x, w, b, eps):
    mean = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mean) ** 2, axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


def ref_adaln(x, shift, scale, w, b, eps, mod_full):
    y = ref_ln(x, w, b, eps)
    if not mod_full:  # [B, H] -> [B, 1, H]
        shift, scale = shift[:, None, :], scale[:, None, :]
    return y * (1.0 + scale) + shift


# ------------------------------------------------------------------------------------------
# RMSNorm
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPE_IDS.values()))
@pytest.mark.parametrize("unaligned", ["none", "x", "y", "scale"])
def test_rms_norm(lib, dtype, hidden, unaligned):
    g = torch.Generator().manual_seed(hidden * 7 + DTYPES[dtype])
    eps = 1e-6
    x = _tensor((ROWS, hidden), dtype, unaligned=unaligned == "x", gen=g, mean=0.3, std=1.5)
    scale = _tensor((hidden,), dtype, unaligned=unaligned == "scale", gen=g, mean=1.0, std=0.5)
    y = _tensor((ROWS, hidden), dtype, unaligned=unaligned == "y", gen=g)
    rc = lib.normexport_rms_norm(_ptr(x), _ptr(scale), _ptr(y), ROWS, hidden, DTYPES[dtype], eps, _stream())
    assert rc == 0
    torch.cuda.synchronize()
    _check(y, ref_rms(_np64(x), _np64(scale), eps), dtype, f"rms hidden={hidden}")


# ------------------------------------------------------------------------------------------
# LayerNorm
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPE_IDS.values()))
@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_layer_norm(lib, dtype, hidden, affine):
    g = torch.Generator().manual_seed(hidden * 11 + DTYPES[dtype])
    eps = 1e-5
    x = _tensor((ROWS, hidden), dtype, gen=g, mean=2.0, std=3.0)
    w = _tensor((hidden,), dtype, gen=g, mean=1.0, std=0.5) if affine != "none" else None
    b = _tensor((hidden,), dtype, gen=g, std=0.5) if affine == "both" else None
    y = torch.empty_like(x)
    rc = lib.normexport_layer_norm(_ptr(x), _ptr(w), _ptr(b), _ptr(y), ROWS, hidden, DTYPES[dtype], eps, _stream())
    assert rc == 0
    torch.cuda.synchronize()
    _check(y, ref_ln(_np64(x), _np64(w), _np64(b), eps), dtype, f"layernorm hidden={hidden} affine={affine}")


# ------------------------------------------------------------------------------------------
# AdaLN-Zero
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPE_IDS.values()))
@pytest.mark.parametrize("mod_full", [0, 1], ids=["modBH", "modFull"])
@pytest.mark.parametrize("affine", [False, True], ids=["noaffine", "affine"])
def test_adaln_zero(lib, dtype, hidden, mod_full, affine):
    g = torch.Generator().manual_seed(hidden * 13 + DTYPES[dtype] * 3 + mod_full)
    eps = 1e-6
    batch, seq = 3, 13
    x = _tensor((batch, seq, hidden), dtype, gen=g, mean=-0.7, std=2.0)
    mshape = (batch, seq, hidden) if mod_full else (batch, hidden)
    shift = _tensor(mshape, dtype, gen=g, std=0.5)
    scale = _tensor(mshape, dtype, gen=g, std=0.5)
    w = _tensor((hidden,), dtype, gen=g, mean=1.0, std=0.3) if affine else None
    b = _tensor((hidden,), dtype, gen=g, std=0.3) if affine else None
    y = torch.empty_like(x)
    rc = lib.normexport_adaln_zero(
        _ptr(x), _ptr(shift), _ptr(scale), _ptr(w), _ptr(b), _ptr(y), batch, seq, hidden, mod_full, DTYPES[dtype], eps,
        _stream(),
    )
    assert rc == 0
    torch.cuda.synchronize()
    ref = ref_adaln(_np64(x), _np64(shift), _np64(scale), _np64(w), _np64(b), eps, mod_full)
    _check(y, ref, dtype, f"adaln hidden={hidden} mod_full={mod_full} affine={affine}")


@pytest.mark.parametrize("hidden", [1024, 8192])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPE_IDS.values()))
@pytest.mark.parametrize("which", ["x", "y", "shift", "scale", "weight"])
def test_adaln_zero_unaligned(lib, dtype, which, hidden):
    """Scalar path: one pointer offset by one element (hidden a multiple of the vector width)."""
    g = torch.Generator().manual_seed(5)
    eps, batch, seq = 1e-6, 2, 9
    x = _tensor((batch, seq, hidden), dtype, unaligned=which == "x", gen=g, mean=0.5, std=2.0)
    shift = _tensor((batch, hidden), dtype, unaligned=which == "shift", gen=g, std=0.5)
    scale = _tensor((batch, hidden), dtype, unaligned=which == "scale", gen=g, std=0.5)
    w = _tensor((hidden,), dtype, unaligned=which == "weight", gen=g, mean=1.0, std=0.3)
    b = _tensor((hidden,), dtype, gen=g, std=0.3)
    y = _tensor((batch, seq, hidden), dtype, unaligned=which == "y", gen=g)
    rc = lib.normexport_adaln_zero(
        _ptr(x), _ptr(shift), _ptr(scale), _ptr(w), _ptr(b), _ptr(y), batch, seq, hidden, 0, DTYPES[dtype], eps,
        _stream(),
    )
    assert rc == 0
    torch.cuda.synchronize()
    ref = ref_adaln(_np64(x), _np64(shift), _np64(scale), _np64(w), _np64(b), eps, False)
    _check(y, ref, dtype, f"adaln unaligned {which}")


@pytest.mark.parametrize("hidden", [20000, 40000])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPE_IDS.values()))
def test_beyond_register_capacity(lib, dtype, hidden):
    """40000 (and 20000 in fp32) are past the register-resident kernels and run the looped
    multi-pass kernel; fp16/bf16 at 20000 run the vector block kernel with 640 threads."""
    g = torch.Generator().manual_seed(hidden)
    rows, eps = 5, 1e-6
    x = _tensor((rows, hidden), dtype, gen=g, mean=1.0, std=2.0)
    s = _tensor((hidden,), dtype, gen=g, mean=1.0, std=0.5)
    y = torch.empty_like(x)
    assert lib.normexport_rms_norm(_ptr(x), _ptr(s), _ptr(y), rows, hidden, DTYPES[dtype], eps, _stream()) == 0
    torch.cuda.synchronize()
    _check(y, ref_rms(_np64(x), _np64(s), eps), dtype, f"rms looped hidden={hidden}")
    shift = _tensor((1, hidden), dtype, gen=g, std=0.5)
    scale = _tensor((1, hidden), dtype, gen=g, std=0.5)
    rc = lib.normexport_adaln_zero(
        _ptr(x), _ptr(shift), _ptr(scale), _ptr(s), None, _ptr(y), 1, rows, hidden, 0, DTYPES[dtype], eps, _stream()
    )
    assert rc == 0
    torch.cuda.synchronize()
    ref = ref_adaln(_np64(x)[None], _np64(shift), _np64(scale), _np64(s), None, eps, False)[0]
    _check(y, ref, dtype, f"adaln looped hidden={hidden}")
    b = _tensor((hidden,), dtype, gen=g, std=0.3)
    rc = lib.normexport_layer_norm(_ptr(x), _ptr(s), _ptr(b), _ptr(y), rows, hidden, DTYPES[dtype], eps, _stream())
    assert rc == 0
    torch.cuda.synchronize()
    _check(y, ref_ln(_np64(x), _np64(s), _np64(b), eps), dtype, f"layernorm looped hidden={hidden}")


def test_many_rows_and_side_stream(lib):
    """Many rows (several rows per block, grid-stride) on a non-default stream."""
    g = torch.Generator().manual_seed(1)
    rows, hidden, dtype = 100_003, 256, torch.bfloat16
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = _tensor((rows, hidden), dtype, gen=g, std=2.0)
        s = _tensor((hidden,), dtype, gen=g, mean=1.0, std=0.5)
        y = torch.empty_like(x)
        rc = lib.normexport_rms_norm(_ptr(x), _ptr(s), _ptr(y), rows, hidden, 2, 1e-6, ctypes.c_void_p(stream.cuda_stream))
    assert rc == 0
    stream.synchronize()
    _check(y, ref_rms(_np64(x), _np64(s), 1e-6), dtype, "rms many rows")


# ------------------------------------------------------------------------------------------
# Fused residual ops: SkipRMSNorm, GatedAdaLNZero (Y and Sum, docs/design.md §2)
# ------------------------------------------------------------------------------------------


def _rounded(a: np.ndarray, dtype) -> np.ndarray:
    """float64 values rounded to the IO dtype (the stored sum the op normalises)."""
    t = torch.from_numpy(a).to(dtype)
    return t.double().numpy()


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPE_IDS.values()))
@pytest.mark.parametrize("form", ["bias", "nobias", "unaligned"])
def test_skip_rms_norm(lib, dtype, hidden, form):
    g = torch.Generator().manual_seed(hidden * 13 + DTYPES[dtype])
    eps = 1e-6
    un = form == "unaligned"
    x = _tensor((ROWS, hidden), dtype, unaligned=un, gen=g, mean=0.3, std=1.5)
    skip = _tensor((ROWS, hidden), dtype, gen=g, mean=-0.2, std=1.0)
    bias = _tensor((hidden,), dtype, gen=g, std=0.5) if form != "nobias" else None
    scale = _tensor((hidden,), dtype, gen=g, mean=1.0, std=0.5)
    y = _tensor((ROWS, hidden), dtype, gen=g)
    total = _tensor((ROWS, hidden), dtype, gen=g)
    rc = lib.normexport_skip_rms_norm(_ptr(x), _ptr(skip), _ptr(bias), _ptr(scale), _ptr(y), _ptr(total), ROWS, hidden,
                                      DTYPES[dtype], eps, _stream())
    assert rc == 0
    torch.cuda.synchronize()
    ref_sum = _np64(x) + _np64(skip) + (0.0 if bias is None else _np64(bias))
    _check(total, ref_sum, dtype, f"skip-rms Sum hidden={hidden}")
    _check(y, ref_rms(_rounded(ref_sum, dtype), _np64(scale), eps), dtype, f"skip-rms Y hidden={hidden}")


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPE_IDS.values()))
@pytest.mark.parametrize("mod_full", [0, 1], ids=["modBH", "modFull"])
@pytest.mark.parametrize("affine", [False, True], ids=["noaffine", "affine"])
def test_gated_adaln_zero(lib, dtype, hidden, mod_full, affine):
    g = torch.Generator().manual_seed(hidden * 17 + DTYPES[dtype])
    eps = 1e-6
    batch, seq = 3, 5
    mod_shape = (batch, seq, hidden) if mod_full else (batch, hidden)
    x = _tensor((batch, seq, hidden), dtype, gen=g, mean=0.2, std=1.5)
    upd = _tensor((batch, seq, hidden), dtype, gen=g, mean=0.4, std=2.0)
    gate = _tensor(mod_shape, dtype, gen=g, mean=0.5, std=0.5)
    shift = _tensor(mod_shape, dtype, gen=g, std=0.3)
    scale = _tensor(mod_shape, dtype, gen=g, std=0.3)
    w = _tensor((hidden,), dtype, gen=g, mean=1.0, std=0.2) if affine else None
    b = _tensor((hidden,), dtype, gen=g, std=0.2) if affine else None
    y = _tensor((batch, seq, hidden), dtype, gen=g)
    total = _tensor((batch, seq, hidden), dtype, gen=g)
    rc = lib.normexport_gated_adaln_zero(_ptr(x), _ptr(upd), _ptr(gate), _ptr(shift), _ptr(scale), _ptr(w), _ptr(b),
                                         _ptr(y), _ptr(total), batch, seq, hidden, mod_full, DTYPES[dtype], eps,
                                         _stream())
    assert rc == 0
    torch.cuda.synchronize()
    gg = _np64(gate) if mod_full else _np64(gate)[:, None, :]
    ref_sum = _np64(x) + gg * _np64(upd)
    _check(total, ref_sum, dtype, f"gated Sum hidden={hidden}")
    ref = ref_adaln(_rounded(ref_sum, dtype), _np64(shift), _np64(scale), _np64(w), _np64(b), eps, mod_full)
    _check(y, ref, dtype, f"gated Y hidden={hidden}")


# ------------------------------------------------------------------------------------------
# modulation_axis (docs/design.md §2): x [outer, B, inner, H], modulation [B, H]; row r of x takes
# modulation row (r / inner) % B. outer > 1 and B > 1 run the *ModAxis kernels; the others the
# default kinds (the entry point decides).
# ------------------------------------------------------------------------------------------
AXIS_SHAPES = [(7, 3, 1), (5, 2, 3), (1, 4, 5), (6, 1, 2), (300, 2, 1)]  # (outer, batch, inner)


def _axis_mod(m: np.ndarray, outer: int, inner: int) -> np.ndarray:
    """[B, H] -> [outer, B, inner, H] by broadcasting (the float64 reference's modulation)."""
    return np.broadcast_to(m[None, :, None, :], (outer, m.shape[0], inner, m.shape[1]))


@pytest.mark.parametrize("hidden", [1, 7, 64, 1000, 4096, 6001, 20000])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPE_IDS.values()))
@pytest.mark.parametrize("shape", AXIS_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_adaln_zero_axis(lib, dtype, hidden, shape):
    outer, batch, inner = shape
    g = torch.Generator().manual_seed(hidden * 19 + DTYPES[dtype] + outer)
    eps = 1e-6
    x = _tensor((outer, batch, inner, hidden), dtype, gen=g, mean=0.4, std=2.0)
    shift = _tensor((batch, hidden), dtype, gen=g, std=0.5)
    scale = _tensor((batch, hidden), dtype, gen=g, std=0.5)
    w = _tensor((hidden,), dtype, gen=g, mean=1.0, std=0.3)
    b = _tensor((hidden,), dtype, gen=g, std=0.3)
    y = torch.empty_like(x)
    rc = lib.normexport_adaln_zero_axis(_ptr(x), _ptr(shift), _ptr(scale), _ptr(w), _ptr(b), _ptr(y), outer, batch,
                                        inner, hidden, DTYPES[dtype], eps, _stream())
    assert rc == 0
    torch.cuda.synchronize()
    ln = ref_ln(_np64(x), _np64(w), _np64(b), eps)
    ref = ln * (1.0 + _axis_mod(_np64(scale), outer, inner)) + _axis_mod(_np64(shift), outer, inner)
    _check(y, ref, dtype, f"adaln axis {shape} hidden={hidden}")


@pytest.mark.parametrize("hidden", [7, 1000, 4096, 20000])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPE_IDS.values()))
@pytest.mark.parametrize("shape", AXIS_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gated_adaln_zero_axis(lib, dtype, hidden, shape):
    outer, batch, inner = shape
    g = torch.Generator().manual_seed(hidden * 23 + DTYPES[dtype] + outer)
    eps = 1e-6
    full = (outer, batch, inner, hidden)
    x = _tensor(full, dtype, gen=g, mean=0.2, std=1.5)
    upd = _tensor(full, dtype, gen=g, mean=0.4, std=2.0)
    gate, shift, scale = (_tensor((batch, hidden), dtype, gen=g, mean=m, std=0.4) for m in (0.5, 0.0, 0.0))
    w = _tensor((hidden,), dtype, gen=g, mean=1.0, std=0.2)
    y = _tensor(full, dtype, gen=g)
    total = _tensor(full, dtype, gen=g)
    rc = lib.normexport_gated_adaln_zero_axis(_ptr(x), _ptr(upd), _ptr(gate), _ptr(shift), _ptr(scale), _ptr(w), None,
                                              _ptr(y), _ptr(total), outer, batch, inner, hidden, DTYPES[dtype], eps,
                                              _stream())
    assert rc == 0
    torch.cuda.synchronize()
    ref_sum = _np64(x) + _axis_mod(_np64(gate), outer, inner) * _np64(upd)
    _check(total, ref_sum, dtype, f"gated axis Sum {shape} hidden={hidden}")
    ln = ref_ln(_rounded(ref_sum, dtype), _np64(w), None, eps)
    ref = ln * (1.0 + _axis_mod(_np64(scale), outer, inner)) + _axis_mod(_np64(shift), outer, inner)
    _check(y, ref, dtype, f"gated axis Y {shape} hidden={hidden}")
