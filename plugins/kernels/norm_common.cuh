// Shared implementation of the normexport row-normalisation kernels (internal header).
//
// Design and budgets: docs/kernels.md ("Kernel layout", "Kernel budgets").
//   - norm_group_kernel: LANES threads (8..32, at most one warp) per row, 128-thread blocks; used
//     for short rows (per-head q/k norms). RMSNorm / LayerNorm rows of one vector per lane: two
//     rows per thread group (twice the loads in flight), weight / bias loaded once per block.
//   - norm_block_kernel: one row at a time per block; blockDim (a multiple of 32, <= 1024) chosen
//     at launch so that each thread holds VPT vectors of the row (2 up to 1024 vectors: 8192
//     half-precision / 4096 float32 values; 4 up to 4096 vectors). The AdaLN kinds with
//     per-sample modulation take NORMEXPORT_ADALN_ROWS (4) consecutive rows per block.
//   - norm_looped_kernel: one row per block, any hidden size, several passes over global memory.
// The AdaLN kinds' [B, H] modulation rows follow x's first dim (row / seq); the *ModAxis kinds (own
// instantiations, so the default kinds' code is untouched) follow another dim of x (the op's
// modulation_axis: row r of x [outer, B, inner, H] takes modulation row (r / inner) % B; a
// sequence-first x [S, B, H]: r % B).
// The row kernels keep the whole row in registers as packed IO values (VPT vectors of VEC elements
// per thread: a bf16/fp16 vector of 8 is 4 registers), loops fully unrolled so no register array is
// indexed dynamically, read x once and write y once. VEC = 16 / sizeof(T) gives 128-bit
// loads/stores; VEC = 1 is the generic scalar path.
//
// Statistics: one reduction round per row. Each thread takes the two-pass moments of its own
// values (count, mean, M2 = sum of squared deviations from its mean) from registers, then the
// moments are merged across the row with Chan's formula (warp shuffles; in the block kernel one
// shared-memory exchange between warps behind ONE barrier, its buffer alternating between rows so
// that no second barrier is needed). RMS kinds reduce the sum of squares the same way. The merge is
// symmetric in its operands, so every lane of a row computes bit-identical statistics. Where every
// thread holds equally many values (the usual case) the merge is the equal-count form: two
// shuffles a step, no division. Against the two-round reduction (mean, then squared deviations
// from it) the fp32 rounding order changes; the float64 tests' bounds are unchanged.
//
// Parameters (weight, bias, the per-sample shift / scale / gate) are read through __ldg (the
// read-only path, cached in L1 across the rows of a block / SM). Row indices are 32-bit (the
// dispatcher sends 2^31 rows or more to the looped kernel). Two measured switches (persistent grid,
// streaming cache hints) are below, off.
//
// Registers: each kernel carries __maxnreg__(reg_budget) so that the occupancy of docs/kernels.md
// holds at the block sizes the dispatcher uses (tests/test_kernel_budgets.py checks it from the
// built library's resource usage, without a GPU).
//
// The fused residual kinds (kSkipRms, kGatedAdaLN) first form the row sum
//   Sum = X + skip [+ bias]        (SkipRMSNorm)
//   Sum = X + gate * update        (GatedAdaLNZero)
// in float32, round it to T, store it (the next residual) and normalise that stored value, so the
// fused op equals the unfused Add + norm of the same dtype (the op contracts, docs/kernels.md).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <string.h>

#include <atomic>
#include <type_traits>

#include "normexport_kernels.h"

// Measured switches (tools/gpu_compare.sh builds variants with them; docs/kernels.md has the
// numbers). Both were slower on an H200 for most shapes, so both are off:
//   NORMEXPORT_PERSISTENT: a grid of as many blocks as are resident at once, each looping over
//     rows (else one block per row, or per set of rows for the group kernel);
//   NORMEXPORT_STREAM_HINTS: x / skip read with ld.global.nc.L1::no_allocate and y / sum written
//     with st.global.cs (else plain 128-bit loads and stores).
#if !defined(NORMEXPORT_PERSISTENT)
#define NORMEXPORT_PERSISTENT 0
#endif
#if !defined(NORMEXPORT_STREAM_HINTS)
#define NORMEXPORT_STREAM_HINTS 0
#endif
// Rows of up to this many vectors get 2 vectors per thread, longer ones 4 (up to 4096 vectors).
#if !defined(NORMEXPORT_VPT2_MAX_VECS)
#define NORMEXPORT_VPT2_MAX_VECS 1024
#endif
// Consecutive rows each block of the block kernel takes: the AdaLN kinds with per-sample ([B, H])
// modulation (a block's rows then share their shift / scale / gate rows, read from L1 after the
// first), the other kinds.
#if !defined(NORMEXPORT_ADALN_ROWS)
#define NORMEXPORT_ADALN_ROWS 4
#endif
#if !defined(NORMEXPORT_BLOCK_ROWS)
#define NORMEXPORT_BLOCK_ROWS 1
#endif
// Variants of issue 48, for tools/gpu_compare.sh to measure against the kernels above (all off: the
// default build's kernels and SASS are the same with or without them; docs/kernels.md, "Variants"):
//   NORMEXPORT_WARP_ROWS N: rows of 65..N 16-byte vectors (N <= 256: hidden 2048 half / 1024 fp32)
//     go to the group kernel with a whole warp per row, 4 or 8 vectors per lane, 4 rows per
//     128-thread block and no block barrier, instead of one row per block of 64..128 threads.
//   NORMEXPORT_ASYNC_ROWS R: rows of 2 16-byte vectors per thread (block kernel) are staged through
//     shared memory with cp.async, R consecutive rows per block, the next row's copy issued before
//     this row's statistics: a software pipeline across rows that holds no registers (each thread
//     reads back only the slots it copied, so no barrier is added).
//   NORMEXPORT_ADALN_VPT2_MAX_VECS N: the AdaLN kinds' rows of more than N vectors take 4 per thread
//     (default 1024: 8192 half / 4096 fp32 in 512-thread blocks; 512: those in 256-thread blocks).
#if !defined(NORMEXPORT_WARP_ROWS)
#define NORMEXPORT_WARP_ROWS 0
#endif
#if !defined(NORMEXPORT_ASYNC_ROWS)
#define NORMEXPORT_ASYNC_ROWS 0
#endif
#if !defined(NORMEXPORT_ADALN_VPT2_MAX_VECS)
#define NORMEXPORT_ADALN_VPT2_MAX_VECS 1024
#endif
static_assert(NORMEXPORT_WARP_ROWS == 0 || (NORMEXPORT_WARP_ROWS > 64 && NORMEXPORT_WARP_ROWS <= 256),
    "NORMEXPORT_WARP_ROWS: 0 (off) or 65..256 vectors");
static_assert(NORMEXPORT_ASYNC_ROWS >= 0, "NORMEXPORT_ASYNC_ROWS: 0 (off) or the rows per block");

namespace normexport
{

enum class NormKind
{
    kRms,        // y = x * rstd * scale
    kLayer,      // y = (x - mean) * rstd [* weight] [+ bias]
    kAdaLN,      // y = ((x - mean) * rstd [* weight] [+ bias]) * (1 + mod_scale) + shift
    kSkipRms,    // s = x + residual [+ res_bias]; y = s * rstd(s) * scale
    kGatedAdaLN, // s = x + gate * residual; y = AdaLN(s)
    // Not ops of their own (normexport_op ends above): kAdaLN / kGatedAdaLN whose [B, H] modulation
    // follows a dim of x other than the first (modulation row (row / mod_row_div) % mod_rows).
    kAdaLNModAxis,
    kGatedAdaLNModAxis,
};

template <NormKind K>
constexpr bool kIsRms = K == NormKind::kRms || K == NormKind::kSkipRms;
template <NormKind K>
constexpr bool kModAxis = K == NormKind::kAdaLNModAxis || K == NormKind::kGatedAdaLNModAxis;
template <NormKind K>
constexpr bool kIsGated = K == NormKind::kGatedAdaLN || K == NormKind::kGatedAdaLNModAxis;
template <NormKind K>
constexpr bool kIsAdaLN = K == NormKind::kAdaLN || K == NormKind::kGatedAdaLN || kModAxis<K>;
template <NormKind K>
constexpr bool kHasResidual = K == NormKind::kSkipRms || kIsGated<K>;

// The op a kind computes, for the dispatcher (a *ModAxis kind launches as its op does).
constexpr NormKind base_kind(NormKind k)
{
    return k == NormKind::kAdaLNModAxis ? NormKind::kAdaLN
        : k == NormKind::kGatedAdaLNModAxis ? NormKind::kGatedAdaLN
                                            : k;
}

struct NormParams
{
    void const* x;
    void const* weight;    // RMSNorm scale, or LayerNorm weight (nullable for LayerNorm/AdaLN)
    void const* bias;      // nullable
    void const* shift;     // AdaLN only
    void const* mod_scale; // AdaLN only
    void const* residual;  // fused kinds: SkipRMSNorm's skip, GatedAdaLNZero's update ([rows, hidden])
    void const* res_bias;  // SkipRMSNorm's optional bias [hidden] added to the sum (nullable)
    void const* gate;      // GatedAdaLNZero: gate, laid out as shift / mod_scale
    void* y;
    void* sum;             // fused kinds: the residual sum output ([rows, hidden])
    int64_t rows;
    int64_t hidden;
    int64_t mod_row_div;   // AdaLN: modulation row = row / mod_row_div (seq for [B,H], 1 for full)
    uint32_t block_rows;   // block kernel: consecutive rows per block (set at launch)
    float eps;
    float inv_hidden;      // 1 / hidden, computed on the host (a device fp32 division is a call)
    // (in what was the struct's tail padding: the other kinds' kernels see the same layout)
    uint32_t mod_rows;     // *ModAxis kinds: modulation row = (row / mod_row_div) % mod_rows (B)
};
static_assert(sizeof(NormParams) == 10 * sizeof(void*) + 3 * sizeof(int64_t) + 4 * sizeof(uint32_t),
    "NormParams has no padding: a new field changes the kernels' parameter layout");

// ---------------------------------------------------------------------------------------------
// Type helpers
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// N elements of T held as 32-bit words (a 16-byte pack: 4 registers, 8 bf16 / fp16 or 4 float32
// values; the scalar path's single 16-bit value sits in the low half of one word). Elements are
// read and written through get / set_all with bit operations on the words, so the compiler keeps
// 4 registers per vector instead of splitting bf16 / fp16 pairs into 8.
template <typename T, int N>
struct Pack
{
    static constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
    static constexpr int kWords = kBytes >= 4 ? kBytes / 4 : 1;
    uint32_t w[kWords];
};

__device__ __forceinline__ float bits_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}
__device__ __forceinline__ uint32_t float_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}
template <typename T>
__device__ __forceinline__ T half_from_bits(uint32_t u)
{
    uint16_t const h = static_cast<uint16_t>(u & 0xffffu);
    T t;
    memcpy(&t, &h, sizeof(t));
    return t;
}
template <typename T>
__device__ __forceinline__ uint32_t half_bits(T t)
{
    uint16_t h;
    memcpy(&h, &t, sizeof(h));
    return h;
}

// Element k (a compile-time constant after unrolling) as float.
template <typename T, int N>
__device__ __forceinline__ float get(Pack<T, N> const& pk, int k)
{
    if constexpr (sizeof(T) == 4)
        return bits_float(pk.w[k]);
    else if constexpr (N == 1)
        return to_float(half_from_bits<T>(pk.w[0]));
    else
    {
        uint32_t const word = pk.w[k / 2];
        if constexpr (std::is_same_v<T, __nv_bfloat16>)
            return bits_float((k & 1) ? (word & 0xffff0000u) : (word << 16));
        else
        {
            __half2 h;
            memcpy(&h, &word, sizeof(h));
            float2 const f = __half22float2(h);
            return (k & 1) ? f.y : f.x;
        }
    }
}

// All N elements from floats, rounded to T (round to nearest even).
template <typename T, int N>
__device__ __forceinline__ void set_all(Pack<T, N>& pk, float const (&a)[N])
{
    if constexpr (sizeof(T) == 4)
    {
#pragma unroll
        for (int k = 0; k < N; ++k)
            pk.w[k] = float_bits(a[k]);
    }
    else if constexpr (N == 1)
        pk.w[0] = half_bits(from_float<T>(a[0]));
    else
    {
#pragma unroll
        for (int j = 0; j < N / 2; ++j)
        {
            if constexpr (std::is_same_v<T, __nv_bfloat16>)
            {
                __nv_bfloat162 const h = __floats2bfloat162_rn(a[2 * j], a[2 * j + 1]);
                memcpy(&pk.w[j], &h, 4);
            }
            else
            {
                __half2 const h = __floats2half2_rn(a[2 * j], a[2 * j + 1]);
                memcpy(&pk.w[j], &h, 4);
            }
        }
    }
}

template <typename T, int N>
__device__ __forceinline__ void set_zero(Pack<T, N>& pk)
{
#pragma unroll
    for (int k = 0; k < Pack<T, N>::kWords; ++k)
        pk.w[k] = 0u; // +0 in every IO dtype
}

// How a pack is read or written.
enum class Access
{
    kStream, // x, skip / update: read once, not allocated in L1 (ld.global.nc.L1::no_allocate)
    kParam,  // weight, bias, shift, scale, gate: re-read by many rows, through L1 (__ldg)
};

template <Access A>
__device__ __forceinline__ uint4 load16(void const* p)
{
#if defined(__CUDA_ARCH__)
    uint4 r;
    if constexpr (A == Access::kStream && !NORMEXPORT_STREAM_HINTS)
        r = *reinterpret_cast<uint4 const*>(p);
    else if constexpr (A == Access::kStream)
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
            : "l"(p));
    else
        r = __ldg(reinterpret_cast<uint4 const*>(p));
    return r;
#else
    return *reinterpret_cast<uint4 const*>(p);
#endif
}

// One pack from p (aligned to its size): a 16-byte pack as one 128-bit access.
template <typename T, int N, Access A>
__device__ __forceinline__ Pack<T, N> load_raw(T const* p)
{
    Pack<T, N> pk;
    if constexpr (Pack<T, N>::kBytes == 16)
    {
        uint4 const raw = load16<A>(p);
        pk.w[0] = raw.x;
        pk.w[1] = raw.y;
        pk.w[2] = raw.z;
        pk.w[3] = raw.w;
    }
    else
    {
        static_assert(N == 1, "the scalar path reads one element");
        T const t = A == Access::kParam ? __ldg(p) : *p;
        if constexpr (sizeof(T) == 4)
            memcpy(&pk.w[0], &t, 4);
        else
            pk.w[0] = half_bits(t);
    }
    return pk;
}

// Store one pack; 16-byte packs as one streaming 128-bit store (st.global.cs: written once, not
// read again by this kernel).
template <typename T, int N>
__device__ __forceinline__ void store_raw(T* p, Pack<T, N> const& pk)
{
    if constexpr (Pack<T, N>::kBytes == 16)
    {
#if defined(__CUDA_ARCH__) && NORMEXPORT_STREAM_HINTS
        asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(pk.w[0]), "r"(pk.w[1]),
            "r"(pk.w[2]), "r"(pk.w[3])
            : "memory");
#else
        uint4 const raw = make_uint4(pk.w[0], pk.w[1], pk.w[2], pk.w[3]);
        *reinterpret_cast<uint4*>(p) = raw;
#endif
    }
    else if constexpr (sizeof(T) == 4)
        *reinterpret_cast<uint32_t*>(p) = pk.w[0];
    else
        *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(pk.w[0]); // one 16-bit store
}

template <typename T, int N>
__device__ __forceinline__ void unpack(Pack<T, N> const& pk, float (&out)[N])
{
#pragma unroll
    for (int k = 0; k < N; ++k)
        out[k] = get(pk, k);
}

// A parameter pack as floats.
template <typename T, int N>
__device__ __forceinline__ void load_param(T const* p, float (&out)[N])
{
    unpack(load_raw<T, N, Access::kParam>(p), out);
}

// Make the compiler forget what it knows about a pack's values (no instruction is emitted), so that
// each pass over the row converts the packed values to float again instead of keeping all of them
// as floats between passes: 4 registers per bf16 / fp16 vector instead of 8.
template <typename T, int N>
__device__ __forceinline__ void launder(Pack<T, N>& pk)
{
#if defined(__CUDA_ARCH__)
#pragma unroll
    for (int k = 0; k < Pack<T, N>::kWords; ++k)
        asm volatile("" : "+r"(pk.w[k]));
#endif
}

// The same for an index: what is derived from it (addresses of this thread's columns) is computed
// again where used instead of being hoisted out of the row loop and held in registers for its
// whole length.
__device__ __forceinline__ int fresh(int v)
{
#if defined(__CUDA_ARCH__)
    asm volatile("" : "+r"(v));
#endif
    return v;
}

// ---------------------------------------------------------------------------------------------
// Reductions: one round per row
// ---------------------------------------------------------------------------------------------
// Sum over aligned groups of LANES consecutive lanes (LANES a power of two <= 32). All 32 lanes
// of the warp must call it.
template <int LANES>
__device__ __forceinline__ float group_sum(float v)
{
#pragma unroll
    for (int off = LANES / 2; off > 0; off >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Moments of a set of values: count, mean, M2 = sum of squared deviations from the mean.
struct Moments
{
    float n;
    float mean;
    float m2;
};

// Chan et al.'s merge of two disjoint sets' moments, written symmetrically in the two operands
// (sums and products only), so that both lanes of a shuffle step get the same bits.
__device__ __forceinline__ Moments merge(Moments a, Moments b)
{
    float const n = a.n + b.n;
    float const inv = n > 0.f ? __fdividef(1.f, n) : 0.f;
    float const d = b.mean - a.mean;
    return Moments{n, (a.n * a.mean + b.n * b.mean) * inv, (a.m2 + b.m2) + d * d * (a.n * b.n * inv)};
}

// One shuffle step of a merge: this lane's moments and those of lane ^ off. The general step ships
// the count too; the equal-count step (every lane holds the moments of equally many values: the
// row fills all the lanes' vectors, the common case) needs two shuffles and no division, and its
// mean (a + b) / 2 and M2a + M2b + d^2 n / 2 are symmetric in the two lanes as well.
__device__ __forceinline__ Moments merge_step(Moments v, int off)
{
    Moments const o{__shfl_xor_sync(0xffffffffu, v.n, off), __shfl_xor_sync(0xffffffffu, v.mean, off),
        __shfl_xor_sync(0xffffffffu, v.m2, off)};
    return merge(v, o);
}
__device__ __forceinline__ Moments merge_step_equal(Moments v, int off)
{
    float const om = __shfl_xor_sync(0xffffffffu, v.mean, off);
    float const o2 = __shfl_xor_sync(0xffffffffu, v.m2, off);
    float const d = om - v.mean;
    return Moments{2.f * v.n, (v.mean + om) * 0.5f, (v.m2 + o2) + d * d * (0.5f * v.n)};
}

// Reduction over aligned groups of LANES consecutive lanes (every lane of a group gets the same
// result): `equal` (uniform over the group) when every lane's moments count the same number of
// values. Sums do not care.
template <int LANES>
__device__ __forceinline__ float group_reduce(float v, bool /*equal*/)
{
    return group_sum<LANES>(v);
}
template <int LANES>
__device__ __forceinline__ Moments group_reduce(Moments v, bool equal)
{
#pragma unroll
    for (int off = LANES / 2; off > 0; off >>= 1)
        v = equal ? merge_step_equal(v, off) : merge_step(v, off);
    return v;
}

// The step of the reduction across warps: the first `lanes` lanes (a power of two) hold one warp's
// value each, and every aligned group of `lanes` lanes holds the same values.
__device__ __forceinline__ float warps_reduce_pow2(float v, int lanes, bool /*equal*/)
{
    for (int off = lanes / 2; off > 0; off >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}
__device__ __forceinline__ Moments warps_reduce_pow2(Moments v, int lanes, bool equal)
{
    for (int off = lanes / 2; off > 0; off >>= 1)
        v = equal ? merge_step_equal(v, off) : merge_step(v, off);
    return v;
}

// Words of shared memory a block reduction of V uses (one per warp per component).
template <typename V>
constexpr int kReduceWords = 32 * (sizeof(V) / sizeof(float));

__device__ __forceinline__ void put_warp(float* buf, int warp, float v) { buf[warp] = v; }
__device__ __forceinline__ void put_warp(float* buf, int warp, Moments v)
{
    buf[warp] = v.n;
    buf[32 + warp] = v.mean;
    buf[64 + warp] = v.m2;
}
__device__ __forceinline__ void get_warp(float const* buf, int lane, float& v) { v = buf[lane]; }
__device__ __forceinline__ void get_warp(float const* buf, int lane, Moments& v)
{
    v = Moments{buf[lane], buf[32 + lane], buf[64 + lane]};
}

// Reduction over the whole block (blockDim.x a multiple of 32, <= 1024) behind ONE barrier: each
// warp reduces with shuffles, lane 0 writes the warp's value to `buf`, __syncthreads, then every
// warp reduces the warps' values with shuffles. `buf` must not be written again before every
// thread has passed the next barrier: the block kernel alternates two buffers between rows.
// The warps' values are read by lane L from warp L mod P (P: nwarps rounded up to a power of two;
// warps nwarps..P-1 count as empty), and log2(P) steps run: every aligned group of P lanes merges
// the same values in the same order, so every lane gets the same result.
template <typename V>
__device__ __forceinline__ V block_reduce(V v, float* buf, bool equal)
{
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    int const nwarps = blockDim.x >> 5;
    v = group_reduce<32>(v, equal);
    if (lane == 0)
        put_warp(buf, warp, v);
    __syncthreads();
    int lanes = 1;
    while (lanes < nwarps)
        lanes <<= 1;
    int const src = lane & (lanes - 1);
    V t{};
    if (src < nwarps)
        get_warp(buf, src, t);
    return warps_reduce_pow2(t, lanes, equal && lanes == nwarps);
}

// The block kernels' reduction of a row: block_reduce over `red` (2 * kReduceWords<V> floats), its two
// halves used in turn (`parity`, the caller's, flips each row), so one barrier per row is enough.
template <typename V>
__device__ __forceinline__ auto alternating_reduce(float* red, int& parity)
{
    return [red, &parity](V v, bool equal) {
        V const r = block_reduce(v, red + parity * kReduceWords<V>, equal);
        parity ^= 1;
        return r;
    };
}

// Sum over the block for the looped kernel: two barriers, so `smem` (32 floats) is reusable at once.
__device__ __forceinline__ float block_sum(float v, float* smem)
{
    int const lane = threadIdx.x & 31;
    int const warp = threadIdx.x >> 5;
    int const nwarps = blockDim.x >> 5;
    v = group_sum<32>(v);
    if (lane == 0)
        smem[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? smem[lane] : 0.f;
    t = group_sum<32>(t);
    __syncthreads();
    return t;
}

// Row of the modulation tensors for row `row` of x (looped kernel: 64-bit rows).
__device__ __forceinline__ int64_t mod_row(int64_t row, int64_t div)
{
    if (div == 1)
        return row;
    if (((row | div) >> 32) == 0)
        return static_cast<uint32_t>(row) / static_cast<uint32_t>(div);
    return row / div;
}

// ---------------------------------------------------------------------------------------------
// One row held in registers. `tid` / `nthr`: this thread's index among the threads of the row.
// `valid` is false for padding rows: those threads still take part in the reductions but neither
// load nor store.
// ---------------------------------------------------------------------------------------------
template <typename T, NormKind K, int VEC, int VPT>
struct RowRegs
{
    Pack<T, VEC> x[VPT];
    Pack<T, VEC> r[kHasResidual<K> ? VPT : 1]; // the skip / update of the fused kinds
};

// Whether vector i of this thread is inside the row (recomputed rather than kept in a bool array:
// there are only 7 predicate registers).
__device__ __forceinline__ bool vec_in_row(bool valid, int tid, int i, int nthr, int nvec)
{
    return valid && tid + i * nthr < nvec;
}

// Issue every load of the row (x, and the skip / update of the fused kinds); vectors outside the
// row read as zeros.
template <typename T, NormKind K, int VEC, int VPT>
__device__ __forceinline__ void load_row(
    NormParams const& p, uint32_t row, bool valid, int tid, int nthr, RowRegs<T, K, VEC, VPT>& rr)
{
    int const nvec = static_cast<int>(p.hidden / VEC);
    size_t const base = static_cast<size_t>(row) * static_cast<size_t>(p.hidden);
    T const* __restrict__ xr = static_cast<T const*>(p.x) + base;
    T const* __restrict__ rs = static_cast<T const*>(p.residual) + base;
#pragma unroll
    for (int i = 0; i < VPT; ++i)
    {
        int const off = (tid + i * nthr) * VEC;
        if (vec_in_row(valid, tid, i, nthr, nvec))
        {
            rr.x[i] = load_raw<T, VEC, Access::kStream>(xr + off);
            if constexpr (kHasResidual<K>)
                rr.r[i] = load_raw<T, VEC, Access::kStream>(rs + off);
        }
        else
        {
            set_zero(rr.x[i]);
            if constexpr (kHasResidual<K>)
                set_zero(rr.r[i]);
        }
    }
}

// The weight and bias of this thread's columns: loaded once and kept (HOIST: the group kernel,
// whose lanes keep their columns for every row) or loaded where used.
template <typename T, NormKind K, int VEC, int VPT, bool HOIST>
struct Affine
{
    static constexpr int kN = HOIST ? VPT : 1;
    Pack<T, VEC> w[kN];
    Pack<T, VEC> b[kN];

    __device__ __forceinline__ void load(NormParams const& p, int tid, int nthr)
    {
        if constexpr (HOIST)
        {
            int const nvec = static_cast<int>(p.hidden / VEC);
#pragma unroll
            for (int i = 0; i < VPT; ++i)
            {
                int const off = (tid + i * nthr) * VEC;
                bool const in = vec_in_row(true, tid, i, nthr, nvec);
                w[i] = in && p.weight != nullptr ? load_raw<T, VEC, Access::kParam>(static_cast<T const*>(p.weight) + off)
                                                 : Pack<T, VEC>{};
                if constexpr (!kIsRms<K>)
                    b[i] = in && p.bias != nullptr ? load_raw<T, VEC, Access::kParam>(static_cast<T const*>(p.bias) + off)
                                                   : Pack<T, VEC>{};
            }
        }
    }
    __device__ __forceinline__ void weight(NormParams const& p, int i, int off, float (&out)[VEC]) const
    {
        get(w, p.weight, i, off, out);
    }
    __device__ __forceinline__ void bias(NormParams const& p, int i, int off, float (&out)[VEC]) const
    {
        get(b, p.bias, i, off, out);
    }

private:
    __device__ __forceinline__ static void get(
        Pack<T, VEC> const (&held)[kN], void const* param, int i, int off, float (&out)[VEC])
    {
        if constexpr (HOIST)
        {
            Pack<T, VEC> t = held[i];
            launder(t); // converted to float where used, not once before the row loop (8 registers)
            unpack(t, out);
        }
        else
            load_param<T, VEC>(static_cast<T const*>(param) + off, out);
    }
};

// Everything after the loads: the fused sum (stored), the row's statistics (one reduction round),
// the output.
template <typename T, NormKind K, int VEC, int VPT, bool HOIST, typename ReduceFn>
__device__ __forceinline__ void finish_row(NormParams const& p, uint32_t row, bool valid, int tid, int nthr,
    RowRegs<T, K, VEC, VPT>& rr, Affine<T, K, VEC, VPT, HOIST> const& aff, ReduceFn reduce)
{
    int const nvec = static_cast<int>(p.hidden / VEC);
    size_t const base = static_cast<size_t>(row) * static_cast<size_t>(p.hidden);
    T* __restrict__ yr = static_cast<T*>(p.y) + base;
    size_t mbase = 0; // the modulation row's offset (AdaLN kinds)
    if constexpr (kIsAdaLN<K>)
    {
        uint32_t const div = static_cast<uint32_t>(p.mod_row_div);
        uint32_t mrow = div == 1 ? row : row / div;
        if constexpr (kModAxis<K>)
            mrow %= p.mod_rows; // rows < 2^31 here
        mbase = static_cast<size_t>(mrow) * static_cast<size_t>(p.hidden);
    }

    if constexpr (kHasResidual<K>)
    {
        T* __restrict__ sr = static_cast<T*>(p.sum) + base;
#pragma unroll
        for (int i = 0; i < VPT; ++i)
        {
            if (!vec_in_row(valid, tid, i, nthr, nvec))
                continue;
            int const off = (tid + i * nthr) * VEC;
            float a[VEC];
            if constexpr (kIsGated<K>)
            {
                float g[VEC];
                load_param<T, VEC>(static_cast<T const*>(p.gate) + mbase + off, g);
#pragma unroll
                for (int k = 0; k < VEC; ++k)
                    a[k] = get(rr.x[i], k) + g[k] * get(rr.r[i], k);
            }
            else
            {
#pragma unroll
                for (int k = 0; k < VEC; ++k)
                    a[k] = get(rr.x[i], k) + get(rr.r[i], k);
                if (p.res_bias != nullptr)
                {
                    float c[VEC];
                    load_param<T, VEC>(static_cast<T const*>(p.res_bias) + off, c);
#pragma unroll
                    for (int k = 0; k < VEC; ++k)
                        a[k] += c[k];
                }
            }
            set_all(rr.x[i], a);
            store_raw<T, VEC>(sr + off, rr.x[i]);
        }
    }

    float mean = 0.f;
    float rstd;
    if constexpr (kIsRms<K>)
    {
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < VPT; ++i)
#pragma unroll
            for (int k = 0; k < VEC; ++k)
            {
                float const a = get(rr.x[i], k);
                ss += a * a;
            }
        rstd = rsqrtf(reduce(ss, true) * p.inv_hidden + p.eps);
    }
    else
    {
        // This thread's moments, two-pass over its registers (padding vectors are zeros: they add
        // nothing to the sum and are skipped for M2).
        int nv = 0;
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < VPT; ++i)
        {
            nv += vec_in_row(valid, tid, i, nthr, nvec) ? 1 : 0;
#pragma unroll
            for (int k = 0; k < VEC; ++k)
                s += get(rr.x[i], k);
        }
        Moments m{static_cast<float>(nv * VEC), 0.f, 0.f};
        m.mean = nv > 0 ? __fdividef(s, m.n) : 0.f;
#pragma unroll
        for (int i = 0; i < VPT; ++i)
            launder(rr.x[i]);
#pragma unroll
        for (int i = 0; i < VPT; ++i)
        {
            if (vec_in_row(valid, tid, i, nthr, nvec))
            {
#pragma unroll
                for (int k = 0; k < VEC; ++k)
                {
                    float const d = get(rr.x[i], k) - m.mean;
                    m.m2 += d * d;
                }
            }
        }
        m = reduce(m, nvec == nthr * VPT); // every thread of the row holds VPT vectors of it
        mean = m.mean;
        rstd = rsqrtf(m.m2 * p.inv_hidden + p.eps);
    }

#pragma unroll
    for (int i = 0; i < VPT; ++i)
        launder(rr.x[i]);
#pragma unroll
    for (int i = 0; i < VPT; ++i)
    {
        if (!vec_in_row(valid, tid, i, nthr, nvec))
            continue;
        int const off = (tid + i * nthr) * VEC;
        float out[VEC];
        if constexpr (kIsRms<K>)
        {
            float g[VEC];
            aff.weight(p, i, off, g);
#pragma unroll
            for (int k = 0; k < VEC; ++k)
                out[k] = get(rr.x[i], k) * rstd * g[k];
        }
        else
        {
#pragma unroll
            for (int k = 0; k < VEC; ++k)
                out[k] = (get(rr.x[i], k) - mean) * rstd;
            if (p.weight != nullptr)
            {
                float g[VEC];
                aff.weight(p, i, off, g);
#pragma unroll
                for (int k = 0; k < VEC; ++k)
                    out[k] *= g[k];
            }
            if (p.bias != nullptr)
            {
                float c[VEC];
                aff.bias(p, i, off, c);
#pragma unroll
                for (int k = 0; k < VEC; ++k)
                    out[k] += c[k];
            }
            if constexpr (kIsAdaLN<K>)
            {
                float s1[VEC];
                float s0[VEC];
                load_param<T, VEC>(static_cast<T const*>(p.mod_scale) + mbase + off, s1);
                load_param<T, VEC>(static_cast<T const*>(p.shift) + mbase + off, s0);
#pragma unroll
                for (int k = 0; k < VEC; ++k)
                    out[k] = out[k] * (1.f + s1[k]) + s0[k];
            }
        }
        Pack<T, VEC> o;
        set_all(o, out);
        store_raw<T, VEC>(yr + off, o);
    }
}

// ---------------------------------------------------------------------------------------------
// Register budgets (docs/kernels.md "Kernel budgets"): the most registers per thread that keep the
// occupancy goal at the block sizes the dispatcher uses (sm_90: 65536 registers, 2048 threads per
// SM; registers are allocated per warp in units of 256, i.e. per thread in multiples of 8).
//   32: 2048 threads per SM (100 %) for any block size dividing 2048;
//   40: 1536 threads per SM (75 %) with blocks of <= 512 threads.
// One row of <= 2 vectors per thread: RMSNorm / LayerNorm / SkipRMSNorm 32, the AdaLN kinds 40.
// The group kernel's two rows per thread get 40, rows of 4 vectors (1024-thread blocks, where only 32 would give more than one block
// per SM) 64: those are held to the bytes-in-flight budget (>= 32 KB of loads issued before their
// first use per SM) instead of the occupancy one.
// ---------------------------------------------------------------------------------------------
// The budgets are set for sm_90; on earlier GPUs (sm_80 / 86 / 89) the float16 LayerNorm kernels of
// two vectors per thread and the AdaLN modulation-axis kernels need 8 more registers than sm_90's to
// compile without spills.
template <typename T, NormKind K, int VPT, bool TWO_ROWS>
constexpr int reg_budget()
{
#ifdef NORMEXPORT_REG_BUDGET_OVERRIDE // (to see what the compiler takes unconstrained: -D...=255)
    return NORMEXPORT_REG_BUDGET_OVERRIDE;
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    if constexpr (std::is_same_v<T, __half> && K == NormKind::kLayer && VPT == 2)
        return 40;
    // The modulation-axis kinds' modulo (row % B) spills 8 bytes there at sm_90's budgets (the fp16
    // group kernel of two vectors per lane, the fp32 gated block kernel of four).
    if constexpr (kModAxis<K>)
        return (VPT > 2 ? 64 : 40) + 8;
#endif
    if constexpr (VPT > 2)
        return 64;
    if constexpr (TWO_ROWS)
        return 40;
    return kIsAdaLN<K> ? 40 : 32;
}

// The group kernel's: NORMEXPORT_WARP_ROWS's rows of 8 vectors per lane hold 32 registers of x (64
// with the skip / update) and get 96 (128); the rest as reg_budget.
template <typename T, NormKind K, int VPT, bool TWO_ROWS>
constexpr int group_reg_budget()
{
    if constexpr (VPT > 4)
        return kHasResidual<K> ? 128 : 96;
    return reg_budget<T, K, VPT, TWO_ROWS>();
}

#if defined(__CUDA_ARCH__) || defined(__CUDACC__)
#define NORMEXPORT_MAXNREG(n) __maxnreg__(n)
#else
#define NORMEXPORT_MAXNREG(n)
#endif

// Rows each thread group of the group kernel holds at once: two rows of one vector per lane (twice
// the loads in flight), one row of two.
template <NormKind K, int VPT>
constexpr int kGroupRowsFor = VPT == 1 && (K == NormKind::kRms || K == NormKind::kLayer) ? 2 : 1;
constexpr int kGroupThreads = 128;

// LANES threads per row, kGroupRowsFor rows per thread group, 128 / LANES groups per block; a
// persistent grid-stride loop over sets of 128 / LANES * kGroupRowsFor rows.
template <typename T, NormKind K, int VEC, int VPT, int LANES>
__global__ void NORMEXPORT_MAXNREG((group_reg_budget<T, K, VPT, (kGroupRowsFor<K, VPT> > 1)>()))
    norm_group_kernel(NormParams p)
{
    constexpr int kGroupRows = kGroupRowsFor<K, VPT>;
    constexpr int kGroups = kGroupThreads / LANES;
    constexpr uint32_t kRowsPerBlock = kGroups * kGroupRows;
    int const group = threadIdx.x / LANES;
    int const tid = threadIdx.x % LANES;
    uint32_t const rows = static_cast<uint32_t>(p.rows);
    // (rows of two vectors per lane: the general merge only, one code path within the budget)
    auto reduce = [](auto v, bool equal) { return group_reduce<LANES>(v, VPT == 1 && equal); };
    constexpr bool kHoist = VPT == 1; // two vectors of weight and bias would not fit the budget
    Affine<T, K, VEC, VPT, kHoist> aff{};
    aff.load(p, tid, LANES);
    for (uint32_t base = blockIdx.x * kRowsPerBlock; base < rows; base += gridDim.x * kRowsPerBlock)
    {
        // row j of this group: base + j * kGroups + group (a warp's groups read adjacent rows)
        RowRegs<T, K, VEC, VPT> rr[kGroupRows];
#pragma unroll
        for (int j = 0; j < kGroupRows; ++j)
        {
            uint32_t const row = base + j * kGroups + group;
            load_row<T, K, VEC, VPT>(p, row < rows ? row : 0, row < rows, fresh(tid), LANES, rr[j]);
        }
#pragma unroll
        for (int j = 0; j < kGroupRows; ++j)
        {
            // row j's work starts after row j - 1's (not interleaved with it: that would need
            // both rows' statistics and parameters in registers at once)
#pragma unroll
            for (int i = 0; i < VPT; ++i)
            {
                launder(rr[j].x[i]);
                if constexpr (kHasResidual<K>)
                    launder(rr[j].r[i]);
            }
            uint32_t const row = base + j * kGroups + group;
            finish_row<T, K, VEC, VPT, kHoist>(
                p, row < rows ? row : 0, row < rows, fresh(tid), LANES, rr[j], aff, reduce);
        }
    }
}

// One row per block at a time (blockDim.x a multiple of 32, <= 1024), grid-stride loop over rows.
template <typename T, NormKind K, int VEC, int VPT>
__global__ void NORMEXPORT_MAXNREG((reg_budget<T, K, VPT, false>()))
    norm_block_kernel(NormParams p)
{
    using Value = std::conditional_t<kIsRms<K>, float, Moments>;
    __shared__ float red[2 * kReduceWords<Value>];
    int const tid = threadIdx.x;
    int const nthr = blockDim.x;
    uint32_t const rows = static_cast<uint32_t>(p.rows);
    int parity = 0;
    auto const reduce = alternating_reduce<Value>(red, parity);
    Affine<T, K, VEC, VPT, false> const aff{};
    // block_rows consecutive rows per block; rows < 2^31 and gridDim.x * block_rows < rows + block_rows
    uint32_t const per = p.block_rows;
    uint32_t left = per;
    for (uint32_t row = blockIdx.x * per; row < rows;)
    {
        RowRegs<T, K, VEC, VPT> cur;
        load_row<T, K, VEC, VPT>(p, row, true, fresh(tid), nthr, cur);
        finish_row<T, K, VEC, VPT, false>(p, row, true, fresh(tid), nthr, cur, aff, reduce);
        if (--left == 0)
        {
            row += (gridDim.x - 1) * per + 1; // this block's next set of rows
            left = per;
        }
        else
            ++row;
    }
}

#if NORMEXPORT_ASYNC_ROWS
// -- NORMEXPORT_ASYNC_ROWS: rows staged through shared memory by cp.async (sm_80+) ---------------
#if !defined(NORMEXPORT_EMU_DYNAMIC_SMEM)
// The launch's dynamic shared memory (the CPU emulation brings its own).
__device__ __forceinline__ uint4* dynamic_smem()
{
    extern __shared__ uint4 normexport_dynamic_smem[];
    return normexport_dynamic_smem;
}
#endif

// 16 bytes from global to shared memory without passing through registers; the copy lands at the
// latest when this thread waits for its group (async_wait).
__device__ __forceinline__ void async_copy16(uint4* smem, void const* gmem)
{
#if defined(__CUDA_ARCH__)
    unsigned const s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
#else
    memcpy(smem, gmem, 16);
#endif
}
__device__ __forceinline__ void async_commit()
{
#if defined(__CUDA_ARCH__)
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void async_wait()
{
#if defined(__CUDA_ARCH__)
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Shared memory the async block kernel takes: two row buffers of x (and the skip / update) of
// VPT 16-byte vectors per thread.
template <NormKind K, int VPT>
constexpr size_t async_smem_bytes(int threads)
{
    return size_t{2} * (kHasResidual<K> ? 2 : 1) * VPT * static_cast<size_t>(threads) * 16;
}

// norm_block_kernel with the rows staged through shared memory: block_rows consecutive rows per
// block (then the grid-stride jump), the copy of the next row issued before this row is read back
// and normalised. Slot (buffer, source, vector i, thread): consecutive threads' 16-byte slots are
// adjacent (no bank conflicts), and each thread reads only the slots it copied itself.
// Registers: reg_budget's, but fp16 LayerNorm spills 24 bytes at sm_90's 32 here: 40, as before sm_90.
template <typename T, NormKind K, int VPT>
constexpr int async_reg_budget()
{
    return std::is_same_v<T, __half> && K == NormKind::kLayer ? 40 : reg_budget<T, K, VPT, false>();
}

template <typename T, NormKind K, int VEC, int VPT>
__global__ void NORMEXPORT_MAXNREG((async_reg_budget<T, K, VPT>())) norm_block_async_kernel(NormParams p)
{
    static_assert(Pack<T, VEC>::kBytes == 16, "16-byte vectors only");
    using Value = std::conditional_t<kIsRms<K>, float, Moments>;
    constexpr int kSrc = kHasResidual<K> ? 2 : 1;
    __shared__ float red[2 * kReduceWords<Value>];
    uint4* const stage = dynamic_smem();
    int const tid = threadIdx.x;
    int const nthr = blockDim.x;
    int const nvec = static_cast<int>(p.hidden / VEC);
    uint32_t const rows = static_cast<uint32_t>(p.rows);
    int parity = 0;
    auto const reduce = alternating_reduce<Value>(red, parity);
    auto slot = [&](int buf, int src, int i) { return stage + ((buf * kSrc + src) * VPT + i) * nthr + tid; };
    auto issue = [&](uint32_t row, int buf) {
        size_t const base = static_cast<size_t>(row) * static_cast<size_t>(p.hidden);
#pragma unroll
        for (int i = 0; i < VPT; ++i)
        {
            if (!vec_in_row(true, tid, i, nthr, nvec))
                continue;
            size_t const off = base + static_cast<size_t>((tid + i * nthr) * VEC);
            async_copy16(slot(buf, 0, i), static_cast<T const*>(p.x) + off);
            if constexpr (kHasResidual<K>)
                async_copy16(slot(buf, 1, i), static_cast<T const*>(p.residual) + off);
        }
        async_commit();
    };
    Affine<T, K, VEC, VPT, false> const aff{};
    uint32_t const per = p.block_rows;
    // this block's rows: sets of `per` consecutive rows, gridDim.x * per apart
    auto advance = [&](uint32_t row, uint32_t& left) {
        if (--left == 0)
        {
            left = per;
            return row + (gridDim.x - 1) * per + 1;
        }
        return row + 1;
    };
    uint32_t row = blockIdx.x * per;
    uint32_t left = per;
    if (row < rows)
        issue(row, 0);
    for (int buf = 0; row < rows; buf ^= 1)
    {
        uint32_t next_left = left;
        uint32_t const next = advance(row, next_left);
        if (next < rows)
        {
            issue(next, buf ^ 1);
            async_wait<1>();
        }
        else
            async_wait<0>();
        RowRegs<T, K, VEC, VPT> cur;
#pragma unroll
        for (int i = 0; i < VPT; ++i)
        {
            bool const in = vec_in_row(true, tid, i, nthr, nvec);
            uint4 const a = in ? *slot(buf, 0, i) : make_uint4(0u, 0u, 0u, 0u);
            cur.x[i].w[0] = a.x;
            cur.x[i].w[1] = a.y;
            cur.x[i].w[2] = a.z;
            cur.x[i].w[3] = a.w;
            if constexpr (kHasResidual<K>)
            {
                uint4 const b = in ? *slot(buf, 1, i) : make_uint4(0u, 0u, 0u, 0u);
                cur.r[i].w[0] = b.x;
                cur.r[i].w[1] = b.y;
                cur.r[i].w[2] = b.z;
                cur.r[i].w[3] = b.w;
            }
        }
        finish_row<T, K, VEC, VPT, false>(p, row, true, fresh(tid), nthr, cur, aff, reduce);
        row = next;
        left = next_left;
    }
}
#endif // NORMEXPORT_ASYNC_ROWS

// Any hidden size: one row per block, statistics in separate passes over global memory
// (mean, then sum of squared deviations, then output), scalar accesses. The fused kinds write the
// sum in the first pass and read it back (each thread its own elements) in the later ones.
template <typename T, NormKind K>
__global__ void __launch_bounds__(512) norm_looped_kernel(NormParams p)
{
    __shared__ float smem[32];
    float const inv_h = p.inv_hidden;
    T const* __restrict__ w = static_cast<T const*>(p.weight);
    T const* __restrict__ b = static_cast<T const*>(p.bias);
    for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x)
    {
        int64_t const base = row * p.hidden;
        T* yr = static_cast<T*>(p.y) + base;
        int64_t mrow = 0;
        if constexpr (kIsAdaLN<K>)
            mrow = mod_row(row, p.mod_row_div);
        if constexpr (kModAxis<K>)
            mrow %= p.mod_rows;
        // The row the statistics are taken over: x, or the sum written by the first pass.
        T const* xr = static_cast<T const*>(p.x) + base;
        float first = 0.f; // pass-1 partial: sum of squares (RMS) or sum (LayerNorm)
        if constexpr (kHasResidual<K>)
        {
            T const* rr = static_cast<T const*>(p.residual) + base;
            T* sr = static_cast<T*>(p.sum) + base;
            T const* gr = nullptr;
            if constexpr (kIsGated<K>)
                gr = static_cast<T const*>(p.gate) + mrow * p.hidden;
            T const* rb = static_cast<T const*>(p.res_bias);
            for (int64_t j = threadIdx.x; j < p.hidden; j += blockDim.x)
            {
                float a;
                if constexpr (kIsGated<K>)
                    a = to_float(xr[j]) + to_float(gr[j]) * to_float(rr[j]);
                else
                    a = to_float(xr[j]) + to_float(rr[j]) + (rb != nullptr ? to_float(rb[j]) : 0.f);
                T const t = from_float<T>(a);
                sr[j] = t;
                a = to_float(t);
                first += kIsRms<K> ? a * a : a;
            }
            xr = sr;
        }
        else
        {
            for (int64_t j = threadIdx.x; j < p.hidden; j += blockDim.x)
            {
                float const a = to_float(xr[j]);
                first += kIsRms<K> ? a * a : a;
            }
        }
        float mean = 0.f;
        float rstd;
        if constexpr (kIsRms<K>)
        {
            rstd = rsqrtf(block_sum(first, smem) * inv_h + p.eps);
        }
        else
        {
            mean = block_sum(first, smem) * inv_h;
            float sq = 0.f;
            for (int64_t j = threadIdx.x; j < p.hidden; j += blockDim.x)
            {
                float const d = to_float(xr[j]) - mean;
                sq += d * d;
            }
            rstd = rsqrtf(block_sum(sq, smem) * inv_h + p.eps);
        }
        T const* sh = nullptr;
        T const* sc = nullptr;
        if constexpr (kIsAdaLN<K>)
        {
            sh = static_cast<T const*>(p.shift) + mrow * p.hidden;
            sc = static_cast<T const*>(p.mod_scale) + mrow * p.hidden;
        }
        for (int64_t j = threadIdx.x; j < p.hidden; j += blockDim.x)
        {
            float o;
            if constexpr (kIsRms<K>)
            {
                o = to_float(xr[j]) * rstd * to_float(w[j]);
            }
            else
            {
                o = (to_float(xr[j]) - mean) * rstd;
                if (w != nullptr)
                    o *= to_float(w[j]);
                if (b != nullptr)
                    o += to_float(b[j]);
                if constexpr (kIsAdaLN<K>)
                    o = o * (1.f + to_float(sc[j])) + to_float(sh[j]);
            }
            yr[j] = from_float<T>(o);
        }
    }
}


// ---------------------------------------------------------------------------------------------
// Host-side dispatch
// ---------------------------------------------------------------------------------------------
constexpr int64_t kMaxGrid = int64_t{1} << 30;
// Rows from here on go to the looped kernel (the row kernels index rows in 32 bits).
constexpr int64_t kMaxRowKernelRows = int64_t{1} << 31;

inline unsigned grid_for(int64_t units)
{
    return static_cast<unsigned>(units < kMaxGrid ? (units > 0 ? units : 1) : kMaxGrid);
}

inline bool aligned16(void const* ptr)
{
    return ptr == nullptr || (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0;
}

// The launch the dispatcher picks for a call (also reported through normexport_launch_config, so
// that tests/test_kernel_budgets.py checks the budgets at exactly these block sizes).
inline normexport_launch_config choose_config(
    NormKind kind, int elem_size, int64_t rows, int64_t hidden, bool all_aligned)
{
    normexport_launch_config c{};
    c.kernel = NORMEXPORT_KERNEL_LOOPED;
    c.vec = 1;
    c.threads = 512;
    if (rows >= kMaxRowKernelRows || hidden > INT32_MAX)
        return c;
    int const full_vec = 16 / elem_size;
    bool const vec_ok = all_aligned && hidden % full_vec == 0;
    int const vec = vec_ok ? full_vec : 1;
    int64_t const nvec = hidden / vec;
    c.vec = vec;
    auto group = [&](int lanes, int vpt) {
        c.kernel = NORMEXPORT_KERNEL_GROUP;
        c.lanes = lanes;
        c.vectors_per_thread = vpt;
        c.threads = kGroupThreads;
        c.rows_per_group = vpt == 1 && (kind == NormKind::kRms || kind == NormKind::kLayer) ? 2 : 1;
    };
    auto block = [&](int vpt) {
        c.kernel = NORMEXPORT_KERNEL_BLOCK;
        c.vectors_per_thread = vpt;
        c.threads = static_cast<int>((nvec + vpt - 1) / vpt + 31) / 32 * 32;
    };
    bool const fused = kind == NormKind::kSkipRms || kind == NormKind::kGatedAdaLN;
    bool const adaln = kind == NormKind::kAdaLN || kind == NormKind::kGatedAdaLN;
    if (nvec <= 8)
        group(8, 1);
    else if (nvec <= 16)
        group(16, 1);
    else if (nvec <= 32)
        group(32, 1);
    else if (nvec <= 64)
        group(32, 2);
    else if (NORMEXPORT_WARP_ROWS > 0 && vec_ok && nvec <= NORMEXPORT_WARP_ROWS)
        group(32, nvec <= 128 ? 4 : 8); // a warp per row (variant)
    else if (nvec <= (adaln ? NORMEXPORT_ADALN_VPT2_MAX_VECS : NORMEXPORT_VPT2_MAX_VECS))
        // two vectors per thread in blocks of up to 1024 threads (the AdaLN kinds: 512; at 1024
        // threads their 40 registers would leave one block, 50 %, per SM: 4 vectors instead)
        block(2);
    else if (nvec <= 4 * 1024)
        block(4);
    else if (vec == 1 && !fused && nvec <= 8 * 1024)
        block(8);
    else
        c.vec = 1; // looped
    return c;
}

// Blocks of `kernel` at `threads` threads that are resident on the current GPU at once (the
// persistent grid's size), cached per thread; kMaxGrid when the runtime cannot say.
template <typename Kernel>
inline int64_t resident_blocks(Kernel kernel, int threads)
{
    struct Entry
    {
        void const* fn;
        int threads;
        int device;
        int64_t blocks;
    };
    thread_local Entry cache[32] = {};
    thread_local int next = 0;
    void const* fn = reinterpret_cast<void const*>(kernel);
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess)
    {
        cudaGetLastError();
        return kMaxGrid;
    }
    for (Entry const& e : cache)
        if (e.fn == fn && e.threads == threads && e.device == dev)
            return e.blocks;
    int sms = 0;
    int per_sm = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess
        || cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, 0) != cudaSuccess || sms < 1
        || per_sm < 1)
    {
        cudaGetLastError();
        return kMaxGrid;
    }
    int64_t const blocks = int64_t{sms} * per_sm;
    cache[next] = Entry{fn, threads, dev, blocks};
    next = (next + 1) % 32;
    return blocks;
}

template <typename Kernel>
inline void launch_persistent(
    Kernel kernel, int64_t units, int threads, NormParams const& p, cudaStream_t stream, size_t smem = 0)
{
    int64_t const resident = NORMEXPORT_PERSISTENT ? resident_blocks(kernel, threads) : kMaxGrid;
    kernel<<<grid_for(units < resident ? units : resident), static_cast<unsigned>(threads), smem, stream>>>(p);
}

template <typename T, NormKind K, int VEC, int VPT, int LANES>
inline void launch_group(NormParams const& p, cudaStream_t stream)
{
    constexpr int64_t kRowsPerBlock = kGroupThreads / LANES * kGroupRowsFor<K, VPT>;
    launch_persistent(norm_group_kernel<T, K, VEC, VPT, LANES>, (p.rows + kRowsPerBlock - 1) / kRowsPerBlock,
        kGroupThreads, p, stream);
}

template <typename T, NormKind K, int VEC, int VPT>
inline void launch_block(NormParams p, int threads, cudaStream_t stream)
{
#if NORMEXPORT_ASYNC_ROWS
    if constexpr (VPT == 2 && Pack<T, VEC>::kBytes == 16)
    {
        p.block_rows = NORMEXPORT_ASYNC_ROWS;
        auto kernel = norm_block_async_kernel<T, K, VEC, VPT>;
        size_t const smem = async_smem_bytes<K, VPT>(threads);
        if (smem > 48 * 1024)
        {
            // once per kernel and device (the largest a launch can ask for), not inside every launch: a
            // call during a CUDA graph capture need not be allowed
            static std::atomic<uint64_t> set_on{0};
            int dev = 0;
            if (cudaGetDevice(&dev) == cudaSuccess && (dev >= 64 || !(set_on.load() >> dev & 1u)))
            {
                int const most = static_cast<int>(async_smem_bytes<K, VPT>(1024)); // the largest block
                cudaError_t const e = cudaFuncSetAttribute(
                    reinterpret_cast<void const*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize, most);
                if (e == cudaSuccess && dev < 64)
                    set_on.fetch_or(uint64_t{1} << dev);
            }
        }
        launch_persistent(kernel, (p.rows + p.block_rows - 1) / p.block_rows, threads, p, stream, smem);
        return;
    }
#endif
    p.block_rows = kIsAdaLN<K> && p.mod_row_div > 1 ? NORMEXPORT_ADALN_ROWS : NORMEXPORT_BLOCK_ROWS;
    launch_persistent(norm_block_kernel<T, K, VEC, VPT>, (p.rows + p.block_rows - 1) / p.block_rows, threads, p,
        stream);
}

// Launch the row kernel of config `c` (vector width VEC); false for the looped kernel.
template <typename T, NormKind K, int VEC>
inline bool launch_rows(NormParams const& p, normexport_launch_config const& c, cudaStream_t stream)
{
    if (c.kernel == NORMEXPORT_KERNEL_GROUP)
    {
        if (c.lanes == 8)
            launch_group<T, K, VEC, 1, 8>(p, stream);
        else if (c.lanes == 16)
            launch_group<T, K, VEC, 1, 16>(p, stream);
        else if (c.vectors_per_thread == 1)
            launch_group<T, K, VEC, 1, 32>(p, stream);
        else if (c.vectors_per_thread == 2)
            launch_group<T, K, VEC, 2, 32>(p, stream);
#if NORMEXPORT_WARP_ROWS
        else if constexpr (VEC > 1) // (the dispatcher gives a warp per row to 16-byte vectors only)
        {
            if (c.vectors_per_thread == 4)
                launch_group<T, K, VEC, 4, 32>(p, stream);
            else
                launch_group<T, K, VEC, 8, 32>(p, stream);
        }
#endif
        else
            return false;
        return true;
    }
    if (c.kernel != NORMEXPORT_KERNEL_BLOCK)
        return false;
    if (c.vectors_per_thread == 2)
        launch_block<T, K, VEC, 2>(p, c.threads, stream);
    else if (c.vectors_per_thread == 4)
        launch_block<T, K, VEC, 4>(p, c.threads, stream);
    else if constexpr (VEC == 1 && !kHasResidual<K>)
        launch_block<T, K, VEC, 8>(p, c.threads, stream);
    else
        return false;
    return true;
}

inline bool all_aligned(NormParams const& p)
{
    return aligned16(p.x) && aligned16(p.y) && aligned16(p.weight) && aligned16(p.bias) && aligned16(p.shift)
        && aligned16(p.mod_scale) && aligned16(p.residual) && aligned16(p.res_bias) && aligned16(p.gate)
        && aligned16(p.sum);
}

template <typename T, NormKind K>
inline cudaError_t launch_norm(NormParams p, cudaStream_t stream)
{
    if (p.rows == 0)
        return cudaSuccess;
    p.inv_hidden = static_cast<float>(1.0 / static_cast<double>(p.hidden));
    constexpr int kVec = 16 / static_cast<int>(sizeof(T));
    normexport_launch_config const c = choose_config(base_kind(K), sizeof(T), p.rows, p.hidden, all_aligned(p));
    bool const launched
        = c.vec == kVec ? launch_rows<T, K, kVec>(p, c, stream) : launch_rows<T, K, 1>(p, c, stream);
    if (!launched)
        norm_looped_kernel<T, K><<<grid_for(p.rows), 512, 0, stream>>>(p);
    return cudaGetLastError();
}

template <NormKind K>
inline cudaError_t launch_norm_dtype(NormParams const& p, int dtype, cudaStream_t stream)
{
    switch (dtype)
    {
    case NORMEXPORT_FLOAT32: return launch_norm<float, K>(p, stream);
    case NORMEXPORT_FLOAT16: return launch_norm<__half, K>(p, stream);
    case NORMEXPORT_BFLOAT16: return launch_norm<__nv_bfloat16, K>(p, stream);
    default: return cudaErrorInvalidValue;
    }
}

inline bool valid_common(void const* x, void const* y, int64_t rows, int64_t hidden, int dtype, float eps)
{
    if (dtype < NORMEXPORT_FLOAT32 || dtype > NORMEXPORT_BFLOAT16)
        return false;
    if (hidden < 1 || hidden > INT32_MAX || rows < 0)
        return false;
    if (!(eps >= 0.f)) // rejects NaN too
        return false;
    if (rows > 0 && (x == nullptr || y == nullptr))
        return false;
    return true;
}

// The AdaLN kinds' rows: x is [batch, seq, hidden] (seq: the product of the middle dims) and the
// modulation tensors are [batch, hidden] (mod_full 0: one row per batch, shared by its seq rows)
// or of x's shape (mod_full 1). Sets p.rows and p.mod_row_div; false when the sizes are invalid.
inline bool adaln_rows(int64_t batch, int64_t seq, int mod_full, NormParams& p)
{
    if (batch < 0 || seq < 0 || (mod_full != 0 && mod_full != 1))
        return false;
    if (seq > 0 && batch > INT64_MAX / seq)
        return false;
    p.rows = batch * seq;
    p.mod_row_div = mod_full ? 1 : (seq > 0 ? seq : 1);
    return true;
}

// The AdaLN kinds' rows when the [batch, hidden] modulation follows a dim of x other than the first:
// x is [outer, batch, inner, hidden] (outer: the product of x's dims before the modulation axis,
// inner: of those after it, before the last), row r takes modulation row (r / inner) % batch. Sets
// p.rows, p.mod_row_div and p.mod_rows; false when the sizes are invalid. Returns in `mod_axis`
// whether the *ModAxis kind is needed: with outer 1 the modulation row is r / inner and with batch 1
// it is 0, which the default kinds compute (p then set for them).
inline bool adaln_rows_axis(int64_t outer, int64_t batch, int64_t inner, NormParams& p, bool& mod_axis)
{
    if (outer < 0 || batch < 0 || inner < 0 || batch > UINT32_MAX)
        return false;
    if (inner > 0 && batch > INT64_MAX / inner)
        return false;
    int64_t const per_outer = batch * inner;
    if (per_outer > 0 && outer > INT64_MAX / per_outer)
        return false;
    p.rows = outer * per_outer;
    mod_axis = outer > 1 && batch > 1;
    if (batch == 1 && outer > 1)
        p.mod_row_div = p.rows > 0 ? p.rows : 1; // every row takes modulation row 0
    else
        p.mod_row_div = inner > 0 ? inner : 1;
    p.mod_rows = static_cast<uint32_t>(batch > 0 ? batch : 1);
    return true;
}

} // namespace normexport
