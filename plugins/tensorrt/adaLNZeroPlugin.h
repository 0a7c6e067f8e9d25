/*
 * AdaLNZero TensorRT plugin (IPluginV3), normexport domain op
 * `AdaLNZero(X, shift, scale[, weight, bias]) -> Y`:
 *   Y = LayerNorm(X; weight, bias, epsilon) * (1 + scale) + shift   (last dim normalised)
 * X: [B, ..., H]; shift, scale: [B, H] (broadcast over the middle dims; [1, H] also accepted) or
 * the full shape of X; weight, bias: [H]. Field: epsilon (float, default 1e-6).
 */
#pragma once

#include "pluginCommon.h"

#include <string>
#include <vector>

namespace normexport
{
namespace plugin
{

class AdaLNZeroPlugin : public nvinfer1::IPluginV3,
                      public nvinfer1::IPluginV3OneCore,
                      public nvinfer1::IPluginV3OneBuild,
                      public nvinfer1::IPluginV3OneRuntime
{
public:
    //! nbInputs: 3 or 5 when known (deserialisation), else 0 until the build calls tell it.
    explicit AdaLNZeroPlugin(float epsilon, int32_t nbInputs = 0);
    ~AdaLNZeroPlugin() override = default;

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
    //! How shift/scale index the rows of X.
    struct Layout
    {
        int64_t batch{0};  //!< rows = batch * seq
        int64_t seq{0};
        int64_t hidden{0};
        int32_t modFull{0}; //!< 1: shift/scale have X's shape; 0: one [H] row per batch
    };
    //! Validate the input dims (unknown dims, -1, are accepted at build time) and derive the
    //! layout; returns an error message, empty when fine.
    static std::string checkShapes(nvinfer1::Dims const* in, int32_t nbInputs, Layout* layout);
    //! configurePlugin (Desc = DynamicPluginTensorDesc, dims may be -1) and onShapeChange
    //! (Desc = PluginTensorDesc): check the I/O counts and shapes and record the input count;
    //! 0 when fine, else logs and -1.
    template <typename Desc>
    int32_t checkAndRecordIO(Desc const* in, int32_t nbInputs, Desc const* out, int32_t nbOutputs) noexcept;

    float mEpsilon;
    //! 3 (X, shift, scale) or 5 (+ weight, bias). enqueue() is not told the input count, so it is
    //! recorded by getOutputShapes / configurePlugin / onShapeChange and serialised as "nb_inputs".
    int32_t mNbInputs;
    std::vector<nvinfer1::PluginField> mDataToSerialize;
    nvinfer1::PluginFieldCollection mFCToSerialize{};
};

class AdaLNZeroPluginCreator : public nvinfer1::IPluginCreatorV3One
{
public:
    AdaLNZeroPluginCreator();
    ~AdaLNZeroPluginCreator() override = default;

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
