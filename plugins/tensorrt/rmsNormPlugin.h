/*
 * RMSNorm TensorRT plugin (IPluginV3), normexport domain op `RMSNorm(X, scale) -> Y`:
 *   Y = X / sqrt(mean(X^2 over dims axis..rank-1) + epsilon) * scale
 * Fields: epsilon (float, default 1e-6), axis (int, default -1).
 */
#pragma once

#include "pluginCommon.h"

#include <string>
#include <vector>

namespace normexport
{
namespace plugin
{

class RMSNormPlugin : public nvinfer1::IPluginV3,
                      public nvinfer1::IPluginV3OneCore,
                      public nvinfer1::IPluginV3OneBuild,
                      public nvinfer1::IPluginV3OneRuntime
{
public:
    RMSNormPlugin(float epsilon, int32_t axis);
    ~RMSNormPlugin() override = default;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t getNbOutputs() const noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    //! First normalised dimension for an input of rank `rank`; -1 if axis is out of range.
    int32_t firstNormDim(int32_t rank) const noexcept;
    //! Check x and scale dims (unknown dims, -1, are accepted); empty string when fine.
    std::string checkShapes(nvinfer1::Dims const& x, nvinfer1::Dims const& scale) const;
    //! configurePlugin (Desc = DynamicPluginTensorDesc, dims may be -1) and onShapeChange
    //! (Desc = PluginTensorDesc): check the I/O counts and shapes; 0 when fine, else logs and -1.
    template <typename Desc>
    int32_t checkIO(Desc const* in, int32_t nbInputs, Desc const* out, int32_t nbOutputs) const noexcept;

    float mEpsilon;
    int32_t mAxis;
    std::vector<nvinfer1::PluginField> mDataToSerialize;
    nvinfer1::PluginFieldCollection mFCToSerialize{};
};

class RMSNormPluginCreator : public nvinfer1::IPluginCreatorV3One
{
public:
    RMSNormPluginCreator();
    ~RMSNormPluginCreator() override = default;

    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;

private:
    std::vector<nvinfer1::PluginField> mPluginAttributes;
    nvinfer1::PluginFieldCollection mFC{};
};

} // namespace plugin
} // namespace normexport
