#!/usr/bin/env bash
# Kernel variants side by side on one GPU, in one run (device time is short):
#   [BASELINE=DIR] bash tools/gpu_compare.sh
# builds libnormexport_kernels.so and the torch-free kernel driver for sm_90 from this checkout
# ("new"), from this checkout with each VARIANTS entry's defines ("NAME=-DX=1,-DY=2 ..."; default: the
# issue-48 switches of norm_common.cuh, docs/kernels.md "Variants"), and from BASELINE/plugins (an
# older checkout's plugins/kernels + plugins/include, "base"), then:
#   - the GPU kernel tests on "new" (PYTEST_ARGS adds options) and compute-sanitizer memcheck and
#     racecheck on a few of them;
#   - every variant's kernel driver (every entry point against float64 on the GPU) plain, then under
#     compute-sanitizer memcheck and racecheck (--quick);
#   - tools/bench_kernels.py on every build: "new" with torch eager and torch.compile
#     (NO_COMPILE=1: without), the others --ours-only; BENCH_ARGS gives the shapes (default: every
#     width in bf16 and fp32, two per-head shapes, decode 1 / 8 / 64 rows in bf16 at four widths);
#   - tools/bench_compare.py: one table of all of them.
# NCU=1 adds tools/ncu_kernels.py on "new" (NCU_SHAPES: its shapes). SKIP_TESTS=1 skips the tests and
# the sanitizers. Logs and JSON go to $OUT (the device tool's
# folder) or /tmp/normexport_compare.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/normexport_compare}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/compare.log"
exec > >(tee "$LOG") 2>&1
PY=${PY:-python3}
NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
ARCH=${ARCH:-sm_90}
BUILD=${BUILD_DIR:-/tmp/normexport_variants}
VARIANTS=${VARIANTS:-"warp=-DNORMEXPORT_WARP_ROWS=256 async4=-DNORMEXPORT_ASYNC_ROWS=4 \
async8=-DNORMEXPORT_ASYNC_ROWS=8 adaln4=-DNORMEXPORT_ADALN_VPT2_MAX_VECS=512"}
BENCH_ARGS=${BENCH_ARGS:-"--dtypes bfloat16 float32 --qk 393216x128 786432x64 --decode-rows 1 8 64 \
--decode-dtypes bfloat16 --decode-hidden 1152 3072 4096 8192"}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
echo "== $($NVCC --version | tail -1)"

build() { # NAME SRC_ROOT DEFINES...
    local name=$1 src=$2; shift 2
    mkdir -p "$BUILD/$name"
    local objs=() jobs=()
    for cu in "$src"/plugins/kernels/*.cu; do
        local o="$BUILD/$name/$(basename "$cu" .cu).o"
        objs+=("$o")
        "$NVCC" -std=c++17 -O3 -arch="$ARCH" -Xcompiler -fPIC -Xptxas -warn-spills "$@" -I"$src/plugins/include" \
            -c "$cu" -o "$o" & jobs+=($!)
    done
    "$NVCC" -std=c++17 -O3 -arch="$ARCH" "$@" -I"$src/plugins/include" -c "$src/plugins/tests/kernelSanitizerDriver.cu" \
        -o "$BUILD/$name/driver.o" & jobs+=($!)
    wait "${jobs[@]}"
    "$NVCC" -shared -arch="$ARCH" "${objs[@]}" -o "$BUILD/$name/libnormexport_kernels.so" || return 1
    "$NVCC" -arch="$ARCH" "$BUILD/$name/driver.o" "${objs[@]}" -o "$BUILD/$name/kernel_driver" || return 1
    echo "built $name ($*)"
}
start=$(date +%s)
pids=()
build new . & pids+=($!)
for v in $VARIANTS; do build "${v%%=*}" . $(echo "${v#*=}" | tr ',' ' ') & pids+=($!); done
if [ -n "${BASELINE:-}" ]; then build base "$BASELINE" & pids+=($!); fi
wait "${pids[@]}" # (a bare wait would also wait for the tee of the log)
echo "== builds took $(( $(date +%s) - start )) s"
[ -f "$BUILD/new/libnormexport_kernels.so" ] || { echo "gpu_compare: build failed"; exit 1; }
export NORMEXPORT_KERNELS_LIB=$BUILD/new/libnormexport_kernels.so

status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    echo "== GPU kernel tests (new)"
    $PY -m pytest -q -x tests/test_kernels_gpu.py ${PYTEST_ARGS:-} 2>&1 | tail -15 || status=1
    if command -v compute-sanitizer >/dev/null; then
        for tool in memcheck racecheck; do
            echo "== compute-sanitizer --tool $tool (normexport kernels only)"
            compute-sanitizer --tool $tool --kernel-name kns=norm_ --error-exitcode 9 \
                $PY -m pytest -q -x tests/test_kernels_gpu.py -k "${SANITIZER_K:-1000}" -p no:cacheprovider \
                2>&1 | tail -6
            [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "compute-sanitizer $tool FAILED"; status=1; }
        done
    fi
    for name in $(for v in $VARIANTS; do echo "${v%%=*}"; done); do
        drv="$BUILD/$name/kernel_driver"
        [ -x "$drv" ] || { echo "== $name: no kernel driver built"; status=1; continue; }
        "$drv" > "$OUTDIR/driver_$name.log" 2>&1 || status=1
        echo "== $name kernel driver: $(grep -E '[0-9]+ cases' "$OUTDIR/driver_$name.log" | tail -1)"
        if command -v compute-sanitizer >/dev/null; then
            for tool in memcheck racecheck; do
                compute-sanitizer --tool $tool --error-exitcode 9 "$drv" --quick > "$OUTDIR/driver_${name}_$tool.log" 2>&1 \
                    || { echo "== $name compute-sanitizer $tool FAILED"; status=1; }
                grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUTDIR/driver_${name}_$tool.log" | tail -1
            done
        fi
    done
fi

echo "== benchmarks"
$PY tools/bench_kernels.py --lib "$BUILD/new/libnormexport_kernels.so" --out-dir "$OUTDIR/new" $BENCH_ARGS \
    $( [ "${NO_COMPILE:-0}" = 1 ] && echo --no-compile ) \
    > "$OUTDIR/bench_new.txt" 2>&1 || status=1
tail -4 "$OUTDIR/bench_new.txt"
for name in $( [ -n "${BASELINE:-}" ] && echo base ) $(for v in $VARIANTS; do echo "${v%%=*}"; done); do
    $PY tools/bench_kernels.py --lib "$BUILD/$name/libnormexport_kernels.so" --out-dir "$OUTDIR/$name" --ours-only \
        $BENCH_ARGS > "$OUTDIR/bench_$name.txt" 2>&1 || status=1
    tail -1 "$OUTDIR/bench_$name.txt"
done
if [ "${NCU:-0}" = 1 ]; then  # Nsight Compute of "new" next to torch.compile's kernels (tools/ncu_kernels.py)
    echo "== ncu"
    $PY tools/ncu_kernels.py --lib "$BUILD/new/libnormexport_kernels.so" --out-dir "$OUTDIR/ncu" $NCU_SHAPES \
        > "$OUTDIR/ncu.log" 2>&1 || status=1
    tail -20 "$OUTDIR/ncu.log"
fi
rm -f "$OUTDIR"/*/*.png
$PY tools/bench_compare.py "$OUTDIR"/new/*.json $(for d in "$OUTDIR"/*/; do [ "$d" = "$OUTDIR/new/" ] || echo "$d"*.json; done)
exit $status
