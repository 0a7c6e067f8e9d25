#include "skipRmsNormPlugin.h"

using namespace nvinfer1;

namespace normexport
{
namespace plugin
{

std::string SkipRMSNormOp::check(Dims const* in, int32_t nbInputs, Launch* launch)
{
    Dims const& x = in[0];
    if (x.nbDims < 1)
    {
        return "X must have rank >= 1";
    }
    if (!sameShape(in[1], x))
    {
        return "skip has shape " + dimsString(in[1]) + ", expected the shape of X " + dimsString(x);
    }
    int64_t const hidden = x.d[x.nbDims - 1];
    for (int32_t k = 2; k < nbInputs; ++k)
    {
        if (!compatibleDim(volume(in[k], 0, in[k].nbDims), hidden))
        {
            return std::string(k == 2 ? "scale" : "bias") + " has shape " + dimsString(in[k]) + ", expected ["
                + std::to_string(hidden) + "]";
        }
    }
    if (launch != nullptr)
    {
        launch->rows = volume(x, 0, x.nbDims - 1);
        launch->hidden = hidden;
    }
    return {};
}

cudaError_t SkipRMSNormOp::run(Launch const& launch, void const* const* in, int32_t nbInputs, void* const* out,
    int32_t dtype, float eps, cudaStream_t stream)
{
    void const* bias = nbInputs == Field::kMAX_INPUTS ? in[3] : nullptr;
    return normexport_skip_rms_norm(
        in[0], in[1], bias, in[2], out[0], out[1], launch.rows, launch.hidden, dtype, eps, stream);
}

template class ResidualNormPlugin<SkipRMSNormOp>;
template class ResidualNormPluginCreator<SkipRMSNormOp>;

} // namespace plugin
} // namespace normexport
