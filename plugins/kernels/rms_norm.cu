// RMSNorm: y = x / sqrt(mean(x^2) + eps) * scale, over the last dimension.
#include "norm_common.cuh"

extern "C" NORMEXPORT_API cudaError_t normexport_rms_norm(void const* x, void const* scale, void* y, int64_t rows,
    int64_t hidden, int dtype, float eps, cudaStream_t stream)
{
    using namespace normexport;
    if (!valid_common(x, y, rows, hidden, dtype, eps))
        return cudaErrorInvalidValue;
    if (rows > 0 && scale == nullptr)
        return cudaErrorInvalidValue;
    NormParams p{};
    p.x = x;
    p.weight = scale;
    p.y = y;
    p.rows = rows;
    p.hidden = hidden;
    p.mod_row_div = 1;
    p.eps = eps;
    return launch_norm_dtype<NormKind::kRms>(p, dtype, stream);
}

extern "C" NORMEXPORT_API int normexport_kernels_abi_version(void)
{
    return 1;
}
