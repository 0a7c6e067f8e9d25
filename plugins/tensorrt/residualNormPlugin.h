/*
 * Shared IPluginV3 implementation of the fused residual ops (two outputs: Y and Sum), instantiated
 * once per op by skipRmsNormPlugin.cpp (SkipRMSNorm) and gatedAdaLNZeroPlugin.cpp (GatedAdaLNZero).
 * `Op` supplies the name, the field namespace of opSpecs.h, the accepted input counts, the shape
 * check and the kernel call:
 *
 *   struct Op {
 *       using Field = ...;                          // spec::<op> namespace wrapper (kNAME, kEPSILON, ...)
 *       struct Launch { ... };                      // sizes for the kernel call
 *       static std::string check(nvinfer1::Dims const* in, int32_t nbInputs, Launch* launch);
 *       static cudaError_t run(Launch const&, void const* const* in, int32_t nbInputs, void* const* out,
 *                              int32_t dtype, float eps, cudaStream_t stream);
 *   };
 * Fields: epsilon (float), plus nb_inputs (int) in serialised engines.
 */
#pragma once

#include "pluginCommon.h"

#include <exception>
#include <sstream>
#include <string>
#include <vector>

namespace normexport
{
namespace plugin
{

//! Equal, or at least one side unknown (build time, -1).
inline bool compatibleDim(int64_t a, int64_t b) noexcept
{
    return a < 0 || b < 0 || a == b;
}

inline std::string dimsString(nvinfer1::Dims const& d)
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

//! Whether `a` has the shape of `b` (unknown dims compatible).
inline bool sameShape(nvinfer1::Dims const& a, nvinfer1::Dims const& b) noexcept
{
    bool same = a.nbDims == b.nbDims;
    for (int32_t i = 0; same && i < a.nbDims; ++i)
    {
        same = compatibleDim(a.d[i], b.d[i]);
    }
    return same;
}

template <typename Op>
class ResidualNormPlugin : public nvinfer1::IPluginV3,
                           public nvinfer1::IPluginV3OneCore,
                           public nvinfer1::IPluginV3OneBuild,
                           public nvinfer1::IPluginV3OneRuntime
{
    using Field = typename Op::Field;

public:
    //! nbInputs: known at deserialisation, else 0 until the build calls tell it.
    explicit ResidualNormPlugin(float epsilon, int32_t nbInputs = 0)
        : mEpsilon(epsilon)
        , mNbInputs(nbInputs)
    {
    }
    ~ResidualNormPlugin() override = default;

    static bool validNbInputs(int64_t n) noexcept
    {
        return n == Field::kMIN_INPUTS || n == Field::kMAX_INPUTS;
    }

    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override
    {
        switch (type)
        {
        case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
        case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
        case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
        }
        return nullptr;
    }
    nvinfer1::IPluginV3* clone() noexcept override
    {
        try
        {
            return new ResidualNormPlugin(mEpsilon, mNbInputs);
        }
        catch (std::exception const& e)
        {
            logError(Field::kNAME, e.what());
        }
        return nullptr;
    }

    char const* getPluginName() const noexcept override
    {
        return Field::kNAME;
    }
    char const* getPluginVersion() const noexcept override
    {
        return kPLUGIN_VERSION;
    }
    char const* getPluginNamespace() const noexcept override
    {
        return kPLUGIN_NAMESPACE;
    }

    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override
    {
        return checkAndRecordIO(in, nbInputs, out, nbOutputs);
    }
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override
    {
        if (outputTypes == nullptr || inputTypes == nullptr || nbOutputs != 2 || !validNbInputs(nbInputs))
        {
            return -1;
        }
        outputTypes[0] = inputTypes[0];
        outputTypes[1] = inputTypes[0];
        return 0;
    }
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept override
    {
        if (inputs == nullptr || outputs == nullptr || nbOutputs != 2 || !validNbInputs(nbInputs))
        {
            return -1;
        }
        mNbInputs = nbInputs;
        for (int32_t o = 0; o < 2; ++o)
        {
            outputs[o].nbDims = inputs[0].nbDims;
            for (int32_t i = 0; i < inputs[0].nbDims; ++i)
            {
                outputs[o].d[i] = inputs[0].d[i];
            }
        }
        return 0;
    }
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override
    {
        if (inOut == nullptr || !validNbInputs(nbInputs) || nbOutputs != 2 || pos < 0 || pos >= nbInputs + nbOutputs)
        {
            return false;
        }
        return supportsLinearSameType(pos, inOut);
    }
    int32_t getNbOutputs() const noexcept override
    {
        return 2;
    }
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
        nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept override
    {
        return 0;
    }

    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override
    {
        return checkAndRecordIO(in, nbInputs, out, nbOutputs);
    }
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept override
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
                logError(Field::kNAME, "number of inputs unknown at enqueue (plugin not configured)");
                return -1;
            }
            nvinfer1::Dims dims[Field::kMAX_INPUTS];
            for (int32_t i = 0; i < nbInputs; ++i)
            {
                dims[i] = inputDesc[i].dims;
            }
            typename Op::Launch launch{};
            std::string const err = Op::check(dims, nbInputs, &launch);
            int32_t const dtype = toKernelDtype(inputDesc[0].type);
            if (!err.empty() || dtype < 0)
            {
                logError(Field::kNAME, err.empty() ? std::string("unsupported data type") : err);
                return -1;
            }
            if (volume(dims[0], 0, dims[0].nbDims) == 0)
            {
                return 0; // empty tensor
            }
            cudaError_t const status = Op::run(launch, inputs, nbInputs, outputs, dtype, mEpsilon, stream);
            if (status != cudaSuccess)
            {
                logError(Field::kNAME, std::string("kernel launch failed: ") + cudaGetErrorString(status));
                return -1;
            }
            return 0;
        }
        catch (std::exception const& e)
        {
            logError(Field::kNAME, e.what());
        }
        return -1;
    }
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept override
    {
        return clone(); // no per-context resources
    }
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override
    {
        mDataToSerialize.clear();
        mDataToSerialize.emplace_back(Field::kEPSILON, &mEpsilon, nvinfer1::PluginFieldType::kFLOAT32, 1);
        mDataToSerialize.emplace_back("nb_inputs", &mNbInputs, nvinfer1::PluginFieldType::kINT32, 1);
        mFCToSerialize.nbFields = static_cast<int32_t>(mDataToSerialize.size());
        mFCToSerialize.fields = mDataToSerialize.data();
        return &mFCToSerialize;
    }

private:
    template <typename Desc>
    int32_t checkAndRecordIO(Desc const* in, int32_t nbInputs, Desc const* out, int32_t nbOutputs) noexcept
    {
        try
        {
            if (in == nullptr || out == nullptr || nbOutputs != 2 || !validNbInputs(nbInputs))
            {
                logError(Field::kNAME, std::string("expects ") + std::to_string(Field::kMIN_INPUTS) + " or "
                        + std::to_string(Field::kMAX_INPUTS) + " inputs and 2 outputs (Y, Sum)");
                return -1;
            }
            nvinfer1::Dims dims[Field::kMAX_INPUTS];
            for (int32_t i = 0; i < nbInputs; ++i)
            {
                dims[i] = dimsOf(in[i]);
            }
            std::string const err = Op::check(dims, nbInputs, nullptr);
            if (!err.empty())
            {
                logError(Field::kNAME, err);
                return -1;
            }
            mNbInputs = nbInputs;
            return 0;
        }
        catch (std::exception const& e)
        {
            logError(Field::kNAME, e.what());
        }
        return -1;
    }

    float mEpsilon;
    int32_t mNbInputs;
    std::vector<nvinfer1::PluginField> mDataToSerialize;
    nvinfer1::PluginFieldCollection mFCToSerialize{};
};

template <typename Op>
class ResidualNormPluginCreator : public nvinfer1::IPluginCreatorV3One
{
    using Field = typename Op::Field;

public:
    ResidualNormPluginCreator()
    {
        mPluginAttributes.emplace_back(Field::kEPSILON, nullptr, nvinfer1::PluginFieldType::kFLOAT32, 1);
        mFC.nbFields = static_cast<int32_t>(mPluginAttributes.size());
        mFC.fields = mPluginAttributes.data();
    }
    ~ResidualNormPluginCreator() override = default;

    char const* getPluginName() const noexcept override
    {
        return Field::kNAME;
    }
    char const* getPluginVersion() const noexcept override
    {
        return kPLUGIN_VERSION;
    }
    char const* getPluginNamespace() const noexcept override
    {
        return kPLUGIN_NAMESPACE;
    }
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override
    {
        return &mFC;
    }
    nvinfer1::IPluginV3* createPlugin(char const* /*name*/, nvinfer1::PluginFieldCollection const* fc,
        nvinfer1::TensorRTPhase /*phase*/) noexcept override
    {
        try
        {
            float epsilon = Field::kEPSILON_DEFAULT;
            int64_t nbInputs = 0;
            for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
            {
                nvinfer1::PluginField const& f = fc->fields[i];
                if (fieldIs(f, Field::kEPSILON) && !readFloatField(f, epsilon))
                {
                    logError(Field::kNAME, std::string("field '") + Field::kEPSILON + "' must be a float32/float64 scalar");
                    return nullptr;
                }
                // Serialised by getFieldsToSerialize (absent when the plugin comes from an ONNX node).
                if (fieldIs(f, "nb_inputs")
                    && (!readIntField(f, nbInputs)
                        || (nbInputs != 0 && !ResidualNormPlugin<Op>::validNbInputs(nbInputs))))
                {
                    logError(Field::kNAME, std::string("field 'nb_inputs' must be ") + std::to_string(Field::kMIN_INPUTS)
                            + " or " + std::to_string(Field::kMAX_INPUTS));
                    return nullptr;
                }
                // Other fields (the ONNX parser's plugin_version / plugin_namespace) are ignored.
            }
            if (!(epsilon >= 0.F))
            {
                logError(Field::kNAME, "epsilon must be >= 0");
                return nullptr;
            }
            return new ResidualNormPlugin<Op>(epsilon, static_cast<int32_t>(nbInputs));
        }
        catch (std::exception const& e)
        {
            logError(Field::kNAME, e.what());
        }
        return nullptr;
    }

private:
    std::vector<nvinfer1::PluginField> mPluginAttributes;
    nvinfer1::PluginFieldCollection mFC{};
};

} // namespace plugin
} // namespace normexport
