"""The TensorRT plugin library, built against real TensorRT 10 headers and driven as TensorRT
drives it, without a TensorRT engine.

- CMake builds libnormexport_plugins.so from the headers alone; it links no libnvinfer (nothing
  from nvinfer1 left undefined, no libnvinfer in DT_NEEDED) and exports only the two entry points
  TensorRT's plugin-library loading looks up: getCreators and setLoggerFinder.
- plugins/tests/pluginHostTest.cpp dlopens it and walks both creators through createPlugin (ONNX
  parser fields), the build-time calls, serialisation -> deserialisation, onShapeChange and enqueue
  (on a GPU: real kernels vs a float64 reference; without one: a logged launch failure).
- The same program against the plugin sources linked with the CPU-emulated kernels
  (tests/cuda_emu): enqueue's layout handling (axis, rank, [B,H] / [1,H] / full modulation, a [B,H]
  modulation following X's dim modulation_axis (sequence-first [S, B, H]), optional affine) runs
  end to end on host memory and is compared with float64.

Skips, with the reason, where no TensorRT headers are found (TensorRT_ROOT).
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

try:
    from tests._plugin_build import (build_emulated_plugin, build_plugins, find_cmake, find_nvcc, find_tensorrt_root,
                                     tensorrt_include)
except ImportError:  # tests/ not importable as a package: it is on sys.path itself
    from _plugin_build import (build_emulated_plugin, build_plugins, find_cmake, find_nvcc, find_tensorrt_root,
                               tensorrt_include)

TRT_ROOT = find_tensorrt_root()
if TRT_ROOT is None:
    pytest.skip("TensorRT headers not found (no NvInferRuntime.h under $TensorRT_ROOT/include or the system "
                "folders): set TensorRT_ROOT to a TensorRT 10 install to build and check the plugin library",
                allow_module_level=True)
if find_nvcc() is None or find_cmake() is None:
    pytest.skip("nvcc or cmake not found: cannot build the plugin library", allow_module_level=True)


@pytest.fixture(scope="module")
def build():
    try:
        # Headers are all the plugin needs (it never links libnvinfer), so headers without a
        # TensorRT install (NVIDIA's open-source include/ folder) are enough here.
        result = build_plugins(tensorrt_root=TRT_ROOT, trt_headers_only=True)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    assert result.plugin_lib is not None, f"TensorRT headers at {TRT_ROOT} but no plugin built:\n{result.configure_output}"
    return result


def _dynamic_symbols(lib, *flags) -> list[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not found")
    out = subprocess.run([nm, "-D", *flags, str(lib)], capture_output=True, text=True, check=True).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


def test_plugin_links_no_libnvinfer(build):
    undefined = _dynamic_symbols(build.plugin_lib, "--undefined-only")
    assert not [s for s in undefined if "nvinfer1" in s or s.startswith("createInfer")], undefined
    readelf = shutil.which("readelf")
    if readelf:
        dyn = subprocess.run([readelf, "-d", str(build.plugin_lib)], capture_output=True, text=True, check=True).stdout
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dyn)
        assert not [n for n in needed if "nvinfer" in n], needed


def test_plugin_exports_the_entry_points(build):
    exported = _dynamic_symbols(build.plugin_lib, "--defined-only")
    assert "getCreators" in exported and "setLoggerFinder" in exported
    ours = [s for s in exported if "normexport" in s or "nvinfer1" in s]
    assert not ours, f"internal symbols leak from the plugin library: {ours}"


def test_plugin_driven_like_tensorrt(build):
    assert build.plugin_host_test is not None, "normexport_plugin_host_test was not built"
    run = subprocess.run([str(build.plugin_host_test), str(build.plugin_lib)], capture_output=True, text=True,
                         timeout=300)
    print(run.stdout)
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAIL")]
    assert run.returncode == 0 and not failed, f"rc={run.returncode}\n{run.stdout}\n{run.stderr}"
    assert re.search(r"^\d+ checks, 0 failed$", run.stdout, re.M)


def test_plugin_enqueue_on_emulated_kernels():
    """enqueue's shape handling end to end, without a GPU: the plugin sources linked with the
    CPU-emulated kernels, every enqueue case compared with float64."""
    try:
        lib, program = build_emulated_plugin(tensorrt_include(TRT_ROOT))
    except RuntimeError as exc:
        pytest.fail(str(exc))
    run = subprocess.run([str(program), str(lib)], capture_output=True, text=True, timeout=600)
    print(run.stdout)
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAIL")]
    assert run.returncode == 0 and not failed, f"rc={run.returncode}\n{run.stdout}\n{run.stderr}"
    enqueued = [line for line in run.stdout.splitlines() if line.startswith("PASS") and "on emulated kernels" in line]
    # 18 RMSNorm / AdaLNZero, 10 fused; 9 of them with modulation_axis (sequence-first [S, B, H] and rank 4)
    assert len(enqueued) == 28, enqueued
    assert len([line for line in enqueued if "modulation_axis" in line]) == 9, enqueued
