/*
 * GatedAdaLNZero TensorRT plugin (IPluginV3), normexport domain op
 * `GatedAdaLNZero(X, update, gate, shift, scale[, weight, bias]) -> (Y, Sum)`:
 *   Sum = X + gate * update;  Y = LayerNorm(Sum; weight, bias, epsilon) * (1 + scale) + shift
 * X, update: [B, ..., H]; gate, shift, scale: all [B, H] (broadcast over the middle dims; [1, H]
 * also accepted) or all the full shape of X; weight, bias: [H]. Fields: epsilon (default 1e-6),
 * modulation_axis (default 0: the dim of X a [B, H] gate / shift / scale follows, as AdaLNZero's).
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

struct GatedAdaLNZeroOp : spec::gated_adaln_zero
{
    using Launch = ModulationLayout;

    static std::string check(Dims const* in, int32_t nbInputs, NormAttrs const& attrs, Launch* launch)
    {
        char const* const mods[] = {"gate", "shift", "scale"};
        std::string const err = checkAdaLNInputs(in, nbInputs, 2, mods, 3, attrs.modulationAxis, launch);
        if (err.empty() && !sameShape(in[1], in[0]))
        {
            return "update has shape " + dimsString(in[1]) + ", expected the shape of X " + dimsString(in[0]);
        }
        return err;
    }

    static cudaError_t run(Launch const& launch, void const* const* in, int32_t nbInputs, void* const* out,
        int32_t dtype, NormAttrs const& attrs, cudaStream_t stream)
    {
        void const* weight = nbInputs == kMAX_INPUTS ? in[5] : nullptr;
        void const* bias = nbInputs == kMAX_INPUTS ? in[6] : nullptr;
        if (launch.outer == 1)
        {
            return normexport_gated_adaln_zero(in[0], in[1], in[2], in[3], in[4], weight, bias, out[0], out[1],
                launch.batch, launch.seq, launch.hidden, launch.modFull, dtype, attrs.epsilon, stream);
        }
        return normexport_gated_adaln_zero_axis(in[0], in[1], in[2], in[3], in[4], weight, bias, out[0], out[1],
            launch.outer, launch.batch, launch.seq, launch.hidden, dtype, attrs.epsilon, stream);
    }
};

} // namespace

IPluginCreatorV3One* gatedAdaLNZeroPluginCreator()
{
    static NormPluginCreator<GatedAdaLNZeroOp> sCreator;
    return &sCreator;
}

} // namespace plugin
} // namespace normexport
