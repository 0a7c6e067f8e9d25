/*
 * GatedAdaLNZero TensorRT plugin (IPluginV3), normexport domain op
 * `GatedAdaLNZero(X, update, gate, shift, scale[, weight, bias]) -> (Y, Sum)`:
 *   Sum = X + gate * update;  Y = LayerNorm(Sum; weight, bias, epsilon) * (1 + scale) + shift
 * X, update: [B, ..., H]; gate, shift, scale: all [B, H] (broadcast over the middle dims; [1, H]
 * also accepted) or all the full shape of X; weight, bias: [H]. Field: epsilon (default 1e-6).
 */
#pragma once

#include "residualNormPlugin.h"

namespace normexport
{
namespace plugin
{

struct GatedAdaLNZeroOp
{
    struct Field
    {
        static constexpr char const* kNAME{spec::gated_adaln_zero::kNAME};
        static constexpr char const* kEPSILON{spec::gated_adaln_zero::kEPSILON};
        static constexpr float kEPSILON_DEFAULT{spec::gated_adaln_zero::kEPSILON_DEFAULT};
        static constexpr int32_t kMIN_INPUTS{spec::gated_adaln_zero::kMIN_INPUTS};
        static constexpr int32_t kMAX_INPUTS{spec::gated_adaln_zero::kMAX_INPUTS};
    };
    struct Launch
    {
        int64_t batch;
        int64_t seq;
        int64_t hidden;
        int32_t modFull;
    };
    static std::string check(nvinfer1::Dims const* in, int32_t nbInputs, Launch* launch);
    static cudaError_t run(Launch const& launch, void const* const* in, int32_t nbInputs, void* const* out,
        int32_t dtype, float eps, cudaStream_t stream);
};

using GatedAdaLNZeroPlugin = ResidualNormPlugin<GatedAdaLNZeroOp>;
using GatedAdaLNZeroPluginCreator = ResidualNormPluginCreator<GatedAdaLNZeroOp>;

} // namespace plugin
} // namespace normexport
