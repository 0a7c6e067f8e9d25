/*
 * SkipRMSNorm TensorRT plugin (IPluginV3), normexport domain op
 * `SkipRMSNorm(X, skip, scale[, bias]) -> (Y, Sum)`:
 *   Sum = X + skip [+ bias];  Y = Sum / sqrt(mean(Sum^2 over the last dim) + epsilon) * scale
 * X, skip: [..., H]; scale, bias: [H]. Field: epsilon (float, default 1e-6).
 */
#pragma once

#include "residualNormPlugin.h"

namespace normexport
{
namespace plugin
{

struct SkipRMSNormOp
{
    struct Field
    {
        static constexpr char const* kNAME{spec::skip_rms_norm::kNAME};
        static constexpr char const* kEPSILON{spec::skip_rms_norm::kEPSILON};
        static constexpr float kEPSILON_DEFAULT{spec::skip_rms_norm::kEPSILON_DEFAULT};
        static constexpr int32_t kMIN_INPUTS{spec::skip_rms_norm::kMIN_INPUTS};
        static constexpr int32_t kMAX_INPUTS{spec::skip_rms_norm::kMAX_INPUTS};
    };
    struct Launch
    {
        int64_t rows;
        int64_t hidden;
    };
    static std::string check(nvinfer1::Dims const* in, int32_t nbInputs, Launch* launch);
    static cudaError_t run(Launch const& launch, void const* const* in, int32_t nbInputs, void* const* out,
        int32_t dtype, float eps, cudaStream_t stream);
};

using SkipRMSNormPlugin = ResidualNormPlugin<SkipRMSNormOp>;
using SkipRMSNormPluginCreator = ResidualNormPluginCreator<SkipRMSNormOp>;

} // namespace plugin
} // namespace normexport
