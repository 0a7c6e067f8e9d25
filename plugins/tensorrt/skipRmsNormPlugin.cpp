/*
 * SkipRMSNorm TensorRT plugin (IPluginV3), normexport domain op
 * `SkipRMSNorm(X, skip, scale[, bias]) -> (Y, Sum)`:
 *   Sum = X + skip [+ bias];  Y = Sum / sqrt(mean(Sum^2 over the last dim) + epsilon) * scale
 * X, skip: [..., H]; scale, bias: [H]. Field: epsilon (float, default 1e-6).
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

struct SkipRMSNormOp : spec::skip_rms_norm
{
    struct Launch
    {
        int64_t rows;
        int64_t hidden;
    };

    static std::string check(Dims const* in, int32_t nbInputs, NormAttrs const& /*attrs*/, Launch* launch)
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
        char const* const vectors[] = {"scale", "bias"};
        std::string err = checkVectors(in, 2, nbInputs, hidden, vectors);
        if (err.empty() && launch != nullptr)
        {
            launch->rows = volume(x, 0, x.nbDims - 1);
            launch->hidden = hidden;
        }
        return err;
    }

    static cudaError_t run(Launch const& launch, void const* const* in, int32_t nbInputs, void* const* out,
        int32_t dtype, NormAttrs const& attrs, cudaStream_t stream)
    {
        void const* bias = nbInputs == kMAX_INPUTS ? in[3] : nullptr;
        return normexport_skip_rms_norm(
            in[0], in[1], bias, in[2], out[0], out[1], launch.rows, launch.hidden, dtype, attrs.epsilon, stream);
    }
};

} // namespace

IPluginCreatorV3One* skipRmsNormPluginCreator()
{
    static NormPluginCreator<SkipRMSNormOp> sCreator;
    return &sCreator;
}

} // namespace plugin
} // namespace normexport
