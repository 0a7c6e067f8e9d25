#include "rmsNormPlugin.h"

#include <exception>
#include <sstream>

using namespace nvinfer1;

namespace normexport
{
namespace plugin
{
namespace
{
namespace field = spec::rms_norm;
constexpr char const* kRMS_NORM_NAME{field::kNAME};
} // namespace

// ---------------------------------------------------------------------------------------------
// RMSNormPlugin
// ---------------------------------------------------------------------------------------------
RMSNormPlugin::RMSNormPlugin(float epsilon, int32_t axis)
    : mEpsilon(epsilon)
    , mAxis(axis)
{
}

IPluginCapability* RMSNormPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

IPluginV3* RMSNormPlugin::clone() noexcept
{
    try
    {
        return new RMSNormPlugin(mEpsilon, mAxis);
    }
    catch (std::exception const& e)
    {
        logError(kRMS_NORM_NAME, e.what());
    }
    return nullptr;
}

char const* RMSNormPlugin::getPluginName() const noexcept
{
    return kRMS_NORM_NAME;
}

char const* RMSNormPlugin::getPluginVersion() const noexcept
{
    return kPLUGIN_VERSION;
}

char const* RMSNormPlugin::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

int32_t RMSNormPlugin::firstNormDim(int32_t rank) const noexcept
{
    int32_t const a = mAxis < 0 ? mAxis + rank : mAxis;
    return (a >= 0 && a < rank) ? a : -1;
}

std::string RMSNormPlugin::checkShapes(Dims const& x, Dims const& scale) const
{
    std::ostringstream err;
    int32_t const first = firstNormDim(x.nbDims);
    if (x.nbDims < 1 || first < 0)
    {
        err << "axis " << mAxis << " is out of range for an input of rank " << x.nbDims;
        return err.str();
    }
    int64_t const hidden = volume(x, first, x.nbDims);
    int64_t const scaleVolume = volume(scale, 0, scale.nbDims);
    if (hidden >= 0 && scaleVolume >= 0 && hidden != scaleVolume)
    {
        err << "scale has " << scaleVolume << " elements, the normalised dims (axis " << mAxis << ") have " << hidden;
        return err.str();
    }
    return {};
}

template <typename Desc>
int32_t RMSNormPlugin::checkIO(Desc const* in, int32_t nbInputs, Desc const* out, int32_t nbOutputs) const noexcept
{
    try
    {
        if (in == nullptr || out == nullptr || nbInputs != 2 || nbOutputs != 1)
        {
            logError(kRMS_NORM_NAME, "expects 2 inputs (X, scale) and 1 output");
            return -1;
        }
        std::string const err = checkShapes(dimsOf(in[0]), dimsOf(in[1]));
        if (!err.empty())
        {
            logError(kRMS_NORM_NAME, err);
            return -1;
        }
        return 0;
    }
    catch (std::exception const& e)
    {
        logError(kRMS_NORM_NAME, e.what());
    }
    return -1;
}

int32_t RMSNormPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    return checkIO(in, nbInputs, out, nbOutputs);
}

int32_t RMSNormPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (outputTypes == nullptr || inputTypes == nullptr || nbOutputs != 1 || nbInputs != 2)
    {
        return -1;
    }
    outputTypes[0] = inputTypes[0];
    return 0;
}

int32_t RMSNormPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
    int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& /*exprBuilder*/) noexcept
{
    if (inputs == nullptr || outputs == nullptr || nbInputs != 2 || nbOutputs != 1)
    {
        return -1;
    }
    outputs[0].nbDims = inputs[0].nbDims;
    for (int32_t i = 0; i < inputs[0].nbDims; ++i)
    {
        outputs[0].d[i] = inputs[0].d[i];
    }
    return 0;
}

bool RMSNormPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (inOut == nullptr || nbInputs != 2 || nbOutputs != 1 || pos < 0 || pos >= nbInputs + nbOutputs)
    {
        return false;
    }
    return supportsLinearSameType(pos, inOut);
}

int32_t RMSNormPlugin::getNbOutputs() const noexcept
{
    return 1;
}

size_t RMSNormPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
    DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    return 0;
}

int32_t RMSNormPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    return checkIO(in, nbInputs, out, nbOutputs);
}

int32_t RMSNormPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
    void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept
{
    try
    {
        if (inputDesc == nullptr || inputs == nullptr || outputs == nullptr)
        {
            return -1;
        }
        Dims const& x = inputDesc[0].dims;
        int32_t const first = firstNormDim(x.nbDims);
        int32_t const dtype = toKernelDtype(inputDesc[0].type);
        if (first < 0 || dtype < 0 || inputDesc[1].type != inputDesc[0].type)
        {
            logError(kRMS_NORM_NAME, "unsupported axis or data type at enqueue");
            return -1;
        }
        int64_t const rows = volume(x, 0, first);
        int64_t const hidden = volume(x, first, x.nbDims);
        if (rows == 0 || hidden == 0)
        {
            return 0; // empty tensor: nothing to do
        }
        cudaError_t const status
            = normexport_rms_norm(inputs[0], inputs[1], outputs[0], rows, hidden, dtype, mEpsilon, stream);
        if (status != cudaSuccess)
        {
            logError(kRMS_NORM_NAME, std::string("kernel launch failed: ") + cudaGetErrorString(status));
            return -1;
        }
        return 0;
    }
    catch (std::exception const& e)
    {
        logError(kRMS_NORM_NAME, e.what());
    }
    return -1;
}

IPluginV3* RMSNormPlugin::attachToContext(IPluginResourceContext* /*context*/) noexcept
{
    // No per-context resources: a plain clone.
    return clone();
}

PluginFieldCollection const* RMSNormPlugin::getFieldsToSerialize() noexcept
{
    mDataToSerialize.clear();
    mDataToSerialize.emplace_back(field::kEPSILON, &mEpsilon, PluginFieldType::kFLOAT32, 1);
    mDataToSerialize.emplace_back(field::kAXIS, &mAxis, PluginFieldType::kINT32, 1);
    mFCToSerialize.nbFields = static_cast<int32_t>(mDataToSerialize.size());
    mFCToSerialize.fields = mDataToSerialize.data();
    return &mFCToSerialize;
}

// ---------------------------------------------------------------------------------------------
// RMSNormPluginCreator
// ---------------------------------------------------------------------------------------------
RMSNormPluginCreator::RMSNormPluginCreator()
{
    mPluginAttributes.emplace_back(field::kEPSILON, nullptr, PluginFieldType::kFLOAT32, 1);
    mPluginAttributes.emplace_back(field::kAXIS, nullptr, PluginFieldType::kINT32, 1);
    mFC.nbFields = static_cast<int32_t>(mPluginAttributes.size());
    mFC.fields = mPluginAttributes.data();
}

char const* RMSNormPluginCreator::getPluginName() const noexcept
{
    return kRMS_NORM_NAME;
}

char const* RMSNormPluginCreator::getPluginVersion() const noexcept
{
    return kPLUGIN_VERSION;
}

char const* RMSNormPluginCreator::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

PluginFieldCollection const* RMSNormPluginCreator::getFieldNames() noexcept
{
    return &mFC;
}

IPluginV3* RMSNormPluginCreator::createPlugin(
    char const* /*name*/, PluginFieldCollection const* fc, TensorRTPhase /*phase*/) noexcept
{
    try
    {
        float epsilon = field::kEPSILON_DEFAULT;
        int64_t axis = field::kAXIS_DEFAULT;
        for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
        {
            PluginField const& f = fc->fields[i];
            if (fieldIs(f, field::kEPSILON))
            {
                if (!readFloatField(f, epsilon))
                {
                    logError(kRMS_NORM_NAME, std::string("field '") + field::kEPSILON + "' must be a float32/float64 scalar");
                    return nullptr;
                }
            }
            else if (fieldIs(f, field::kAXIS))
            {
                if (!readIntField(f, axis) || axis < -8 || axis > 8)
                {
                    logError(kRMS_NORM_NAME, std::string("field '") + field::kAXIS + "' must be an integer scalar in [-8, 8]");
                    return nullptr;
                }
            }
            // Other fields (for example the ONNX parser's plugin_version / plugin_namespace) are ignored.
        }
        if (!(epsilon >= 0.F))
        {
            logError(kRMS_NORM_NAME, "epsilon must be >= 0");
            return nullptr;
        }
        return new RMSNormPlugin(epsilon, static_cast<int32_t>(axis));
    }
    catch (std::exception const& e)
    {
        logError(kRMS_NORM_NAME, e.what());
    }
    return nullptr;
}

} // namespace plugin
} // namespace normexport
