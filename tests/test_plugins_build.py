"""Build the CUDA kernels with CMake + nvcc (no GPU needed) and check the machine code.

- CMake says whether it builds the TensorRT plugin or kernels only.
- The fatbinary holds SASS for sm_80, sm_86, sm_89 and sm_90.
- In the sm_90 SASS, the vectorised RMSNorm / LayerNorm / AdaLNZero kernels (the modulation-axis
  AdaLN ones too) use 128-bit global loads and stores (`LDG.E.128`, `LDG.E.128.CONSTANT`, `STG.E.128`).
- No kernel uses local memory on any architecture (no LDL/STL; -res-usage STACK:0 LOCAL:0).
- The C ABI is exported and validates its arguments (that part runs on the CPU).
"""

from __future__ import annotations

import ctypes
import re

import pytest

try:
    from tests._plugin_build import (
        build_plugins,
        find_cmake,
        find_cuobjdump,
        find_nvcc,
        load_kernels,
        resource_usage,
        sass_by_function,
    )
except ImportError:  # tests/ not importable as a package: it is on sys.path itself
    from _plugin_build import (build_plugins, find_cmake, find_cuobjdump, find_nvcc, load_kernels, resource_usage,
                               sass_by_function)

if find_nvcc() is None:
    pytest.skip("nvcc not found (set CUDACXX or CUDA_HOME, or put nvcc on PATH)", allow_module_level=True)
if find_cmake() is None:
    pytest.skip("cmake not found on PATH", allow_module_level=True)

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
CUDA_ERROR_INVALID_VALUE = 1

# Mangled names of the row kernels: norm_{group,block}_kernel<T, NormKind, VEC, VPT[, LANES]>.
_KERNEL_RE = re.compile(
    r"norm_(?P<kind>group|block)_kernelI(?P<dtype>13__nv_bfloat16|6__half|f)LNS_8NormKindE(?P<op>\d)E"
    r"Li(?P<vec>\d+)ELi(?P<vpt>\d+)E(?:Li(?P<lanes>\d+)E)?"
)
_DTYPE = {"13__nv_bfloat16": "bf16", "6__half": "fp16", "f": "fp32"}
_FULL_VEC = {"bf16": 8, "fp16": 8, "fp32": 4}
_OP = {"0": "RMSNorm", "1": "LayerNorm", "2": "AdaLNZero", "3": "SkipRMSNorm", "4": "GatedAdaLNZero",
       # the AdaLN kernels of a [B, H] modulation following another dim of x (modulation_axis > 0)
       "5": "AdaLNZero", "6": "GatedAdaLNZero"}
_MOD_AXIS = {"5", "6"}

LDG128 = re.compile(r"\bLDG\.E(?:\.[A-Z0-9_]+)*\.128\b")
STG128 = re.compile(r"\bSTG\.E(?:\.[A-Z0-9_]+)*\.128\b")
LOCAL_MEM = re.compile(r"\b(?:LDL|STL)(?:\.[A-Z0-9_]+)*\b")


def _describe(mangled: str) -> dict | None:
    m = _KERNEL_RE.search(mangled)
    if not m:
        return None
    d = m.groupdict()
    dtype = _DTYPE[d["dtype"]]
    return {
        "op": _OP[d["op"]],
        "mod_axis": d["op"] in _MOD_AXIS,
        "dtype": dtype,
        "kind": d["kind"],
        "vec": int(d["vec"]),
        "vpt": int(d["vpt"]),
        "lanes": int(d["lanes"]) if d["lanes"] else None,
        "vectorised": int(d["vec"]) == _FULL_VEC[dtype],
    }


def _short_name(mangled: str) -> str:
    info = _describe(mangled)
    if info is None:
        m = re.search(r"norm_looped_kernelI(13__nv_bfloat16|6__half|f)LNS_8NormKindE(\d)E", mangled)
        if m:
            axis = " (modulation axis)" if m.group(2) in _MOD_AXIS else ""
            return f"looped {_OP[m.group(2)]}{axis} {_DTYPE[m.group(1)]}"
        return mangled
    lanes = f" lanes={info['lanes']}" if info["lanes"] else ""
    axis = " (modulation axis)" if info["mod_axis"] else ""
    return f"{info['kind']} {info['op']}{axis} {info['dtype']} vec={info['vec']} vpt={info['vpt']}{lanes}"


@pytest.fixture(scope="module")
def build():
    try:
        # headers alone suffice for the plugin (as tests/test_trt_plugin_host.py and conftest's plugin_lib
        # build it): one build shared by the plugin tests; the kernels-only configure of a TensorRT_ROOT
        # without libnvinfer is test_headers_without_libnvinfer_configure_kernels_only's
        return build_plugins(trt_headers_only=True)
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def cuobjdump():
    tool = find_cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found: pip install nvidia-cuda-cuobjdump (or use a full CUDA toolkit)")
    return tool


@pytest.fixture(scope="module")
def sass_sm90(build, cuobjdump):
    return sass_by_function(cuobjdump, build.kernels_lib, "sm_90")


def test_build_reports_what_it_builds(build):
    print(f"\nbuilt for {build.archs} in {build.seconds:.1f} s into {build.build_dir}")
    assert build.kernels_lib.exists()
    if build.plugin_lib is None:
        assert "TensorRT not found: building kernels only" in build.configure_output
        assert "-DTensorRT_ROOT=" in build.configure_output
    else:
        # 10.x or 11.x, whichever headers TensorRT_ROOT holds (a real version, never "..")
        assert re.search(r"TensorRT 1[01]\.\d+\.\d+ headers found at .+ \(.+\): building plugin", build.configure_output)


def test_headers_without_libnvinfer_configure_kernels_only(tmp_path):
    """A TensorRT_ROOT with TensorRT's headers but no libnvinfer, without NORMEXPORT_TRT_HEADERS_ONLY: CMake
    says it is not a TensorRT install and configures the kernels only (configure alone: nothing is built)."""
    import os
    import shutil
    import subprocess

    try:
        from tests._plugin_build import PLUGINS_DIR, find_tensorrt_root, tensorrt_include
    except ImportError:
        from _plugin_build import PLUGINS_DIR, find_tensorrt_root, tensorrt_include
    root = find_tensorrt_root()
    if root is None:
        pytest.skip("no TensorRT headers: test_build_reports_what_it_builds configures the kernels only")
    headers = tmp_path / "trt"
    headers.mkdir()
    (headers / "include").symlink_to(tensorrt_include(root))  # the headers, without lib/libnvinfer.so
    configure = [find_cmake(), "-S", str(PLUGINS_DIR), "-B", str(tmp_path / "build"),
                 f"-DCMAKE_CUDA_COMPILER={find_nvcc()}", "-DCMAKE_CUDA_ARCHITECTURES=90", f"-DTensorRT_ROOT={headers}"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    run = subprocess.run(configure, capture_output=True, text=True, env={**os.environ, "TensorRT_ROOT": str(headers)})
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    if re.search(r"headers found at .+ \((?!no libnvinfer).+\): building plugin", out):
        pytest.skip("this machine has a libnvinfer where CMake looks: the plugin is built with it")
    assert "but no libnvinfer: not a TensorRT install" in out and "TensorRT not found: building kernels only" in out, out
    assert "-DTensorRT_ROOT=" in out


def test_no_spill_warnings(build):
    # The CMake target passes -Xptxas -warn-spills,-warn-lmem-usage.
    assert "Registers are spilled" not in build.build_output
    assert "Local memory used" not in build.build_output


def test_fatbinary_has_all_architectures(build, cuobjdump):
    import subprocess

    out = subprocess.run([cuobjdump, "--list-elf", str(build.kernels_lib)], capture_output=True, text=True, check=True)
    for arch in ARCHS:
        assert f".{arch}.cubin" in out.stdout, out.stdout


def test_vectorised_kernels_use_128bit_accesses(sass_sm90):
    vectorised = {name: _describe(name) for name in sass_sm90 if (_describe(name) or {}).get("vectorised")}
    # Every op x dtype has vectorised group (warp / sub-warp) and block kernels.
    seen = {(i["op"], i["mod_axis"], i["dtype"], i["kind"]) for i in vectorised.values()}
    for op, mod_axis in [(op, False) for op in ("RMSNorm", "LayerNorm", "AdaLNZero", "SkipRMSNorm", "GatedAdaLNZero")] \
            + [("AdaLNZero", True), ("GatedAdaLNZero", True)]:
        for dtype in ("fp32", "fp16", "bf16"):
            for kind in ("group", "block"):
                assert (op, mod_axis, dtype, kind) in seen, f"missing vectorised {kind} kernel for {op} {dtype}"
    for name, info in vectorised.items():
        sass = sass_sm90[name]
        assert LDG128.search(sass), f"{_short_name(name)}: no 128-bit global load"
        assert STG128.search(sass), f"{_short_name(name)}: no 128-bit global store"
        # x is read with plain 128-bit loads; parameters through the read-only path.
        assert "LDG.E.128.CONSTANT" in sass, f"{_short_name(name)}: params not loaded as 128-bit read-only"
        narrow = re.findall(r"\b(?:LDG|STG)\.E(?:\.(?:U16|S16|U8|S8|64))?(?:\.CONSTANT)?\s", sass)
        assert not narrow, f"{_short_name(name)}: narrow global accesses {narrow[:4]}"


@pytest.mark.parametrize("arch", ARCHS)
def test_no_local_memory(build, cuobjdump, arch):
    sass = sass_by_function(cuobjdump, build.kernels_lib, arch)
    assert sass, f"no SASS for {arch}"
    for name, text in sass.items():
        assert not LOCAL_MEM.search(text), f"{arch} {_short_name(name)} uses local memory"
    usage = resource_usage(cuobjdump, build.kernels_lib, arch)
    assert set(usage) >= set(sass), "res-usage is missing kernels"
    for name, res in usage.items():
        assert res.get("STACK") == 0 and res.get("LOCAL") == 0, f"{arch} {_short_name(name)}: {res}"


def test_register_counts_sm90(build, cuobjdump):
    usage = resource_usage(cuobjdump, build.kernels_lib, "sm_90")
    rows = sorted((_short_name(n), r["REG"]) for n, r in usage.items())
    print("\nsm_90 registers per kernel:")
    for short, reg in rows:
        print(f"  {reg:4d}  {short}")
    # norm_common.cuh's reg_budget (__maxnreg__; tests/test_kernel_budgets.py checks the occupancy
    # they give): 64 with 4 or 8 vectors per thread, 40 for the AdaLN kinds and the group kernel's
    # two RMSNorm / LayerNorm rows of one vector per lane, else 32.
    for name, res in usage.items():
        info = _describe(name)
        if not info:
            continue
        two_rows = info["kind"] == "group" and info["vpt"] == 1 and info["op"] in ("RMSNorm", "LayerNorm")
        adaln = info["op"] in ("AdaLNZero", "GatedAdaLNZero")
        limit = 64 if info["vpt"] > 2 else (40 if adaln or two_rows else 32)
        assert res["REG"] <= limit, f"{_short_name(name)}: {res['REG']} registers > {limit}"


# ------------------------------------------------------------------------------------------
# C ABI (argument validation needs no GPU: it returns before any CUDA call)
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lib(build):
    return load_kernels(build.kernels_lib)


def test_abi_version(lib):
    assert lib.normexport_kernels_abi_version() == 1


def test_abi_rejects_bad_arguments(lib):
    fake = ctypes.c_void_p(0x1000)  # never dereferenced: validation fails first
    inval = CUDA_ERROR_INVALID_VALUE
    assert lib.normexport_rms_norm(fake, fake, fake, 4, 0, 0, 1e-6, None) == inval  # hidden < 1
    assert lib.normexport_rms_norm(fake, fake, fake, -1, 8, 0, 1e-6, None) == inval  # rows < 0
    assert lib.normexport_rms_norm(fake, fake, fake, 4, 8, 3, 1e-6, None) == inval  # dtype
    assert lib.normexport_rms_norm(fake, None, fake, 4, 8, 0, 1e-6, None) == inval  # scale required
    assert lib.normexport_rms_norm(None, fake, fake, 4, 8, 0, 1e-6, None) == inval  # x required
    assert lib.normexport_rms_norm(fake, fake, fake, 4, 8, 0, -1.0, None) == inval  # eps < 0
    assert lib.normexport_rms_norm(fake, fake, fake, 4, 8, 0, float("nan"), None) == inval
    assert lib.normexport_layer_norm(fake, None, None, None, 4, 8, 1, 1e-5, None) == inval  # y
    assert lib.normexport_adaln_zero(fake, None, fake, None, None, fake, 2, 3, 8, 0, 2, 1e-6, None) == inval
    assert lib.normexport_adaln_zero(fake, fake, fake, None, None, fake, 2, 3, 8, 2, 2, 1e-6, None) == inval
    assert lib.normexport_adaln_zero(fake, fake, fake, None, None, fake, -2, 3, 8, 0, 2, 1e-6, None) == inval
    # the modulation-axis entry points ([outer, batch, inner, hidden]): shift / gate required, sizes >= 0
    assert lib.normexport_adaln_zero_axis(fake, None, fake, None, None, fake, 3, 2, 1, 8, 2, 1e-6, None) == inval
    assert lib.normexport_adaln_zero_axis(fake, fake, fake, None, None, fake, 3, -2, 1, 8, 2, 1e-6, None) == inval
    assert lib.normexport_gated_adaln_zero_axis(fake, fake, None, fake, fake, None, None, fake, fake, 3, 2, 1, 8, 2,
                                                1e-6, None) == inval


def test_abi_empty_is_a_noop(lib):
    assert lib.normexport_rms_norm(None, None, None, 0, 8, 0, 1e-6, None) == 0
    assert lib.normexport_layer_norm(None, None, None, None, 0, 8, 1, 1e-5, None) == 0
    assert lib.normexport_adaln_zero(None, None, None, None, None, None, 0, 5, 8, 0, 2, 1e-6, None) == 0
    assert lib.normexport_adaln_zero_axis(None, None, None, None, None, None, 0, 2, 1, 8, 2, 1e-6, None) == 0
