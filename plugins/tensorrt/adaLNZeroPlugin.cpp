#include "adaLNZeroPlugin.h"

#include <exception>
#include <sstream>

using namespace nvinfer1;

namespace normexport
{
namespace plugin
{
namespace
{
namespace field = spec::adaln_zero;
constexpr char const* kADALN_ZERO_NAME{field::kNAME};
//! X, shift, scale (no affine) or X, shift, scale, weight, bias
constexpr bool validNbInputs(int64_t n) noexcept
{
    return n == field::kMIN_INPUTS || n == field::kMAX_INPUTS;
}

//! Equal, or at least one side unknown (build time, -1).
bool compatible(int64_t a, int64_t b) noexcept
{
    return a < 0 || b < 0 || a == b;
}

std::string dimsToString(Dims const& d)
{
    std::ostringstream s;
    s << "[";
    for (int32_t i = 0; i < d.nbDims; ++i)
    {
        s << (i ? ", " : "") << d.d[i];
    }
    s << "]";
    return s.str();
}
} // namespace

// ---------------------------------------------------------------------------------------------
// AdaLNZeroPlugin
// ---------------------------------------------------------------------------------------------
AdaLNZeroPlugin::AdaLNZeroPlugin(float epsilon, int32_t nbInputs)
    : mEpsilon(epsilon)
    , mNbInputs(nbInputs)
{
}

IPluginCapability* AdaLNZeroPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

IPluginV3* AdaLNZeroPlugin::clone() noexcept
{
    try
    {
        return new AdaLNZeroPlugin(mEpsilon, mNbInputs);
    }
    catch (std::exception const& e)
    {
        logError(kADALN_ZERO_NAME, e.what());
    }
    return nullptr;
}

char const* AdaLNZeroPlugin::getPluginName() const noexcept
{
    return kADALN_ZERO_NAME;
}

char const* AdaLNZeroPlugin::getPluginVersion() const noexcept
{
    return kPLUGIN_VERSION;
}

char const* AdaLNZeroPlugin::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

std::string AdaLNZeroPlugin::checkShapes(Dims const* in, int32_t nbInputs, Layout* layout)
{
    if (!validNbInputs(nbInputs))
    {
        return "expects 3 or 5 inputs (X, shift, scale[, weight, bias])";
    }
    Dims const& x = in[0];
    if (x.nbDims < 2)
    {
        return "X must have rank >= 2, got " + dimsToString(x);
    }
    int64_t const batch = x.d[0];
    int64_t const hidden = x.d[x.nbDims - 1];
    int64_t const seq = volume(x, 1, x.nbDims - 1);

    // shift (input 1) and scale (input 2): the full shape of X, [B, H], or [1, H].
    int32_t kinds[2] = {-1, -1}; // 0: full, 1: [B, H], 2: [1, H] broadcast over the batch too
    for (int32_t k = 1; k <= 2; ++k)
    {
        Dims const& m = in[k];
        bool full = m.nbDims == x.nbDims;
        for (int32_t i = 0; full && i < x.nbDims; ++i)
        {
            full = compatible(m.d[i], x.d[i]);
        }
        bool const rowsOfB = m.nbDims == 2 && compatible(m.d[1], hidden) && compatible(m.d[0], batch);
        bool const rowOf1 = m.nbDims == 2 && compatible(m.d[1], hidden) && m.d[0] == 1;
        if (full)
        {
            kinds[k - 1] = 0;
        }
        else if (rowsOfB)
        {
            kinds[k - 1] = 1;
        }
        else if (rowOf1)
        {
            kinds[k - 1] = 2;
        }
        else
        {
            return std::string(k == 1 ? "shift" : "scale") + " has shape " + dimsToString(m)
                + ", expected the shape of X " + dimsToString(x) + " or [B, H]";
        }
    }
    bool const known = batch >= 0 && seq >= 0 && hidden >= 0;
    if (known && kinds[0] != kinds[1])
    {
        return "shift " + dimsToString(in[1]) + " and scale " + dimsToString(in[2]) + " have different layouts";
    }
    for (int32_t k = 3; k < nbInputs; ++k)
    {
        int64_t const v = volume(in[k], 0, in[k].nbDims);
        if (!compatible(v, hidden))
        {
            return std::string(k == 3 ? "weight" : "bias") + " has shape " + dimsToString(in[k]) + ", expected ["
                + std::to_string(hidden) + "]";
        }
    }
    if (layout != nullptr && known)
    {
        layout->hidden = hidden;
        if (kinds[0] == 0)
        {
            layout->batch = batch;
            layout->seq = seq;
            layout->modFull = 1;
        }
        else if (kinds[0] == 1)
        {
            layout->batch = batch;
            layout->seq = seq;
            layout->modFull = 0;
        }
        else // one modulation row for every row of X
        {
            layout->batch = 1;
            layout->seq = batch * seq;
            layout->modFull = 0;
        }
    }
    return {};
}

template <typename Desc>
int32_t AdaLNZeroPlugin::checkAndRecordIO(Desc const* in, int32_t nbInputs, Desc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        if (in == nullptr || out == nullptr || nbOutputs != 1 || !validNbInputs(nbInputs))
        {
            logError(kADALN_ZERO_NAME, "expects 3 or 5 inputs (X, shift, scale[, weight, bias]) and 1 output");
            return -1;
        }
        Dims dims[5];
        for (int32_t i = 0; i < nbInputs; ++i)
        {
            dims[i] = dimsOf(in[i]);
        }
        std::string const err = checkShapes(dims, nbInputs, nullptr);
        if (!err.empty())
        {
            logError(kADALN_ZERO_NAME, err);
            return -1;
        }
        mNbInputs = nbInputs;
        return 0;
    }
    catch (std::exception const& e)
    {
        logError(kADALN_ZERO_NAME, e.what());
    }
    return -1;
}

int32_t AdaLNZeroPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    return checkAndRecordIO(in, nbInputs, out, nbOutputs);
}

int32_t AdaLNZeroPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (outputTypes == nullptr || inputTypes == nullptr || nbOutputs != 1 || !validNbInputs(nbInputs))
    {
        return -1;
    }
    outputTypes[0] = inputTypes[0];
    return 0;
}

int32_t AdaLNZeroPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
    int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& /*exprBuilder*/) noexcept
{
    if (inputs == nullptr || outputs == nullptr || nbOutputs != 1 || !validNbInputs(nbInputs))
    {
        return -1;
    }
    mNbInputs = nbInputs;
    outputs[0].nbDims = inputs[0].nbDims;
    for (int32_t i = 0; i < inputs[0].nbDims; ++i)
    {
        outputs[0].d[i] = inputs[0].d[i];
    }
    return 0;
}

bool AdaLNZeroPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (inOut == nullptr || !validNbInputs(nbInputs) || nbOutputs != 1 || pos < 0
        || pos >= nbInputs + nbOutputs)
    {
        return false;
    }
    return supportsLinearSameType(pos, inOut);
}

int32_t AdaLNZeroPlugin::getNbOutputs() const noexcept
{
    return 1;
}

size_t AdaLNZeroPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
    DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    return 0;
}

int32_t AdaLNZeroPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    return checkAndRecordIO(in, nbInputs, out, nbOutputs);
}

int32_t AdaLNZeroPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
    void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept
{
    try
    {
        if (inputDesc == nullptr || outputDesc == nullptr || inputs == nullptr || outputs == nullptr)
        {
            return -1;
        }
        int32_t const nbInputs = mNbInputs;
        if (!validNbInputs(nbInputs))
        {
            logError(kADALN_ZERO_NAME, "number of inputs unknown at enqueue (plugin not configured)");
            return -1;
        }
        Dims dims[5];
        for (int32_t i = 0; i < nbInputs; ++i)
        {
            dims[i] = inputDesc[i].dims;
        }
        Layout layout;
        std::string const err = checkShapes(dims, nbInputs, &layout);
        int32_t const dtype = toKernelDtype(inputDesc[0].type);
        if (!err.empty() || dtype < 0)
        {
            logError(kADALN_ZERO_NAME, err.empty() ? std::string("unsupported data type") : err);
            return -1;
        }
        if (layout.batch * layout.seq == 0 || layout.hidden == 0)
        {
            return 0; // empty tensor
        }
        void const* weight = nbInputs == field::kMAX_INPUTS ? inputs[3] : nullptr;
        void const* bias = nbInputs == field::kMAX_INPUTS ? inputs[4] : nullptr;
        cudaError_t const status = normexport_adaln_zero(inputs[0], inputs[1], inputs[2], weight, bias, outputs[0],
            layout.batch, layout.seq, layout.hidden, layout.modFull, dtype, mEpsilon, stream);
        if (status != cudaSuccess)
        {
            logError(kADALN_ZERO_NAME, std::string("kernel launch failed: ") + cudaGetErrorString(status));
            return -1;
        }
        return 0;
    }
    catch (std::exception const& e)
    {
        logError(kADALN_ZERO_NAME, e.what());
    }
    return -1;
}

IPluginV3* AdaLNZeroPlugin::attachToContext(IPluginResourceContext* /*context*/) noexcept
{
    // No per-context resources: a plain clone.
    return clone();
}

PluginFieldCollection const* AdaLNZeroPlugin::getFieldsToSerialize() noexcept
{
    mDataToSerialize.clear();
    mDataToSerialize.emplace_back(field::kEPSILON, &mEpsilon, PluginFieldType::kFLOAT32, 1);
    mDataToSerialize.emplace_back("nb_inputs", &mNbInputs, PluginFieldType::kINT32, 1);
    mFCToSerialize.nbFields = static_cast<int32_t>(mDataToSerialize.size());
    mFCToSerialize.fields = mDataToSerialize.data();
    return &mFCToSerialize;
}

// ---------------------------------------------------------------------------------------------
// AdaLNZeroPluginCreator
// ---------------------------------------------------------------------------------------------
AdaLNZeroPluginCreator::AdaLNZeroPluginCreator()
{
    mPluginAttributes.emplace_back(field::kEPSILON, nullptr, PluginFieldType::kFLOAT32, 1);
    mFC.nbFields = static_cast<int32_t>(mPluginAttributes.size());
    mFC.fields = mPluginAttributes.data();
}

char const* AdaLNZeroPluginCreator::getPluginName() const noexcept
{
    return kADALN_ZERO_NAME;
}

char const* AdaLNZeroPluginCreator::getPluginVersion() const noexcept
{
    return kPLUGIN_VERSION;
}

char const* AdaLNZeroPluginCreator::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

PluginFieldCollection const* AdaLNZeroPluginCreator::getFieldNames() noexcept
{
    return &mFC;
}

IPluginV3* AdaLNZeroPluginCreator::createPlugin(
    char const* /*name*/, PluginFieldCollection const* fc, TensorRTPhase /*phase*/) noexcept
{
    try
    {
        float epsilon = field::kEPSILON_DEFAULT;
        int64_t nbInputs = 0;
        for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
        {
            PluginField const& f = fc->fields[i];
            if (fieldIs(f, field::kEPSILON) && !readFloatField(f, epsilon))
            {
                logError(kADALN_ZERO_NAME, std::string("field '") + field::kEPSILON + "' must be a float32/float64 scalar");
                return nullptr;
            }
            // Serialised by getFieldsToSerialize (absent when the plugin comes from an ONNX node).
            if (fieldIs(f, "nb_inputs") && (!readIntField(f, nbInputs) || (nbInputs != 0 && !validNbInputs(nbInputs))))
            {
                logError(kADALN_ZERO_NAME, "field 'nb_inputs' must be 3 or 5");
                return nullptr;
            }
        }
        if (!(epsilon >= 0.F))
        {
            logError(kADALN_ZERO_NAME, "epsilon must be >= 0");
            return nullptr;
        }
        return new AdaLNZeroPlugin(epsilon, static_cast<int32_t>(nbInputs));
    }
    catch (std::exception const& e)
    {
        logError(kADALN_ZERO_NAME, e.what());
    }
    return nullptr;
}

} // namespace plugin
} // namespace normexport
