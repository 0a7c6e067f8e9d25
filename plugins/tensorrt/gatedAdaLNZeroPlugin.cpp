#include "gatedAdaLNZeroPlugin.h"

using namespace nvinfer1;

namespace normexport
{
namespace plugin
{

std::string GatedAdaLNZeroOp::check(Dims const* in, int32_t nbInputs, Launch* launch)
{
    Dims const& x = in[0];
    if (x.nbDims < 2)
    {
        return "X must have rank >= 2, got " + dimsString(x);
    }
    if (!sameShape(in[1], x))
    {
        return "update has shape " + dimsString(in[1]) + ", expected the shape of X " + dimsString(x);
    }
    int64_t const batch = x.d[0];
    int64_t const hidden = x.d[x.nbDims - 1];
    int64_t const seq = volume(x, 1, x.nbDims - 1);
    // gate (2), shift (3), scale (4): the full shape of X, [B, H], or [1, H]; all three alike.
    char const* names[3] = {"gate", "shift", "scale"};
    int32_t kinds[3] = {-1, -1, -1}; // 0: full, 1: [B, H], 2: [1, H]
    for (int32_t k = 0; k < 3; ++k)
    {
        Dims const& m = in[2 + k];
        bool const rowsOfB = m.nbDims == 2 && compatibleDim(m.d[1], hidden) && compatibleDim(m.d[0], batch);
        bool const rowOf1 = m.nbDims == 2 && compatibleDim(m.d[1], hidden) && m.d[0] == 1;
        if (sameShape(m, x))
        {
            kinds[k] = 0;
        }
        else if (rowsOfB)
        {
            kinds[k] = 1;
        }
        else if (rowOf1)
        {
            kinds[k] = 2;
        }
        else
        {
            return std::string(names[k]) + " has shape " + dimsString(m) + ", expected the shape of X "
                + dimsString(x) + " or [B, H]";
        }
    }
    bool const known = batch >= 0 && seq >= 0 && hidden >= 0;
    if (known && (kinds[0] != kinds[1] || kinds[1] != kinds[2]))
    {
        return "gate " + dimsString(in[2]) + ", shift " + dimsString(in[3]) + " and scale " + dimsString(in[4])
            + " have different layouts";
    }
    for (int32_t k = 5; k < nbInputs; ++k)
    {
        if (!compatibleDim(volume(in[k], 0, in[k].nbDims), hidden))
        {
            return std::string(k == 5 ? "weight" : "bias") + " has shape " + dimsString(in[k]) + ", expected ["
                + std::to_string(hidden) + "]";
        }
    }
    if (launch != nullptr && known)
    {
        launch->hidden = hidden;
        launch->batch = kinds[0] == 2 ? 1 : batch;
        launch->seq = kinds[0] == 2 ? batch * seq : seq;
        launch->modFull = kinds[0] == 0 ? 1 : 0;
    }
    return {};
}

cudaError_t GatedAdaLNZeroOp::run(Launch const& launch, void const* const* in, int32_t nbInputs, void* const* out,
    int32_t dtype, float eps, cudaStream_t stream)
{
    void const* weight = nbInputs == Field::kMAX_INPUTS ? in[5] : nullptr;
    void const* bias = nbInputs == Field::kMAX_INPUTS ? in[6] : nullptr;
    return normexport_gated_adaln_zero(in[0], in[1], in[2], in[3], in[4], weight, bias, out[0], out[1], launch.batch,
        launch.seq, launch.hidden, launch.modFull, dtype, eps, stream);
}

template class ResidualNormPlugin<GatedAdaLNZeroOp>;
template class ResidualNormPluginCreator<GatedAdaLNZeroOp>;

} // namespace plugin
} // namespace normexport
