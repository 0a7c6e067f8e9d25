#!/usr/bin/env bash
# One command for a GPU machine, run from the repository root:
#   bash tools/gpu_check.sh
#
# 1. Python: uses the system python3 if it already imports torch (GPU machines often have no
#    internet); else .venv (created as the README does: python3 -m venv .venv, pip install
#    torch==2.13.0, pip install -e '.[test]').
# 2. Builds plugins/ with CMake into build/plugins, the TensorRT plugin too: TensorRT_ROOT (an install,
#    or the include/ folder of NVIDIA/TensorRT alone, built with NORMEXPORT_TRT_HEADERS_ONLY=ON since
#    the plugin never links libnvinfer), else a TensorRT install, else CMake's fallback to NVIDIA's
#    headers at ../shared/third_party/tensorrt beside the checkout.
# 3. pytest tests/test_kernels_gpu.py tests/test_plugins_build.py (+ TensorRT: tests/test_trt_plugin_host.py,
#    tests/test_trt.py, tests/test_trt_precision.py); PYTEST_FILES replaces that list, PYTEST_ARGS adds options.
# 4. tools/bench_kernels.py (BENCH_ARGS adds to it; the per-head q/k norm shapes and the goal verdicts
#    are part of its default run); results in benchmarks/results/ (in $OUT when set:
#    the device tool's output folder, written as the run goes so that a run cut short still returns
#    its logs).
# 4b. sanitize: build/plugins/normexport_kernel_sanitizer_driver (every kernel entry point and path
#    against a float64 host reference, no torch) once plain, then under compute-sanitizer memcheck,
#    racecheck, synccheck and initcheck (SANITIZER_TOOLS replaces that list; racecheck and initcheck
#    run its --quick set); logs normexport_sanitizer_<tool>.log in $OUT or /tmp. Then two planted bugs that
#    must be caught: the driver with --plant eps (kernels get 2x epsilon: mismatches vs float64) and
#    under memcheck with --plant short-y (each y one element short: invalid writes reported).
# STEPS="build tests sanitize bench" (default) selects the steps.
set -uo pipefail
cd "$(dirname "$0")/.."

if python3 -c 'import torch' >/dev/null 2>&1; then
    PY=python3
elif [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
    PY=.venv/bin/python
else
    echo "== creating .venv (needs internet)"
    python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 && .venv/bin/pip install -q -e '.[test]' || {
        echo "gpu_check: could not set up Python with torch" >&2; exit 2; }
    PY=.venv/bin/python
fi
echo "== python: $($PY -c 'import sys, torch; print(sys.executable, "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())')"
$PY -c 'import pytest' >/dev/null 2>&1 || $PY -m pip install -q pytest numpy || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true

# TensorRT headers staged by tools/stage_device.sh (the device tool carries .device, not ../shared)
if [ -z "${TensorRT_ROOT:-}" ] && [ -f .device/tensorrt/include/NvInfer.h ]; then
    export TensorRT_ROOT=$PWD/.device/tensorrt
fi
NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
echo "== building plugins with $NVCC"
CMAKE_ARGS=(-S plugins -B build/plugins -DCMAKE_CUDA_COMPILER="$NVCC")
[ -n "${TensorRT_ROOT:-}" ] && CMAKE_ARGS+=(-DTensorRT_ROOT="$TensorRT_ROOT" -DNORMEXPORT_TRT_HEADERS_ONLY=ON)
[ -n "${CUDA_ARCHS:-}" ] && CMAKE_ARGS+=(-DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS")
STEPS=${STEPS:-build tests sanitize bench}
command -v ninja >/dev/null && CMAKE_ARGS+=(-G Ninja)
start=$(date +%s)
cmake "${CMAKE_ARGS[@]}" && cmake --build build/plugins -j "$(nproc)" || { echo "gpu_check: build failed" >&2; exit 1; }
echo "== build took $(( $(date +%s) - start )) s"
export NORMEXPORT_KERNELS_LIB=$PWD/build/plugins/libnormexport_kernels.so
[ -f build/plugins/libnormexport_plugins.so ] && export NORMEXPORT_PLUGIN_LIB=$PWD/build/plugins/libnormexport_plugins.so

LOGS=${OUT:-/tmp}
RESULTS=${OUT:-benchmarks/results}
mkdir -p "$LOGS" "$RESULTS"
status=0
echo "== pytest (log: $LOGS/normexport_gpu_pytest.log)"
if [[ " $STEPS " == *" tests "* ]]; then
    PYTEST_FILES=${PYTEST_FILES:-tests/test_kernels_gpu.py tests/test_plugins_build.py tests/test_trt_plugin_host.py \
tests/test_trt.py tests/test_trt_precision.py}
    PYTHONUNBUFFERED=1 $PY -m pytest $PYTEST_FILES -rs ${PYTEST_ARGS:-} 2>&1 | tee "$LOGS/normexport_gpu_pytest.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [[ " $STEPS " == *" sanitize "* ]]; then
    DRIVER=build/plugins/normexport_kernel_sanitizer_driver
    SANITIZER=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
    echo "== kernel driver, plain (log: $LOGS/normexport_sanitizer_plain.log)"
    "$DRIVER" > "$LOGS/normexport_sanitizer_plain.log" 2>&1 || status=1
    grep -E "^(device|FAIL|[0-9]+ cases)" "$LOGS/normexport_sanitizer_plain.log"
    for tool in ${SANITIZER_TOOLS:-memcheck racecheck synccheck initcheck}; do
        args=()
        [[ $tool == racecheck || $tool == initcheck ]] && args=(--quick)
        t0=$(date +%s)
        "$SANITIZER" --tool "$tool" --error-exitcode 3 "$DRIVER" "${args[@]}" > "$LOGS/normexport_sanitizer_$tool.log" 2>&1
        rc=$?
        [ $rc -eq 0 ] || status=1
        echo "== compute-sanitizer --tool $tool: exit $rc in $(( $(date +%s) - t0 )) s; $(grep -E '[0-9]+ cases' "$LOGS/normexport_sanitizer_$tool.log" | tail -1); $(grep -E 'ERROR SUMMARY' "$LOGS/normexport_sanitizer_$tool.log" | tail -1)"
    done
    # Planted bugs, each of which the run above must catch: a wrong epsilon (the float64 comparison)
    # and an output one element short (memcheck). planted WHAT LOG EXIT PATTERN CMD...: caught when CMD
    # exits EXIT and its log has PATTERN.
    planted() {
        local what=$1 log=$LOGS/$2 want=$3 pattern=$4
        shift 4
        "$@" > "$log" 2>&1
        local rc=$? n
        n=$(grep -c "$pattern" "$log")
        if [ $rc -eq "$want" ] && [ "$n" -gt 0 ]; then
            echo "== planted $what: caught ($n x '$pattern')"
        else
            echo "== planted $what: NOT caught (exit $rc, $n x '$pattern')"; status=1
        fi
    }
    planted "2x epsilon" normexport_plant_eps.log 1 '^FAIL' "$DRIVER" --quick --plant eps
    planted "y one element short" normexport_plant_short_y.log 3 'Invalid __global__ write' \
        "$SANITIZER" --tool memcheck --error-exitcode 3 "$DRIVER" --quick --plant short-y
fi

echo "== benchmark (log: $LOGS/normexport_bench.log, results: $RESULTS)"
if [[ " $STEPS " == *" bench "* ]]; then
    PYTHONUNBUFFERED=1 $PY tools/bench_kernels.py --lib "$NORMEXPORT_KERNELS_LIB" --out-dir "$RESULTS" ${BENCH_ARGS:-} 2>&1 \
        | tee "$LOGS/normexport_bench.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
