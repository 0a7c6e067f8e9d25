// LayerNorm (biased variance, optional affine) over the last dimension.
#include "norm_common.cuh"

extern "C" NORMEXPORT_API cudaError_t normexport_layer_norm(void const* x, void const* weight, void const* bias,
    void* y, int64_t rows, int64_t hidden, int dtype, float eps, cudaStream_t stream)
{
    using namespace normexport;
    if (!valid_common(x, y, rows, hidden, dtype, eps))
        return cudaErrorInvalidValue;
    NormParams p{};
    p.x = x;
    p.weight = weight;
    p.bias = bias;
    p.y = y;
    p.rows = rows;
    p.hidden = hidden;
    p.mod_row_div = 1;
    p.eps = eps;
    return launch_norm_dtype<NormKind::kLayer>(p, dtype, stream);
}
