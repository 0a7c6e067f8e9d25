/*
 * AdaLNZero TensorRT plugin (IPluginV3), normexport domain op
 * `AdaLNZero(X, shift, scale[, weight, bias]) -> Y`:
 *   Y = LayerNorm(X; weight, bias, epsilon) * (1 + scale) + shift   (last dim normalised)
 * X: [B, ..., H]; shift, scale: both [B, H] (broadcast over the middle dims; [1, H] also
 * accepted) or both the full shape of X; weight, bias: [H]. Fields: epsilon (float, default 1e-6),
 * modulation_axis (int, default 0: the dim of X a [B, H] shift / scale follows; 1 for a
 * sequence-first X [S, B, H], run by normexport_adaln_zero_axis).
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

struct AdaLNZeroOp : spec::adaln_zero
{
    using Launch = ModulationLayout;

    static std::string check(Dims const* in, int32_t nbInputs, NormAttrs const& attrs, Launch* launch)
    {
        char const* const mods[] = {"shift", "scale"};
        return checkAdaLNInputs(in, nbInputs, 1, mods, 2, attrs.modulationAxis, launch);
    }

    static cudaError_t run(Launch const& launch, void const* const* in, int32_t nbInputs, void* const* out,
        int32_t dtype, NormAttrs const& attrs, cudaStream_t stream)
    {
        void const* weight = nbInputs == kMAX_INPUTS ? in[3] : nullptr;
        void const* bias = nbInputs == kMAX_INPUTS ? in[4] : nullptr;
        if (launch.outer == 1)
        {
            return normexport_adaln_zero(in[0], in[1], in[2], weight, bias, out[0], launch.batch, launch.seq,
                launch.hidden, launch.modFull, dtype, attrs.epsilon, stream);
        }
        return normexport_adaln_zero_axis(in[0], in[1], in[2], weight, bias, out[0], launch.outer, launch.batch,
            launch.seq, launch.hidden, dtype, attrs.epsilon, stream);
    }
};

} // namespace

IPluginCreatorV3One* adaLNZeroPluginCreator()
{
    static NormPluginCreator<AdaLNZeroOp> sCreator;
    return &sCreator;
}

} // namespace plugin
} // namespace normexport
