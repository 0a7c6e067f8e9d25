// AdaLN-Zero: y = LayerNorm(x; weight, bias, eps) * (1 + scale) + shift.
#include "norm_common.cuh"

extern "C" NORMEXPORT_API cudaError_t normexport_adaln_zero(void const* x, void const* shift, void const* scale,
    void const* weight, void const* bias, void* y, int64_t batch, int64_t seq, int64_t hidden, int mod_full,
    int dtype, float eps, cudaStream_t stream)
{
    using namespace normexport;
    NormParams p{};
    if (!adaln_rows(batch, seq, mod_full, p) || !valid_common(x, y, p.rows, hidden, dtype, eps))
        return cudaErrorInvalidValue;
    if (p.rows > 0 && (shift == nullptr || scale == nullptr))
        return cudaErrorInvalidValue;
    p.x = x;
    p.weight = weight;
    p.bias = bias;
    p.shift = shift;
    p.mod_scale = scale;
    p.y = y;
    p.hidden = hidden;
    p.eps = eps;
    return launch_norm_dtype<NormKind::kAdaLN>(p, dtype, stream);
}
