/*
 * normexport CUDA kernels: small C ABI.
 *
 * Shared by the TensorRT plugins (plugins/tensorrt/) and the Python GPU test harness (ctypes).
 * Plain device pointers, sizes, a dtype enum, epsilon and a stream; no TensorRT types.
 *
 * Conventions for every function:
 *  - All tensors are dense, row-major (C-contiguous) and live in device memory.
 *  - Parameter tensors (scale / weight / bias / shift / mod scale) have the same dtype as x.
 *  - Statistics are accumulated in float32 whatever the IO dtype.
 *  - The call only enqueues work on `stream`; it does not synchronise.
 *  - Returns cudaSuccess, cudaErrorInvalidValue for bad arguments (null pointer where one is
 *    required, hidden < 1, negative sizes, unknown dtype, eps < 0 or NaN), or the launch error.
 *  - rows == 0 (or batch * seq == 0) is a valid no-op.
 *  - Any hidden size >= 1 works. The row is kept in registers (one read of x and params, one
 *    write of y) up to hidden 16384 (fp32) / 32768 (fp16, bf16) on the 16-byte vector path and
 *    up to 8192 on the scalar path; beyond that a looped multi-pass kernel is used (the fused
 *    ops then read their sum back from `sum`).
 *  - 16-byte vector loads/stores are used when every pointer is 16-byte aligned and hidden is a
 *    multiple of 16 / sizeof(dtype); otherwise a scalar path with identical results is used.
 *  - y may not alias any input.
 */
#ifndef NORMEXPORT_KERNELS_H
#define NORMEXPORT_KERNELS_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#if defined(_WIN32)
#define NORMEXPORT_API __declspec(dllexport)
#else
#define NORMEXPORT_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* IO dtype of every tensor of one call. */
typedef enum normexport_dtype
{
    NORMEXPORT_FLOAT32 = 0,
    NORMEXPORT_FLOAT16 = 1,
    NORMEXPORT_BFLOAT16 = 2
} normexport_dtype;

/*
 * RMSNorm over the last dimension:
 *   y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * scale[:]
 * x, y: [rows, hidden]; scale: [hidden] (required).
 */
NORMEXPORT_API cudaError_t normexport_rms_norm(void const* x, void const* scale, void* y, int64_t rows,
    int64_t hidden, int dtype, float eps, cudaStream_t stream);

/*
 * LayerNorm over the last dimension (biased variance):
 *   y[r, :] = (x[r, :] - mean) / sqrt(var + eps) [* weight[:]] [+ bias[:]]
 * x, y: [rows, hidden]; weight, bias: [hidden] or NULL (each optional on its own).
 */
NORMEXPORT_API cudaError_t normexport_layer_norm(void const* x, void const* weight, void const* bias, void* y,
    int64_t rows, int64_t hidden, int dtype, float eps, cudaStream_t stream);

/*
 * AdaLN-Zero modulation fused with LayerNorm:
 *   y = LayerNorm(x; weight, bias, eps) * (1 + scale) + shift
 * x, y: [batch, seq, hidden] (any leading layout flattened to batch x seq rows).
 * mod_full == 0: shift, scale are [batch, hidden], broadcast over seq.
 * mod_full == 1: shift, scale have the full shape of x ([batch, seq, hidden]).
 * weight, bias: [hidden] or NULL. shift and scale are required.
 */
NORMEXPORT_API cudaError_t normexport_adaln_zero(void const* x, void const* shift, void const* scale,
    void const* weight, void const* bias, void* y, int64_t batch, int64_t seq, int64_t hidden, int mod_full,
    int dtype, float eps, cudaStream_t stream);

/*
 * RMSNorm fused with the residual add before it (LLaMA's h = x + attn(x); rmsnorm(h)):
 *   sum[r, :] = x[r, :] + skip[r, :] [+ bias[:]]     (float32, rounded once to the IO dtype)
 *   y[r, :]   = sum[r, :] / sqrt(mean(sum[r, :]^2) + eps) * scale[:]   (of the rounded sum)
 * x, skip, y, sum: [rows, hidden]; scale: [hidden] (required); bias: [hidden] or NULL.
 * sum may not alias any input.
 */
NORMEXPORT_API cudaError_t normexport_skip_rms_norm(void const* x, void const* skip, void const* bias,
    void const* scale, void* y, void* sum, int64_t rows, int64_t hidden, int dtype, float eps, cudaStream_t stream);

/*
 * AdaLN-Zero fused with the gated residual before it (DiT's x = x + gate * attn(...); then the
 * modulated LayerNorm):
 *   sum = x + gate * update                          (float32, rounded once to the IO dtype)
 *   y   = LayerNorm(sum; weight, bias, eps) * (1 + scale) + shift   (of the rounded sum)
 * x, update, y, sum: [batch, seq, hidden]. gate, shift, scale: all three [batch, hidden]
 * (mod_full == 0, broadcast over seq) or all three [batch, seq, hidden] (mod_full == 1).
 * weight, bias: [hidden] or NULL. sum may not alias any input.
 */
NORMEXPORT_API cudaError_t normexport_gated_adaln_zero(void const* x, void const* update, void const* gate,
    void const* shift, void const* scale, void const* weight, void const* bias, void* y, void* sum, int64_t batch,
    int64_t seq, int64_t hidden, int mod_full, int dtype, float eps, cudaStream_t stream);

/*
 * The two AdaLN ops with a [batch, hidden] modulation that follows a dim of x other than the first
 * (the ops' modulation_axis attribute): x, y (and update, sum) are [outer, batch, inner, hidden]
 * (outer: the product of x's dims before the modulation axis, inner: of those after it, before the
 * last); shift, scale (and gate) are [batch, hidden]; row r of x (of outer * batch * inner) takes
 * modulation row (r / inner) % batch. A sequence-first x [S, B, H] (axis 1) is outer = S,
 * batch = B, inner = 1: modulation row r % B. outer = 1 is normexport_adaln_zero's [batch, hidden]
 * layout (mod_full 0, seq = inner) and runs its kernels, as does batch = 1. Otherwise as the
 * functions above (weight, bias: [hidden] or NULL; sum may not alias any input).
 */
NORMEXPORT_API cudaError_t normexport_adaln_zero_axis(void const* x, void const* shift, void const* scale,
    void const* weight, void const* bias, void* y, int64_t outer, int64_t batch, int64_t inner, int64_t hidden,
    int dtype, float eps, cudaStream_t stream);
NORMEXPORT_API cudaError_t normexport_gated_adaln_zero_axis(void const* x, void const* update, void const* gate,
    void const* shift, void const* scale, void const* weight, void const* bias, void* y, void* sum, int64_t outer,
    int64_t batch, int64_t inner, int64_t hidden, int dtype, float eps, cudaStream_t stream);

/* Which kernel a call runs, as the dispatcher picks it (normexport_launch_config). */
typedef enum normexport_kernel
{
    NORMEXPORT_KERNEL_GROUP = 0,  /* LANES threads per row, rows_per_group rows per thread group */
    NORMEXPORT_KERNEL_BLOCK = 1,  /* one row per block at a time, `threads` threads */
    NORMEXPORT_KERNEL_LOOPED = 2  /* any hidden size, several passes over global memory */
} normexport_kernel;

/* The ops, in the order of the kernels' NormKind. */
typedef enum normexport_op
{
    NORMEXPORT_OP_RMS_NORM = 0,
    NORMEXPORT_OP_LAYER_NORM = 1,
    NORMEXPORT_OP_ADALN_ZERO = 2,
    NORMEXPORT_OP_SKIP_RMS_NORM = 3,
    NORMEXPORT_OP_GATED_ADALN_ZERO = 4
} normexport_op;

typedef struct normexport_launch_config
{
    int kernel;             /* normexport_kernel */
    int vec;                /* elements per vector access: 16 / sizeof(dtype), or 1 (scalar path) */
    int vectors_per_thread; /* row kernels: vectors of a row each thread holds */
    int lanes;              /* group kernel: threads per row */
    int rows_per_group;     /* group kernel: rows each thread group holds at once */
    int threads;            /* threads per block */
} normexport_launch_config;

/*
 * The launch configuration the op's entry point uses for `rows` x `hidden` in `dtype`, with every
 * pointer 16-byte aligned (aligned != 0) or not. Host only (no CUDA call, no GPU needed): for
 * tests and tools that check the kernels' resource budgets. Returns 0, or cudaErrorInvalidValue
 * for a bad op, dtype, size or a NULL `out`.
 */
NORMEXPORT_API int normexport_launch_config_for(int op, int dtype, int64_t rows, int64_t hidden, int aligned,
    normexport_launch_config* out);

/* Version of this ABI (bumped on any incompatible change). */
NORMEXPORT_API int normexport_kernels_abi_version(void);

#ifdef __cplusplus
}
#endif

#endif /* NORMEXPORT_KERNELS_H */
