#!/usr/bin/env bash
# Kernel variants side by side on one GPU, in one run (device time is short):
#   BASELINE=DIR bash tools/gpu_compare.sh
# builds libnormexport_kernels.so for sm_90 from this checkout ("new"), from this checkout with each
# VARIANTS entry's defines ("NAME=-DX=1 ..."; default: prefetch, the block kernel holding the next
# row), and from BASELINE/plugins (an older checkout's plugins/kernels + plugins/include, "base"),
# then: the GPU kernel tests on "new" (PYTEST_ARGS adds options), compute-sanitizer memcheck and
# racecheck on a few of them, and tools/bench_kernels.py on every build (torch.compile and eager
# only with "new"; NO_COMPILE=1: not even there), then tools/bench_compare.py prints one table of all
# of them. SKIP_TESTS=1 skips the tests and the sanitizers.
# Logs and JSON go to $OUT (the device tool's folder) or /tmp/normexport_compare.
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
VARIANTS=${VARIANTS:-"prefetch=-DNORMEXPORT_BLOCK_PREFETCH=1"}
BENCH_ARGS=${BENCH_ARGS:-"--tokens 16384 --hidden 4096 8192 --dtypes bfloat16"}
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
    wait "${jobs[@]}"
    "$NVCC" -shared -arch="$ARCH" "${objs[@]}" -o "$BUILD/$name/libnormexport_kernels.so" || return 1
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
fi

echo "== benchmarks"
$PY tools/bench_kernels.py --lib "$BUILD/new/libnormexport_kernels.so" --out-dir "$OUTDIR/new" $BENCH_ARGS \
    $( [ "${NO_COMPILE:-0}" = 1 ] && echo --no-compile ) \
    > "$OUTDIR/bench_new.txt" 2>&1 || status=1
tail -4 "$OUTDIR/bench_new.txt"
for name in $( [ -n "${BASELINE:-}" ] && echo base ) $(for v in $VARIANTS; do echo "${v%%=*}"; done); do
    $PY tools/bench_kernels.py --lib "$BUILD/$name/libnormexport_kernels.so" --out-dir "$OUTDIR/$name" --no-compile \
        $BENCH_ARGS > "$OUTDIR/bench_$name.txt" 2>&1 || status=1
done
rm -f "$OUTDIR"/*/*.png
$PY tools/bench_compare.py "$OUTDIR"/new/*.json $(for d in "$OUTDIR"/*/; do [ "$d" = "$OUTDIR/new/" ] || echo "$d"*.json; done)
exit $status
