// SkipRMSNorm: sum = x + skip [+ bias]; y = sum / sqrt(mean(sum^2) + eps) * scale.
#include "norm_common.cuh"

extern "C" NORMEXPORT_API cudaError_t normexport_skip_rms_norm(void const* x, void const* skip, void const* bias,
    void const* scale, void* y, void* sum, int64_t rows, int64_t hidden, int dtype, float eps, cudaStream_t stream)
{
    using namespace normexport;
    if (!valid_common(x, y, rows, hidden, dtype, eps))
        return cudaErrorInvalidValue;
    if (rows > 0 && (skip == nullptr || scale == nullptr || sum == nullptr))
        return cudaErrorInvalidValue;
    NormParams p{};
    p.x = x;
    p.residual = skip;
    p.res_bias = bias;
    p.weight = scale;
    p.y = y;
    p.sum = sum;
    p.rows = rows;
    p.hidden = hidden;
    p.mod_row_div = 1;
    p.eps = eps;
    return launch_norm_dtype<NormKind::kSkipRms>(p, dtype, stream);
}
