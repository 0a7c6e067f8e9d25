// GatedAdaLNZero: sum = x + gate * update; y = LayerNorm(sum; weight, bias, eps) * (1 + scale) + shift.
#include "norm_common.cuh"

extern "C" NORMEXPORT_API cudaError_t normexport_gated_adaln_zero(void const* x, void const* update,
    void const* gate, void const* shift, void const* scale, void const* weight, void const* bias, void* y, void* sum,
    int64_t batch, int64_t seq, int64_t hidden, int mod_full, int dtype, float eps, cudaStream_t stream)
{
    using namespace normexport;
    if (batch < 0 || seq < 0 || (mod_full != 0 && mod_full != 1))
        return cudaErrorInvalidValue;
    if (seq > 0 && batch > INT64_MAX / seq)
        return cudaErrorInvalidValue;
    int64_t const rows = batch * seq;
    if (!valid_common(x, y, rows, hidden, dtype, eps))
        return cudaErrorInvalidValue;
    if (rows > 0 && (update == nullptr || gate == nullptr || shift == nullptr || scale == nullptr || sum == nullptr))
        return cudaErrorInvalidValue;
    NormParams p{};
    p.x = x;
    p.residual = update;
    p.gate = gate;
    p.weight = weight;
    p.bias = bias;
    p.shift = shift;
    p.mod_scale = scale;
    p.y = y;
    p.sum = sum;
    p.rows = rows;
    p.hidden = hidden;
    p.mod_row_div = mod_full ? 1 : (seq > 0 ? seq : 1);
    p.eps = eps;
    return launch_norm_dtype<NormKind::kGatedAdaLN>(p, dtype, stream);
}
