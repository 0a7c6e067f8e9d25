/*
 * RMSNorm TensorRT plugin (IPluginV3), normexport domain op `RMSNorm(X, scale) -> Y`:
 *   Y = X / sqrt(mean(X^2 over dims axis..rank-1) + epsilon) * scale
 * scale: X.shape[axis:] (any shape with that many elements). Fields: epsilon (float, default
 * 1e-6), axis (int, default -1).
 */
#include "creators.h"
#include "normPlugin.h"

using namespace nvinfer1;

namespace normexport
{
namespace plugin
{
namespace
{

struct RMSNormOp : spec::rms_norm
{
    struct Launch
    {
        int64_t rows;
        int64_t hidden;
    };

    static std::string check(Dims const* in, int32_t /*nbInputs*/, NormAttrs const& attrs, Launch* launch)
    {
        Dims const& x = in[0];
        int32_t const first = attrs.axis < 0 ? attrs.axis + x.nbDims : attrs.axis;
        if (x.nbDims < 1 || first < 0 || first >= x.nbDims)
        {
            return "axis " + std::to_string(attrs.axis) + " is out of range for an input of rank "
                + std::to_string(x.nbDims);
        }
        int64_t const hidden = volume(x, first, x.nbDims);
        int64_t const scaleVolume = volume(in[1], 0, in[1].nbDims);
        if (!compatibleDim(hidden, scaleVolume))
        {
            return "scale has " + std::to_string(scaleVolume) + " elements, the normalised dims (axis "
                + std::to_string(attrs.axis) + ") have " + std::to_string(hidden);
        }
        if (launch != nullptr)
        {
            launch->rows = volume(x, 0, first);
            launch->hidden = hidden;
        }
        return {};
    }

    static cudaError_t run(Launch const& launch, void const* const* in, int32_t /*nbInputs*/, void* const* out,
        int32_t dtype, NormAttrs const& attrs, cudaStream_t stream)
    {
        return normexport_rms_norm(in[0], in[1], out[0], launch.rows, launch.hidden, dtype, attrs.epsilon, stream);
    }
};

} // namespace

IPluginCreatorV3One* rmsNormPluginCreator()
{
    static NormPluginCreator<RMSNormOp> sCreator;
    return &sCreator;
}

} // namespace plugin
} // namespace normexport
