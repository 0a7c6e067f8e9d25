/*
 * Shared helpers of the normexport TensorRT plugins (IPluginV3 generation, TensorRT 10).
 * Only the plugin glue includes TensorRT headers; the kernels are reached through
 * normexport_kernels.h.
 */
#pragma once

#include "NvInferRuntime.h"
#include "normexport_kernels.h"
#include "opSpecs.h"

#include <cstdint>
#include <cstring>
#include <string>

namespace normexport
{
namespace plugin
{

// Names, fields and defaults come from opSpecs.h, generated from the op specs (normexport/ops/).
constexpr char const* kPLUGIN_NAMESPACE{spec::kNAMESPACE};
constexpr char const* kPLUGIN_VERSION{spec::kVERSION};

//! Logger handed over by TensorRT through setLoggerFinder() (may be null).
void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;
//! Log an error through TensorRT's logger when one is available.
void logError(char const* pluginName, std::string const& msg) noexcept;

//! TensorRT data type -> normexport_dtype; -1 when unsupported.
inline int32_t toKernelDtype(nvinfer1::DataType t) noexcept
{
    switch (t)
    {
    case nvinfer1::DataType::kFLOAT: return NORMEXPORT_FLOAT32;
    case nvinfer1::DataType::kHALF: return NORMEXPORT_FLOAT16;
    case nvinfer1::DataType::kBF16: return NORMEXPORT_BFLOAT16;
    default: return -1;
    }
}

//! Linear layout, float32/float16/bfloat16, every tensor the type of input 0.
inline bool supportsLinearSameType(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut) noexcept
{
    nvinfer1::PluginTensorDesc const& d = inOut[pos].desc;
    if (d.format != nvinfer1::TensorFormat::kLINEAR || toKernelDtype(d.type) < 0)
    {
        return false;
    }
    return pos == 0 || d.type == inOut[0].desc.type;
}

//! Dims of a build-time (configurePlugin) or runtime (onShapeChange) tensor description, so that one
//! template can validate both.
inline nvinfer1::Dims const& dimsOf(nvinfer1::DynamicPluginTensorDesc const& d) noexcept
{
    return d.desc.dims;
}
inline nvinfer1::Dims const& dimsOf(nvinfer1::PluginTensorDesc const& d) noexcept
{
    return d.dims;
}

//! Product of dims [begin, end); -1 if any of them is unknown (< 0).
inline int64_t volume(nvinfer1::Dims const& dims, int32_t begin, int32_t end) noexcept
{
    int64_t v = 1;
    for (int32_t i = begin; i < end; ++i)
    {
        if (dims.d[i] < 0)
        {
            return -1;
        }
        v *= dims.d[i];
    }
    return v;
}

//! Read a scalar float field of any floating width (the ONNX parser passes FLOAT attributes as
//! kFLOAT32; kFLOAT64 is accepted for API users).
inline bool readFloatField(nvinfer1::PluginField const& f, float& out) noexcept
{
    if (f.data == nullptr || f.length < 1)
    {
        return false;
    }
    switch (f.type)
    {
    case nvinfer1::PluginFieldType::kFLOAT32: out = *static_cast<float const*>(f.data); return true;
    case nvinfer1::PluginFieldType::kFLOAT64: out = static_cast<float>(*static_cast<double const*>(f.data)); return true;
    default: return false;
    }
}

//! Read a scalar integer field of any integer width (kINT32 from the ONNX parser).
inline bool readIntField(nvinfer1::PluginField const& f, int64_t& out) noexcept
{
    if (f.data == nullptr || f.length < 1)
    {
        return false;
    }
    switch (f.type)
    {
    case nvinfer1::PluginFieldType::kINT8: out = *static_cast<int8_t const*>(f.data); return true;
    case nvinfer1::PluginFieldType::kINT16: out = *static_cast<int16_t const*>(f.data); return true;
    case nvinfer1::PluginFieldType::kINT32: out = *static_cast<int32_t const*>(f.data); return true;
    case nvinfer1::PluginFieldType::kINT64: out = *static_cast<int64_t const*>(f.data); return true;
    default: return false;
    }
}

inline bool fieldIs(nvinfer1::PluginField const& f, char const* name) noexcept
{
    return f.name != nullptr && std::strcmp(f.name, name) == 0;
}

} // namespace plugin
} // namespace normexport
