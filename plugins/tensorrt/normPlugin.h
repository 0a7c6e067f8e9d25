/*
 * The IPluginV3 plugin and creator every normexport op shares (TensorRT OSS style: one template,
 * one instantiation per op in rmsNormPlugin.cpp, adaLNZeroPlugin.cpp, skipRmsNormPlugin.cpp and
 * gatedAdaLNZeroPlugin.cpp). `Op` is the op's spec struct from opSpecs.h (generated from the op
 * specs: kNAME, kSIGNATURE, kMIN_INPUTS, kMAX_INPUTS, kNB_OUTPUTS, the fields and their defaults,
 * kHAS_AXIS) plus the op's own part:
 *
 *   struct Launch { ... };   // sizes for the kernel call
 *   static std::string check(nvinfer1::Dims const* in, int32_t nbInputs, NormAttrs const&, Launch*);
 *   static cudaError_t run(Launch const&, void const* const* in, int32_t nbInputs, void* const* out,
 *                          int32_t dtype, NormAttrs const&, cudaStream_t stream);
 *
 * check() validates the input dims (unknown dims, -1, are accepted at build time) and, given a
 * Launch, fills it (enqueue: every dim known); it returns the reason for a mismatch, empty when
 * fine. Every output has X's shape and type. Fields: epsilon (float), axis (int, ops that have
 * one), modulation_axis (int, the AdaLN ops), and nb_inputs (int) in serialised engines of ops
 * with optional inputs: enqueue() is not told the input count, so it is recorded by
 * getOutputShapes / configurePlugin / onShapeChange.
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

//! The node's attributes: epsilon for every op, axis for the ops that have one (RMSNorm),
//! modulationAxis for the AdaLN ops (0 elsewhere).
struct NormAttrs
{
    float epsilon;
    int32_t axis;
    int32_t modulationAxis;
};

// ---------------------------------------------------------------------------------------------
// Shape checks shared by the ops' check()
// ---------------------------------------------------------------------------------------------
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

//! Inputs in[begin..end) hold `hidden` elements each ([H] vectors: weight, bias, scale); names[k -
//! begin] names input k. Returns the first mismatch as a message, empty when fine.
inline std::string checkVectors(
    nvinfer1::Dims const* in, int32_t begin, int32_t end, int64_t hidden, char const* const* names)
{
    for (int32_t k = begin; k < end; ++k)
    {
        if (!compatibleDim(volume(in[k], 0, in[k].nbDims), hidden))
        {
            return std::string(names[k - begin]) + " has shape " + dimsString(in[k]) + ", expected ["
                + std::to_string(hidden) + "]";
        }
    }
    return {};
}

//! How AdaLN modulation tensors index the rows of X: rows = outer * batch * seq, modulation row =
//! row / seq (outer 1: one [H] row per batch, modFull 0), row (modFull 1), or (row / seq) % batch
//! (outer > 1: a [B, H] modulation following dim modulation_axis > 0 of X, seq the product of the
//! dims after it).
struct ModulationLayout
{
    int64_t batch;
    int64_t seq;
    int64_t hidden;
    int32_t modFull;
    int64_t outer;
};

//! The modulation tensors `mods` (named `names`, `n` of them: shift and scale, or gate, shift and
//! scale) against X [..., H]: all the full shape of X, all [B, H] with B X's dim `axis` (the op's
//! modulation_axis; broadcast over the other dims but the last), or all [1, H] (one row for every
//! row of X). Fills `layout` (when given and every dim is known); returns the reason when they do
//! not fit, empty when fine.
inline std::string checkModulation(nvinfer1::Dims const& x, nvinfer1::Dims const* mods, char const* const* names,
    int32_t n, int32_t axis, ModulationLayout* layout)
{
    if (axis < 0 || axis > x.nbDims - 2)
    {
        return "modulation_axis " + std::to_string(axis) + " is out of range for X " + dimsString(x) + " (0.."
            + std::to_string(x.nbDims - 2) + ")";
    }
    int64_t const batch = x.d[axis];
    int64_t const hidden = x.d[x.nbDims - 1];
    int64_t const seq = volume(x, axis + 1, x.nbDims - 1);
    int32_t kind = -1; // 0: full, 1: [B, H], 2: [1, H]
    bool same = true;
    for (int32_t k = 0; k < n; ++k)
    {
        nvinfer1::Dims const& m = mods[k];
        bool const rowOfH = m.nbDims == 2 && compatibleDim(m.d[1], hidden);
        int32_t const mine = sameShape(m, x)      ? 0
            : rowOfH && compatibleDim(m.d[0], batch) ? 1
            : rowOfH && m.d[0] == 1                  ? 2
                                                     : -1;
        if (mine < 0)
        {
            return std::string(names[k]) + " has shape " + dimsString(m) + ", expected the shape of X "
                + dimsString(x) + " or [B, H]" + (axis == 0 ? "" : " (B: dim " + std::to_string(axis) + " of X)");
        }
        same = same && (k == 0 || mine == kind);
        kind = mine;
    }
    bool const known = volume(x, 0, x.nbDims) >= 0;
    if (known && !same)
    {
        std::string err;
        for (int32_t k = 0; k < n; ++k)
        {
            err += (k == 0 ? "" : k == n - 1 ? " and " : ", ") + std::string(names[k]) + " " + dimsString(mods[k]);
        }
        return err + " have different layouts";
    }
    if (layout != nullptr && known)
    {
        // full shape and [1, H]: X as [x.d[0], rest] whatever the axis; [B, H]: [outer, B, seq]
        int64_t const first = x.d[0];
        int64_t const rest = volume(x, 1, x.nbDims - 1);
        layout->hidden = hidden;
        layout->outer = kind == 1 ? volume(x, 0, axis) : 1;
        layout->batch = kind == 2 ? 1 : kind == 1 ? batch : first;
        layout->seq = kind == 2 ? first * rest : kind == 1 ? seq : rest;
        layout->modFull = kind == 0 ? 1 : 0;
    }
    return {};
}

//! The AdaLN ops' inputs: X [B, ..., H] of rank >= 2; at in[first..first + n) the modulation
//! tensors named `mods` (checkModulation, [B, H] following dim `axis` of X); after them the
//! optional LayerNorm weight and bias [H].
inline std::string checkAdaLNInputs(nvinfer1::Dims const* in, int32_t nbInputs, int32_t first, char const* const* mods,
    int32_t n, int32_t axis, ModulationLayout* layout)
{
    nvinfer1::Dims const& x = in[0];
    if (x.nbDims < 2)
    {
        return "X must have rank >= 2, got " + dimsString(x);
    }
    char const* const affine[] = {"weight", "bias"};
    std::string const err = checkModulation(x, in + first, mods, n, axis, layout);
    return err.empty() ? checkVectors(in, first + n, nbInputs, x.d[x.nbDims - 1], affine) : err;
}

// ---------------------------------------------------------------------------------------------
// The plugin
// ---------------------------------------------------------------------------------------------
template <typename Op>
class NormPlugin : public nvinfer1::IPluginV3,
                   public nvinfer1::IPluginV3OneCore,
                   public nvinfer1::IPluginV3OneBuild,
                   public nvinfer1::IPluginV3OneRuntime
{
    static constexpr int32_t kNB_OUTPUTS = Op::kNB_OUTPUTS;

public:
    //! Whether the input count varies (optional inputs): then it is serialised as nb_inputs.
    static constexpr bool kVARIADIC = Op::kMIN_INPUTS != Op::kMAX_INPUTS;

    //! nbInputs: known at deserialisation, else 0 until the build calls tell it (fixed-count ops:
    //! always their count).
    explicit NormPlugin(NormAttrs attrs, int32_t nbInputs = 0)
        : mAttrs(attrs)
        , mNbInputs(kVARIADIC ? nbInputs : Op::kMIN_INPUTS)
    {
    }
    ~NormPlugin() override = default;

    static bool validNbInputs(int64_t n) noexcept
    {
        return n == Op::kMIN_INPUTS || n == Op::kMAX_INPUTS;
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
            return new NormPlugin(mAttrs, mNbInputs);
        }
        catch (std::exception const& e)
        {
            logError(Op::kNAME, e.what());
        }
        return nullptr;
    }

    char const* getPluginName() const noexcept override
    {
        return Op::kNAME;
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
        if (outputTypes == nullptr || inputTypes == nullptr || nbOutputs != kNB_OUTPUTS || !validNbInputs(nbInputs))
        {
            return -1;
        }
        for (int32_t o = 0; o < kNB_OUTPUTS; ++o)
        {
            outputTypes[o] = inputTypes[0];
        }
        return 0;
    }
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept override
    {
        if (inputs == nullptr || outputs == nullptr || nbOutputs != kNB_OUTPUTS || !validNbInputs(nbInputs))
        {
            return -1;
        }
        mNbInputs = nbInputs;
        for (int32_t o = 0; o < kNB_OUTPUTS; ++o)
        {
            outputs[o] = inputs[0]; // every output has X's shape
        }
        return 0;
    }
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override
    {
        if (inOut == nullptr || !validNbInputs(nbInputs) || nbOutputs != kNB_OUTPUTS || pos < 0
            || pos >= nbInputs + nbOutputs)
        {
            return false;
        }
        return supportsLinearSameType(pos, inOut);
    }
    int32_t getNbOutputs() const noexcept override
    {
        return kNB_OUTPUTS;
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
                logError(Op::kNAME, "number of inputs unknown at enqueue (plugin not configured)");
                return -1;
            }
            nvinfer1::Dims dims[Op::kMAX_INPUTS];
            bool sameType = true;
            for (int32_t i = 0; i < nbInputs; ++i)
            {
                dims[i] = inputDesc[i].dims;
                sameType = sameType && inputDesc[i].type == inputDesc[0].type;
            }
            typename Op::Launch launch{};
            std::string const err = Op::check(dims, nbInputs, mAttrs, &launch);
            int32_t const dtype = toKernelDtype(inputDesc[0].type);
            if (!err.empty() || dtype < 0 || !sameType)
            {
                logError(Op::kNAME, !err.empty() ? err : "unsupported data type (every input float32, float16 or "
                                                            "bfloat16 as X) at enqueue");
                return -1;
            }
            if (volume(dims[0], 0, dims[0].nbDims) == 0)
            {
                return 0; // empty tensor: nothing to do
            }
            cudaError_t const status = Op::run(launch, inputs, nbInputs, outputs, dtype, mAttrs, stream);
            if (status != cudaSuccess)
            {
                logError(Op::kNAME, std::string("kernel launch failed: ") + cudaGetErrorString(status));
                return -1;
            }
            return 0;
        }
        catch (std::exception const& e)
        {
            logError(Op::kNAME, e.what());
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
        mDataToSerialize.emplace_back(Op::kEPSILON, &mAttrs.epsilon, nvinfer1::PluginFieldType::kFLOAT32, 1);
        if constexpr (Op::kHAS_AXIS)
        {
            mDataToSerialize.emplace_back(Op::kAXIS, &mAttrs.axis, nvinfer1::PluginFieldType::kINT32, 1);
        }
        if constexpr (Op::kHAS_MODULATION_AXIS)
        {
            mDataToSerialize.emplace_back(
                Op::kMODULATION_AXIS, &mAttrs.modulationAxis, nvinfer1::PluginFieldType::kINT32, 1);
        }
        if constexpr (kVARIADIC)
        {
            mDataToSerialize.emplace_back("nb_inputs", &mNbInputs, nvinfer1::PluginFieldType::kINT32, 1);
        }
        mFCToSerialize.nbFields = static_cast<int32_t>(mDataToSerialize.size());
        mFCToSerialize.fields = mDataToSerialize.data();
        return &mFCToSerialize;
    }

private:
    //! configurePlugin (Desc = DynamicPluginTensorDesc, dims may be -1) and onShapeChange
    //! (Desc = PluginTensorDesc): check the I/O counts and shapes and record the input count;
    //! 0 when fine, else logs and -1.
    template <typename Desc>
    int32_t checkAndRecordIO(Desc const* in, int32_t nbInputs, Desc const* out, int32_t nbOutputs) noexcept
    {
        try
        {
            if (in == nullptr || out == nullptr || nbOutputs != kNB_OUTPUTS || !validNbInputs(nbInputs))
            {
                std::string const counts = kVARIADIC
                    ? std::to_string(Op::kMIN_INPUTS) + " or " + std::to_string(Op::kMAX_INPUTS)
                    : std::to_string(Op::kMIN_INPUTS);
                logError(Op::kNAME, "expects " + counts + " inputs and " + std::to_string(kNB_OUTPUTS)
                        + (kNB_OUTPUTS == 1 ? " output: " : " outputs: ") + Op::kSIGNATURE);
                return -1;
            }
            nvinfer1::Dims dims[Op::kMAX_INPUTS];
            for (int32_t i = 0; i < nbInputs; ++i)
            {
                dims[i] = dimsOf(in[i]);
            }
            std::string const err = Op::check(dims, nbInputs, mAttrs, nullptr);
            if (!err.empty())
            {
                logError(Op::kNAME, err);
                return -1;
            }
            mNbInputs = nbInputs;
            return 0;
        }
        catch (std::exception const& e)
        {
            logError(Op::kNAME, e.what());
        }
        return -1;
    }

    NormAttrs mAttrs;
    int32_t mNbInputs;
    std::vector<nvinfer1::PluginField> mDataToSerialize;
    nvinfer1::PluginFieldCollection mFCToSerialize{};
};

template <typename Op>
class NormPluginCreator : public nvinfer1::IPluginCreatorV3One
{

public:
    NormPluginCreator()
    {
        mPluginAttributes.emplace_back(Op::kEPSILON, nullptr, nvinfer1::PluginFieldType::kFLOAT32, 1);
        if constexpr (Op::kHAS_AXIS)
        {
            mPluginAttributes.emplace_back(Op::kAXIS, nullptr, nvinfer1::PluginFieldType::kINT32, 1);
        }
        if constexpr (Op::kHAS_MODULATION_AXIS)
        {
            mPluginAttributes.emplace_back(Op::kMODULATION_AXIS, nullptr, nvinfer1::PluginFieldType::kINT32, 1);
        }
        mFC.nbFields = static_cast<int32_t>(mPluginAttributes.size());
        mFC.fields = mPluginAttributes.data();
    }
    ~NormPluginCreator() override = default;

    char const* getPluginName() const noexcept override
    {
        return Op::kNAME;
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
            NormAttrs attrs{Op::kEPSILON_DEFAULT, 0, 0};
            int64_t axis = 0;
            if constexpr (Op::kHAS_AXIS)
            {
                axis = Op::kAXIS_DEFAULT;
            }
            int64_t modulationAxis = 0;
            if constexpr (Op::kHAS_MODULATION_AXIS)
            {
                modulationAxis = Op::kMODULATION_AXIS_DEFAULT;
            }
            int64_t nbInputs = 0;
            for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
            {
                nvinfer1::PluginField const& f = fc->fields[i];
                if (fieldIs(f, Op::kEPSILON) && !readFloatField(f, attrs.epsilon))
                {
                    logError(Op::kNAME, std::string("field '") + Op::kEPSILON + "' must be a float32/float64 scalar");
                    return nullptr;
                }
                if constexpr (Op::kHAS_AXIS)
                {
                    if (fieldIs(f, Op::kAXIS) && (!readIntField(f, axis) || axis < -8 || axis > 8))
                    {
                        logError(Op::kNAME, std::string("field '") + Op::kAXIS
                                + "' must be an integer scalar in [-8, 8]");
                        return nullptr;
                    }
                }
                if constexpr (Op::kHAS_MODULATION_AXIS)
                {
                    // (checked against X's rank by the op's check(): at most rank - 2)
                    if (fieldIs(f, Op::kMODULATION_AXIS)
                        && (!readIntField(f, modulationAxis) || modulationAxis < 0
                            || modulationAxis > nvinfer1::Dims::MAX_DIMS - 2))
                    {
                        logError(Op::kNAME, std::string("field '") + Op::kMODULATION_AXIS
                                + "' must be an integer scalar in [0, " + std::to_string(nvinfer1::Dims::MAX_DIMS - 2)
                                + "]");
                        return nullptr;
                    }
                }
                // Serialised by getFieldsToSerialize (absent when the plugin comes from an ONNX node).
                if (fieldIs(f, "nb_inputs")
                    && (!readIntField(f, nbInputs) || (nbInputs != 0 && !NormPlugin<Op>::validNbInputs(nbInputs))))
                {
                    logError(Op::kNAME, std::string("field 'nb_inputs' must be ") + std::to_string(Op::kMIN_INPUTS)
                            + " or " + std::to_string(Op::kMAX_INPUTS));
                    return nullptr;
                }
                // Other fields (the ONNX parser's plugin_version / plugin_namespace) are ignored.
            }
            if (!(attrs.epsilon >= 0.F))
            {
                logError(Op::kNAME, "epsilon must be >= 0");
                return nullptr;
            }
            attrs.axis = static_cast<int32_t>(axis);
            attrs.modulationAxis = static_cast<int32_t>(modulationAxis);
            return new NormPlugin<Op>(attrs, static_cast<int32_t>(nbInputs));
        }
        catch (std::exception const& e)
        {
            logError(Op::kNAME, e.what());
        }
        return nullptr;
    }

private:
    std::vector<nvinfer1::PluginField> mPluginAttributes;
    nvinfer1::PluginFieldCollection mFC{};
};

} // namespace plugin
} // namespace normexport
