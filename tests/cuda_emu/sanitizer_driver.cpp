/*
 * Memory-safety and race check of the kernels under the CPU emulation (tests/cuda_emu/emu.h), built
 * by tests/test_kernels_emulated.py with AddressSanitizer + UndefinedBehaviorSanitizer, and with
 * ThreadSanitizer (the emulated threads of a block share `__shared__` memory exactly as CUDA
 * threads do, so a missing __syncthreads between writing and re-using it is a data race here).
 *
 * Every tensor is its own heap allocation of exactly its size (a misaligned tensor starts one
 * element into an allocation one element longer, so its end is still the allocation's end), so
 * any read or write past a tensor, by any emulated thread, is reported by the sanitizer and
 * aborts the program. Numerics are checked by the Python tests; this program only checks that
 * every call succeeds without touching memory it does not own.
 *
 * Usage: sanitizer_driver [HIDDEN[:DTYPES] ...]  (default: every launch path, every dtype; DTYPES:
 *        letters of f (float32), h (float16), b (bfloat16), default all three; each size runs aligned
 *        and misaligned; prints the number of calls; exit code 0 when every call returned 0)
 */
#include "normexport_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace
{

template <typename T>
T fromFloat(float v);
template <>
float fromFloat<float>(float v)
{
    return v;
}
template <>
__half fromFloat<__half>(float v)
{
    return __float2half(v);
}
template <>
__nv_bfloat16 fromFloat<__nv_bfloat16>(float v)
{
    return __float2bfloat16(v);
}

//! One tensor in a heap allocation of exactly its size (+1 leading element when misaligned).
template <typename T>
class Exact
{
public:
    Exact(size_t n, bool misaligned, float seed)
        : mBase(new T[n + (misaligned ? 1 : 0)])
        , mPtr(mBase + (misaligned ? 1 : 0))
    {
        for (size_t i = 0; i < n; ++i)
        {
            mPtr[i] = fromFloat<T>(std::sin(0.71F * static_cast<float>(i) + seed) + 0.25F * seed);
        }
    }
    ~Exact()
    {
        delete[] mBase;
    }
    Exact(Exact const&) = delete;
    Exact& operator=(Exact const&) = delete;
    T* get() const
    {
        return mPtr;
    }

private:
    T* mBase;
    T* mPtr;
};

int gCalls = 0;
int gFailures = 0;

void expectOk(cudaError_t rc, char const* op, int dtype, long hidden, bool misaligned)
{
    ++gCalls;
    if (rc != cudaSuccess)
    {
        ++gFailures;
        std::printf("FAIL %s dtype %d hidden %ld misaligned %d: cudaError %d\n", op, dtype, hidden, misaligned ? 1 : 0,
            static_cast<int>(rc));
    }
}

template <typename T>
void run(int dtype, long hidden, bool mis)
{
    long const rows = 3;
    long const batch = 1;
    long const seq = 3;
    {
        Exact<T> x(rows * hidden, mis, 1.F), w(hidden, mis, 2.F), y(rows * hidden, mis, 0.F);
        expectOk(normexport_rms_norm(x.get(), w.get(), y.get(), rows, hidden, dtype, 1e-6F, nullptr), "rms_norm", dtype,
            hidden, mis);
    }
    {
        Exact<T> x(rows * hidden, mis, 1.F), w(hidden, mis, 2.F), b(hidden, mis, 3.F), y(rows * hidden, mis, 0.F);
        expectOk(normexport_layer_norm(x.get(), w.get(), b.get(), y.get(), rows, hidden, dtype, 1e-5F, nullptr),
            "layer_norm", dtype, hidden, mis);
        expectOk(normexport_layer_norm(x.get(), nullptr, nullptr, y.get(), rows, hidden, dtype, 1e-5F, nullptr),
            "layer_norm (no affine)", dtype, hidden, mis);
    }
    for (int full = 0; full <= 1; ++full)
    {
        long const modRows = full ? batch * seq : batch;
        Exact<T> x(batch * seq * hidden, mis, 1.F), sh(modRows * hidden, mis, 4.F), sc(modRows * hidden, mis, 5.F),
            w(hidden, mis, 2.F), b(hidden, mis, 3.F), y(batch * seq * hidden, mis, 0.F);
        expectOk(normexport_adaln_zero(x.get(), sh.get(), sc.get(), w.get(), b.get(), y.get(), batch, seq, hidden, full,
                     dtype, 1e-6F, nullptr),
            full ? "adaln_zero (full)" : "adaln_zero ([B,H])", dtype, hidden, mis);
        Exact<T> upd(batch * seq * hidden, mis, 6.F), gate(modRows * hidden, mis, 7.F), sum(batch * seq * hidden, mis, 0.F);
        expectOk(normexport_gated_adaln_zero(x.get(), upd.get(), gate.get(), sh.get(), sc.get(), w.get(), b.get(), y.get(),
                     sum.get(), batch, seq, hidden, full, dtype, 1e-6F, nullptr),
            full ? "gated_adaln_zero (full)" : "gated_adaln_zero ([B,H])", dtype, hidden, mis);
    }
    {
        // [B, H] modulation following x's dim 1 (modulation_axis 1, sequence-first x [S, B, H]):
        // x of S * B rows, shift / scale / gate of exactly B rows (row r reads row r % B)
        long const s = 3, b2 = 2;
        Exact<T> x(s * b2 * hidden, mis, 1.F), sh(b2 * hidden, mis, 4.F), sc(b2 * hidden, mis, 5.F), w(hidden, mis, 2.F),
            b(hidden, mis, 3.F), y(s * b2 * hidden, mis, 0.F), upd(s * b2 * hidden, mis, 6.F), gate(b2 * hidden, mis, 7.F),
            sum(s * b2 * hidden, mis, 0.F);
        expectOk(normexport_adaln_zero_axis(x.get(), sh.get(), sc.get(), w.get(), b.get(), y.get(), s, b2, 1, hidden,
                     dtype, 1e-6F, nullptr),
            "adaln_zero_axis ([S, B, H])", dtype, hidden, mis);
        expectOk(normexport_gated_adaln_zero_axis(x.get(), upd.get(), gate.get(), sh.get(), sc.get(), w.get(), b.get(),
                     y.get(), sum.get(), s, b2, 1, hidden, dtype, 1e-6F, nullptr),
            "gated_adaln_zero_axis ([S, B, H])", dtype, hidden, mis);
    }
    {
        Exact<T> x(rows * hidden, mis, 1.F), skip(rows * hidden, mis, 2.F), bias(hidden, mis, 3.F), w(hidden, mis, 4.F),
            y(rows * hidden, mis, 0.F), sum(rows * hidden, mis, 0.F);
        expectOk(normexport_skip_rms_norm(x.get(), skip.get(), bias.get(), w.get(), y.get(), sum.get(), rows, hidden, dtype,
                     1e-6F, nullptr),
            "skip_rms_norm", dtype, hidden, mis);
    }
}

} // namespace

int main(int argc, char** argv)
{
    struct Size
    {
        long hidden;
        std::string dtypes; // letters of "fhb"
    };
    std::vector<Size> sizes;
    for (long h : {1L, 8L, 37L, 64L, 128L, 256L, 512L, 1000L, 1032L, 4096L, 6001L, 16384L, 20000L, 40000L})
    {
        sizes.push_back({h, "fhb"});
    }
    if (argc > 1)
    {
        sizes.clear();
        for (int i = 1; i < argc; ++i)
        {
            char const* colon = std::strchr(argv[i], ':');
            std::string const dtypes = colon ? std::string(colon + 1) : std::string("fhb");
            if (dtypes.empty() || dtypes.find_first_not_of("fhb") != std::string::npos)
            {
                std::fprintf(stderr, "bad size %s: HIDDEN[:DTYPES], DTYPES letters of fhb\n", argv[i]);
                return 2;
            }
            sizes.push_back({std::atol(argv[i]), dtypes});
        }
    }
    for (Size const& s : sizes)
    {
        for (bool mis : {false, true})
        {
            if (s.dtypes.find('f') != std::string::npos)
                run<float>(NORMEXPORT_FLOAT32, s.hidden, mis);
            if (s.dtypes.find('h') != std::string::npos)
                run<__half>(NORMEXPORT_FLOAT16, s.hidden, mis);
            if (s.dtypes.find('b') != std::string::npos)
                run<__nv_bfloat16>(NORMEXPORT_BFLOAT16, s.hidden, mis);
        }
    }
    std::printf("%d calls, %d failed\n", gCalls, gFailures);
    return gFailures == 0 ? 0 : 1;
}
