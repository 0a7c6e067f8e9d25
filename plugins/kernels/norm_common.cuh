// Shared implementation of the normexport row-normalisation kernels (internal header).
//
// Three row-register kernels and one fallback, all templated on the IO type T and the op:
//   - norm_group_kernel: LANES threads (8..32, i.e. at most one warp) per row, several rows per
//     128-thread block; used for short rows.
//   - norm_block_kernel: one row per block of up to 1024 threads (blockDim chosen at launch so that
//     each thread holds VPT = 2 vectors of the row up to hidden 16384 in half precision, 8192 in
//     float32: 64..1024 threads per row, RMSNorm at <= 32 registers so 2048 threads and as many
//     16-byte loads in flight per SM; 8 vectors in blocks of <= 512 threads beyond that).
//   - norm_looped_kernel: one row per block, any hidden size, several passes over global memory.
// The row kernels keep the whole row in registers as packed IO values (VPT vectors of VEC elements
// per thread: a bf16/fp16 vector of 8 is 4 registers, half of what float32 copies would take),
// loops fully unrolled so no register array is indexed dynamically; they compute the mean first
// and then the sum of squared deviations from those registers (two-pass, numerically stable) and
// write y once. VEC = 16 / sizeof(T) gives 128-bit global loads/stores; VEC = 1 is the generic
// scalar path. __launch_bounds__ caps the registers (min_blocks_for).
//
// The fused residual kinds (kSkipRms, kGatedAdaLN) first form the row sum
//   Sum = X + skip [+ bias]        (SkipRMSNorm)
//   Sum = X + gate * update        (GatedAdaLNZero)
// in float32, round it to T, store it (the next residual) and normalise that stored value, so the
// fused op equals the unfused Add + norm of the same dtype (DESIGN §2).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <string.h>

#include "normexport_kernels.h"

namespace normexport
{

enum class NormKind
{
    kRms,        // y = x * rstd * scale
    kLayer,      // y = (x - mean) * rstd [* weight] [+ bias]
    kAdaLN,      // y = ((x - mean) * rstd [* weight] [+ bias]) * (1 + mod_scale) + shift
    kSkipRms,    // s = x + residual [+ res_bias]; y = s * rstd(s) * scale
    kGatedAdaLN, // s = x + gate * residual; y = AdaLN(s)
};

template <NormKind K>
constexpr bool kIsRms = K == NormKind::kRms || K == NormKind::kSkipRms;
template <NormKind K>
constexpr bool kIsAdaLN = K == NormKind::kAdaLN || K == NormKind::kGatedAdaLN;
template <NormKind K>
constexpr bool kHasResidual = K == NormKind::kSkipRms || K == NormKind::kGatedAdaLN;

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
    float eps;
    float inv_hidden;      // 1 / hidden, computed on the host (a device fp32 division is a call)
};

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

// N elements of T, aligned to their full size so a 16-byte pack is one 128-bit access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack
{
    T v[N];
};

// One pack from p (aligned to its size): a 16-byte pack as one 128-bit access, through the
// non-coherent read-only path when READ_ONLY (parameters re-read by many rows).
template <typename T, int N, bool READ_ONLY>
__device__ __forceinline__ void load_into(T const* p, Pack<T, N>& pk)
{
    if constexpr (sizeof(Pack<T, N>) == 16)
    {
        uint4 raw;
        if constexpr (READ_ONLY)
            raw = __ldg(reinterpret_cast<uint4 const*>(p));
        else
            raw = *reinterpret_cast<uint4 const*>(p);
        memcpy(&pk, &raw, sizeof(raw));
    }
    else
    {
        pk = *reinterpret_cast<Pack<T, N> const*>(p);
    }
}

// Load / store one pack as raw IO values (16-byte packs as one 128-bit access).
template <typename T, int N, bool READ_ONLY>
__device__ __forceinline__ Pack<T, N> load_raw(T const* p)
{
    Pack<T, N> pk;
    load_into<T, N, READ_ONLY>(p, pk);
    return pk;
}

template <typename T, int N>
__device__ __forceinline__ void store_raw(T* p, Pack<T, N> const& pk)
{
    if constexpr (sizeof(Pack<T, N>) == 16)
    {
        uint4 raw;
        memcpy(&raw, &pk, sizeof(raw));
        *reinterpret_cast<uint4*>(p) = raw;
    }
    else
    {
        *reinterpret_cast<Pack<T, N>*>(p) = pk;
    }
}

// Load N elements starting at p as float (p must be aligned to sizeof(T) * N).
template <typename T, int N, bool READ_ONLY>
__device__ __forceinline__ void load_pack(T const* p, float (&out)[N])
{
    Pack<T, N> pk;
    load_into<T, N, READ_ONLY>(p, pk);
#pragma unroll
    for (int k = 0; k < N; ++k)
        out[k] = to_float(pk.v[k]);
}

// Store N floats at p, rounded to T (p aligned as for load_pack).
template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, float const (&in)[N])
{
    Pack<T, N> pk;
#pragma unroll
    for (int k = 0; k < N; ++k)
        pk.v[k] = from_float<T>(in[k]);
    store_raw<T, N>(p, pk);
}

// ---------------------------------------------------------------------------------------------
// Reductions
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

// Sum over the whole block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
// smem holds 32 floats; the trailing barrier makes it reusable by the next call.
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

// Row of the modulation tensors for row `row` of x. 32-bit division when it fits (inline
// instructions) instead of the 64-bit division subroutine.
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
// `valid` is false for padding rows of the last block: those threads still take part in the
// reductions but neither load nor store.
// ---------------------------------------------------------------------------------------------
template <typename T, NormKind K, int VEC, int VPT, typename ReduceFn>
__device__ __forceinline__ void norm_row(NormParams const& p, int64_t row, bool valid, int tid, int nthr,
    ReduceFn reduce)
{
    // In-row indices fit in 32 bits (hidden <= INT32_MAX); only the row base is 64-bit.
    int const nvec = static_cast<int>(p.hidden / VEC);
    int64_t const base = row * p.hidden;
    T const* __restrict__ xr = static_cast<T const*>(p.x) + base;
    T* __restrict__ yr = static_cast<T*>(p.y) + base;
    float const inv_h = p.inv_hidden;

    // Whether vector i of this thread is inside the row; recomputed rather than kept in a bool
    // array (there are only 7 predicate registers, and bools would cost general registers).
    auto in_row = [=](int i) { return valid && tid + i * nthr < nvec; };

    // The row, as packed IO values. Every load of the row is issued before any arithmetic.
    Pack<T, VEC> v[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i)
    {
        int const vi = tid + i * nthr;
        if (in_row(i))
        {
            v[i] = load_raw<T, VEC, false>(xr + vi * VEC);
        }
        else
        {
#pragma unroll
            for (int k = 0; k < VEC; ++k)
                v[i].v[k] = from_float<T>(0.f);
        }
    }

    if constexpr (kHasResidual<K>)
    {
        T const* __restrict__ rr = static_cast<T const*>(p.residual) + base;
        T* __restrict__ sr = static_cast<T*>(p.sum) + base;
        T const* __restrict__ gr = nullptr;
        if constexpr (K == NormKind::kGatedAdaLN)
            gr = static_cast<T const*>(p.gate) + mod_row(row, p.mod_row_div) * p.hidden;
#pragma unroll
        for (int i = 0; i < VPT; ++i)
        {
            if (!in_row(i))
                continue;
            int const off = (tid + i * nthr) * VEC;
            Pack<T, VEC> const r = load_raw<T, VEC, false>(rr + off);
            float a[VEC];
            if constexpr (K == NormKind::kGatedAdaLN)
            {
                float g[VEC];
                load_pack<T, VEC, true>(gr + off, g);
#pragma unroll
                for (int k = 0; k < VEC; ++k)
                    a[k] = to_float(v[i].v[k]) + g[k] * to_float(r.v[k]);
            }
            else
            {
#pragma unroll
                for (int k = 0; k < VEC; ++k)
                    a[k] = to_float(v[i].v[k]) + to_float(r.v[k]);
                if (p.res_bias != nullptr)
                {
                    float c[VEC];
                    load_pack<T, VEC, true>(static_cast<T const*>(p.res_bias) + off, c);
#pragma unroll
                    for (int k = 0; k < VEC; ++k)
                        a[k] += c[k];
                }
            }
#pragma unroll
            for (int k = 0; k < VEC; ++k)
                v[i].v[k] = from_float<T>(a[k]);
            store_raw<T, VEC>(sr + off, v[i]);
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
                float const a = to_float(v[i].v[k]);
                ss += a * a;
            }
        ss = reduce(ss);
        rstd = rsqrtf(ss * inv_h + p.eps);
    }
    else
    {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < VPT; ++i)
#pragma unroll
            for (int k = 0; k < VEC; ++k)
                s += to_float(v[i].v[k]);
        mean = reduce(s) * inv_h;
        float sq = 0.f;
#pragma unroll
        for (int i = 0; i < VPT; ++i)
        {
            if (in_row(i))
            {
#pragma unroll
                for (int k = 0; k < VEC; ++k)
                {
                    float const d = to_float(v[i].v[k]) - mean;
                    sq += d * d;
                }
            }
        }
        rstd = rsqrtf(reduce(sq) * inv_h + p.eps);
    }

    T const* __restrict__ w = static_cast<T const*>(p.weight);
    T const* __restrict__ b = static_cast<T const*>(p.bias);
    T const* __restrict__ sh = nullptr;
    T const* __restrict__ sc = nullptr;
    if constexpr (kIsAdaLN<K>)
    {
        int64_t const mrow = mod_row(row, p.mod_row_div);
        sh = static_cast<T const*>(p.shift) + mrow * p.hidden;
        sc = static_cast<T const*>(p.mod_scale) + mrow * p.hidden;
    }

#pragma unroll
    for (int i = 0; i < VPT; ++i)
    {
        if (!in_row(i))
            continue;
        int const off = (tid + i * nthr) * VEC;
        float out[VEC];
        if constexpr (kIsRms<K>)
        {
            float g[VEC];
            load_pack<T, VEC, true>(w + off, g);
#pragma unroll
            for (int k = 0; k < VEC; ++k)
                out[k] = to_float(v[i].v[k]) * rstd * g[k];
        }
        else
        {
#pragma unroll
            for (int k = 0; k < VEC; ++k)
                out[k] = (to_float(v[i].v[k]) - mean) * rstd;
            if (w != nullptr)
            {
                float g[VEC];
                load_pack<T, VEC, true>(w + off, g);
#pragma unroll
                for (int k = 0; k < VEC; ++k)
                    out[k] *= g[k];
            }
            if (b != nullptr)
            {
                float c[VEC];
                load_pack<T, VEC, true>(b + off, c);
#pragma unroll
                for (int k = 0; k < VEC; ++k)
                    out[k] += c[k];
            }
            if constexpr (kIsAdaLN<K>)
            {
                float s1[VEC];
                float s0[VEC];
                load_pack<T, VEC, true>(sc + off, s1);
                load_pack<T, VEC, true>(sh + off, s0);
#pragma unroll
                for (int k = 0; k < VEC; ++k)
                    out[k] = out[k] * (1.f + s1[k]) + s0[k];
            }
        }
        store_pack<T, VEC>(yr + off, out);
    }
}

// Threads and registers of the row kernels (__launch_bounds__). Up to 2 vectors per thread: blocks
// of up to 1024 threads, RMSNorm at <= 32 registers (2048 threads per SM), the other ops at <= 64
// of which the compiler takes what it needs. More (rows beyond 2048 vectors): blocks of up to 512
// threads with 8 vectors each and up to 128 registers (no spills; such rows are rare).
template <int VPT>
constexpr int max_threads_for()
{
    return VPT <= 2 ? 1024 : 512;
}
template <NormKind K, int VPT>
constexpr int min_blocks_for(int threads)
{
    return VPT <= 2 ? (K == NormKind::kRms ? 2048 : 1024) / threads : 1;
}

// LANES threads per row, 128 / LANES rows per 128-thread block.
template <typename T, NormKind K, int VEC, int VPT, int LANES>
__global__ void __launch_bounds__(128, min_blocks_for<K, VPT>(128)) norm_group_kernel(NormParams p)
{
    constexpr int kRowsPerBlock = 128 / LANES;
    int const group = threadIdx.x / LANES;
    int const tid = threadIdx.x % LANES;
    auto reduce = [](float v) { return group_sum<LANES>(v); };
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; base < p.rows;
         base += static_cast<int64_t>(gridDim.x) * kRowsPerBlock)
    {
        int64_t const row = base + group;
        norm_row<T, K, VEC, VPT>(p, row < p.rows ? row : 0, row < p.rows, tid, LANES, reduce);
    }
}

// One row per block of blockDim.x threads (multiple of 32, <= max_threads_for<VPT>()).
template <typename T, NormKind K, int VEC, int VPT>
__global__ void __launch_bounds__(max_threads_for<VPT>(), min_blocks_for<K, VPT>(max_threads_for<VPT>())) norm_block_kernel(NormParams p)
{
    __shared__ float smem[32];
    auto reduce = [&](float v) { return block_sum(v, smem); };
    for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x)
        norm_row<T, K, VEC, VPT>(p, row, true, threadIdx.x, blockDim.x, reduce);
}

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
        // The row the statistics are taken over: x, or the sum written by the first pass.
        T const* xr = static_cast<T const*>(p.x) + base;
        float first = 0.f; // pass-1 partial: sum of squares (RMS) or sum (LayerNorm)
        if constexpr (kHasResidual<K>)
        {
            T const* rr = static_cast<T const*>(p.residual) + base;
            T* sr = static_cast<T*>(p.sum) + base;
            T const* gr = nullptr;
            if constexpr (K == NormKind::kGatedAdaLN)
                gr = static_cast<T const*>(p.gate) + mrow * p.hidden;
            T const* rb = static_cast<T const*>(p.res_bias);
            for (int64_t j = threadIdx.x; j < p.hidden; j += blockDim.x)
            {
                float a;
                if constexpr (K == NormKind::kGatedAdaLN)
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

inline unsigned grid_for(int64_t units)
{
    return static_cast<unsigned>(units < kMaxGrid ? (units > 0 ? units : 1) : kMaxGrid);
}

inline bool aligned16(void const* ptr)
{
    return ptr == nullptr || (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0;
}

template <typename T, NormKind K, int VEC, int VPT, int LANES>
inline void launch_group(NormParams const& p, cudaStream_t stream)
{
    constexpr int kRowsPerBlock = 128 / LANES;
    norm_group_kernel<T, K, VEC, VPT, LANES>
        <<<grid_for((p.rows + kRowsPerBlock - 1) / kRowsPerBlock), 128, 0, stream>>>(p);
}

template <typename T, NormKind K, int VEC, int VPT>
inline void launch_block(NormParams const& p, int64_t nvec, cudaStream_t stream)
{
    int64_t threads = (nvec + VPT - 1) / VPT; // <= max_threads_for<VPT>() by the choice of VPT below
    threads = (threads + 31) / 32 * 32;
    norm_block_kernel<T, K, VEC, VPT><<<grid_for(p.rows), static_cast<unsigned>(threads), 0, stream>>>(p);
}

// Pick the register-resident configuration for vector width VEC; returns false when the row is
// too long for registers (caller then uses the looped kernel). Short rows (<= 64 vectors): one
// warp or part of one per row, several rows per block. Longer rows: one block per row with 2
// vectors per thread (a row of 1024..16384 half-precision values gets 64..1024 threads), 8 for
// longer ones (up to 32768 half / 16384 float32 values).
template <typename T, NormKind K, int VEC>
inline bool launch_rows(NormParams const& p, cudaStream_t stream)
{
    int64_t const nvec = p.hidden / VEC;
    if (nvec <= 8)
        launch_group<T, K, VEC, 1, 8>(p, stream);
    else if (nvec <= 16)
        launch_group<T, K, VEC, 1, 16>(p, stream);
    else if (nvec <= 32)
        launch_group<T, K, VEC, 1, 32>(p, stream);
    else if (nvec <= 64)
        launch_group<T, K, VEC, 2, 32>(p, stream);
    else if (nvec <= 2 * 1024)
        launch_block<T, K, VEC, 2>(p, nvec, stream);
    else if (nvec <= 8 * 512)
        launch_block<T, K, VEC, 8>(p, nvec, stream);
    else if constexpr (VEC == 1 && !kHasResidual<K>)
    {
        // Scalar path: up to 8192 elements (16 per thread, 512 threads); the fused ops then loop.
        if (nvec <= 16 * 512)
            launch_block<T, K, VEC, 16>(p, nvec, stream);
        else
            return false;
    }
    else
        return false;
    return true;
}

template <typename T, NormKind K>
inline cudaError_t launch_norm(NormParams p, cudaStream_t stream)
{
    if (p.rows == 0)
        return cudaSuccess;
    p.inv_hidden = static_cast<float>(1.0 / static_cast<double>(p.hidden));
    constexpr int kVec = 16 / static_cast<int>(sizeof(T));
    bool const vec_ok = p.hidden % kVec == 0 && aligned16(p.x) && aligned16(p.y) && aligned16(p.weight)
        && aligned16(p.bias) && aligned16(p.shift) && aligned16(p.mod_scale) && aligned16(p.residual)
        && aligned16(p.res_bias) && aligned16(p.gate) && aligned16(p.sum);
    bool launched = vec_ok ? launch_rows<T, K, kVec>(p, stream) : launch_rows<T, K, 1>(p, stream);
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

} // namespace normexport
