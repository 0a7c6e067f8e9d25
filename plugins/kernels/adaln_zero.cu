// AdaLN-Zero: y = LayerNorm(x; weight, bias, eps) * (1 + scale) + shift.
#include "norm_common.cuh"

namespace
{
// The pointers and sizes every AdaLNZero call sets; false when one that is needed is missing.
bool adaln_params(normexport::NormParams& p, void const* x, void const* shift, void const* scale, void const* weight,
    void const* bias, void* y, int64_t hidden, float eps)
{
    if (p.rows > 0 && (shift == nullptr || scale == nullptr))
        return false;
    p.x = x;
    p.weight = weight;
    p.bias = bias;
    p.shift = shift;
    p.mod_scale = scale;
    p.y = y;
    p.hidden = hidden;
    p.eps = eps;
    return true;
}
} // namespace

extern "C" NORMEXPORT_API cudaError_t normexport_adaln_zero(void const* x, void const* shift, void const* scale,
    void const* weight, void const* bias, void* y, int64_t batch, int64_t seq, int64_t hidden, int mod_full,
    int dtype, float eps, cudaStream_t stream)
{
    using namespace normexport;
    NormParams p{};
    if (!adaln_rows(batch, seq, mod_full, p) || !valid_common(x, y, p.rows, hidden, dtype, eps))
        return cudaErrorInvalidValue;
    if (!adaln_params(p, x, shift, scale, weight, bias, y, hidden, eps))
        return cudaErrorInvalidValue;
    return launch_norm_dtype<NormKind::kAdaLN>(p, dtype, stream);
}

extern "C" NORMEXPORT_API cudaError_t normexport_adaln_zero_axis(void const* x, void const* shift,
    void const* scale, void const* weight, void const* bias, void* y, int64_t outer, int64_t batch, int64_t inner,
    int64_t hidden, int dtype, float eps, cudaStream_t stream)
{
    using namespace normexport;
    NormParams p{};
    bool mod_axis = false;
    if (!adaln_rows_axis(outer, batch, inner, p, mod_axis) || !valid_common(x, y, p.rows, hidden, dtype, eps))
        return cudaErrorInvalidValue;
    if (!adaln_params(p, x, shift, scale, weight, bias, y, hidden, eps))
        return cudaErrorInvalidValue;
    return mod_axis ? launch_norm_dtype<NormKind::kAdaLNModAxis>(p, dtype, stream)
                    : launch_norm_dtype<NormKind::kAdaLN>(p, dtype, stream);
}
