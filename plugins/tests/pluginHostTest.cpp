/*
 * Host-side test of libnormexport_plugins.so, driven the way TensorRT drives a plugin library:
 *
 *   dlopen -> setLoggerFinder -> getCreators -> IPluginCreatorV3One::createPlugin (fields as the
 *   ONNX parser passes them) -> IPluginV3::getCapabilityInterface(kCORE / kBUILD / kRUNTIME) ->
 *   build-time calls (getOutputDataTypes, getOutputShapes, supportsFormatCombination,
 *   configurePlugin) -> getFieldsToSerialize -> createPlugin(kRUNTIME) from those fields (engine
 *   deserialisation) -> attachToContext -> onShapeChange -> enqueue.
 *
 * enqueue runs the CUDA kernels on real device buffers (compared with a float64 reference) when a
 * CUDA device is present; without one it checks that the launch failure is reported (-1 and a
 * logged error), not swallowed. Built with -DNORMEXPORT_HOST_TEST_EMULATED against a plugin
 * library whose kernels are the CPU emulation (tests/cuda_emu), enqueue runs those on host
 * memory instead. No TensorRT library is needed: only its headers.
 *
 * Usage: normexport_plugin_host_test path/to/libnormexport_plugins.so
 * Prints one PASS/FAIL line per check and a summary; exit code 0 only when every check passed.
 */
#include "NvInferRuntime.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace
{

int gFailures = 0;
int gChecks = 0;

void check(bool ok, std::string const& what)
{
    ++gChecks;
    if (!ok)
    {
        ++gFailures;
    }
    std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
}

//! Collects what the plugin logs, as TensorRT's logger would receive it.
class RecordingLogger : public ILogger
{
public:
    void log(Severity severity, AsciiChar const* msg) noexcept override
    {
        if (severity <= Severity::kERROR)
        {
            errors.emplace_back(msg);
        }
    }
    //! True when the last logged error contains `part`; clears the log.
    bool lastErrorHas(char const* part)
    {
        bool const found = !errors.empty() && errors.back().find(part) != std::string::npos;
        if (!found && !errors.empty())
        {
            std::printf("     last logged error: %s\n", errors.back().c_str());
        }
        errors.clear();
        return found;
    }
    std::vector<std::string> errors;
};

class Finder : public ILoggerFinder
{
public:
    explicit Finder(ILogger* logger)
        : mLogger(logger)
    {
    }
    ILogger* findLogger() override
    {
        return mLogger;
    }

private:
    ILogger* mLogger;
};

//! getOutputShapes receives an IExprBuilder; the normexport plugins copy the input shape and never
//! call it. This one has no implementation behind it.
class NoExprBuilder : public IExprBuilder
{
public:
    NoExprBuilder()
    {
        mImpl = nullptr;
    }
};

//! Distinct dimension expressions for DimsExprs (only their identity is looked at).
class NoDimExpr : public IDimensionExpr
{
public:
    NoDimExpr()
    {
        mImpl = nullptr;
    }
};

Dims makeDims(std::vector<int64_t> const& d)
{
    Dims out{};
    out.nbDims = static_cast<int32_t>(d.size());
    for (size_t i = 0; i < d.size(); ++i)
    {
        out.d[i] = d[i];
    }
    return out;
}

PluginTensorDesc desc(std::vector<int64_t> const& d, DataType type = DataType::kFLOAT,
    TensorFormat format = TensorFormat::kLINEAR)
{
    PluginTensorDesc out{};
    out.dims = makeDims(d);
    out.type = type;
    out.format = format;
    out.scale = 1.F;
    return out;
}

DynamicPluginTensorDesc dyn(std::vector<int64_t> const& d, DataType type = DataType::kFLOAT,
    TensorFormat format = TensorFormat::kLINEAR)
{
    DynamicPluginTensorDesc out{};
    out.desc = desc(d, type, format);
    out.min = out.desc.dims;
    out.max = out.desc.dims;
    out.opt = out.desc.dims;
    return out;
}

template <typename T>
T const* fieldData(PluginFieldCollection const* fc, char const* name, PluginFieldType type)
{
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
    {
        PluginField const& f = fc->fields[i];
        if (f.name != nullptr && std::strcmp(f.name, name) == 0 && f.type == type && f.length == 1)
        {
            return static_cast<T const*>(f.data);
        }
    }
    return nullptr;
}

struct Capabilities
{
    IPluginV3OneCore* core;
    IPluginV3OneBuild* build;
    IPluginV3OneRuntime* runtime;
};

Capabilities capabilities(IPluginV3* plugin)
{
    return {static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE)),
        static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD)),
        static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME))};
}

void checkInterface(IVersionedInterface const* itf, char const* kind, std::string const& who)
{
    InterfaceInfo const info = itf->getInterfaceInfo();
    check(info.kind != nullptr && std::strcmp(info.kind, kind) == 0 && info.major == 1,
        who + " interface is " + kind + " v1 (got " + (info.kind ? info.kind : "null") + " v"
            + std::to_string(info.major) + ")");
}

// ---------------------------------------------------------------------------------------------
// Memory the kernels work on: device memory, or host memory when the plugin library was built
// with the CPU-emulated kernels (tests/cuda_emu, NORMEXPORT_HOST_TEST_EMULATED).
// ---------------------------------------------------------------------------------------------
#ifdef NORMEXPORT_HOST_TEST_EMULATED
constexpr char const* kWHERE = "emulated kernels";
bool hasDevice()
{
    return true;
}
bool synchronize()
{
    return true;
}
struct DeviceBuffer
{
    explicit DeviceBuffer(std::vector<float> const& host)
        : data(host)
        , ptr(data.data())
    {
    }
    std::vector<float> read() const
    {
        return data;
    }
    std::vector<float> data;
    void* ptr;
};
#else
constexpr char const* kWHERE = "the GPU";
bool hasDevice()
{
    int32_t n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
bool synchronize()
{
    return cudaStreamSynchronize(nullptr) == cudaSuccess;
}
struct DeviceBuffer
{
    explicit DeviceBuffer(std::vector<float> const& host)
    {
        bytes = host.size() * sizeof(float);
        if (cudaMalloc(&ptr, bytes) != cudaSuccess
            || cudaMemcpy(ptr, host.data(), bytes, cudaMemcpyHostToDevice) != cudaSuccess)
        {
            ptr = nullptr;
        }
    }
    ~DeviceBuffer()
    {
        cudaFree(ptr);
    }
    DeviceBuffer(DeviceBuffer const&) = delete;
    DeviceBuffer& operator=(DeviceBuffer const&) = delete;
    std::vector<float> read() const
    {
        std::vector<float> out(bytes / sizeof(float));
        if (ptr == nullptr || cudaMemcpy(out.data(), ptr, bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
        {
            out.assign(out.size(), NAN);
        }
        return out;
    }
    void* ptr{nullptr};
    size_t bytes{0};
};
#endif

int64_t product(std::vector<int64_t> const& d, size_t begin, size_t end)
{
    int64_t v = 1;
    for (size_t i = begin; i < end; ++i)
    {
        v *= d[i];
    }
    return v;
}

std::string sci(double v)
{
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.2e", v);
    return buf;
}

std::string shapeString(std::vector<int64_t> const& d)
{
    std::string s = "[";
    for (size_t i = 0; i < d.size(); ++i)
    {
        s += (i ? "," : "") + std::to_string(d[i]);
    }
    return s + "]";
}

std::vector<float> pattern(size_t n, float a, float b)
{
    // Deterministic, non-trivial values (no RNG state to share with the Python side).
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i)
    {
        v[i] = a * std::sin(0.37F * static_cast<float>(i) + b) + 0.1F * b;
    }
    return v;
}

double maxRelErr(std::vector<float> const& got, std::vector<double> const& ref)
{
    double worst = 0.0;
    double scale = 1e-30;
    for (double r : ref)
    {
        scale = std::max(scale, std::fabs(r));
    }
    for (size_t i = 0; i < ref.size(); ++i)
    {
        double const e = std::fabs(static_cast<double>(got[i]) - ref[i]) / scale;
        worst = std::isnan(e) ? INFINITY : std::max(worst, e);
    }
    return worst;
}

//! Engine deserialisation: a runtime plugin made from `serialised` (createPlugin(kRUNTIME)), then
//! attached to an execution context. Checks both steps; nullptr when one fails.
IPluginV3* deserialiseAndAttach(
    IPluginCreatorV3One* creator, char const* name, PluginFieldCollection const* serialised, std::string const& who)
{
    IPluginV3* runtimePlugin = creator->createPlugin(name, serialised, TensorRTPhase::kRUNTIME);
    check(runtimePlugin != nullptr, who + " createPlugin(kRUNTIME) from its serialised fields");
    if (runtimePlugin == nullptr)
    {
        return nullptr;
    }
    IPluginV3* attached = capabilities(runtimePlugin).runtime->attachToContext(nullptr);
    delete runtimePlugin;
    check(attached != nullptr, who + " attachToContext gives a plugin");
    return attached;
}

//! The creator's version and field names, then createPlugin(kBUILD) from `fc` (fields as
//! TensorRT's ONNX parser passes a node's attributes) with its interfaces, name and namespace;
//! checks each step. The plugin and its capabilities, or nullptr (plugin deleted) when a step fails.
IPluginV3* createBuildPlugin(IPluginCreatorV3One* creator, PluginFieldCollection const* fc, std::string const& who,
    std::vector<std::string> const& fieldNames, Capabilities& caps)
{
    check(std::strcmp(creator->getPluginVersion(), "1") == 0, who + " creator version is \"1\"");
    PluginFieldCollection const* names = creator->getFieldNames();
    bool namesOk = names != nullptr && names->nbFields == static_cast<int32_t>(fieldNames.size());
    std::string listed;
    for (size_t i = 0; namesOk && i < fieldNames.size(); ++i)
    {
        namesOk = fieldNames[i] == names->fields[i].name;
        listed += (i ? ", " : "") + fieldNames[i];
    }
    check(namesOk, who + " creator lists fields " + listed);
    IPluginV3* plugin = creator->createPlugin("build0", fc, TensorRTPhase::kBUILD);
    check(plugin != nullptr, who + " createPlugin(kBUILD) from ONNX-parser fields");
    if (plugin == nullptr)
    {
        return nullptr;
    }
    checkInterface(plugin, "PLUGIN", who + " plugin");
    caps = capabilities(plugin);
    check(caps.core && caps.build && caps.runtime, who + " has core, build and runtime capabilities");
    if (!(caps.core && caps.build && caps.runtime))
    {
        delete plugin;
        return nullptr;
    }
    checkInterface(caps.core, "PLUGIN_V3ONE_CORE", who + " core");
    checkInterface(caps.build, "PLUGIN_V3ONE_BUILD", who + " build");
    checkInterface(caps.runtime, "PLUGIN_V3ONE_RUNTIME", who + " runtime");
    check(std::strcmp(caps.core->getPluginName(), who.c_str()) == 0
            && std::strcmp(caps.core->getPluginNamespace(), "normexport") == 0,
        who + " core name/namespace");
    return plugin;
}

// ---------------------------------------------------------------------------------------------
// enqueue numerics: a runtime plugin made from fields (as at engine deserialisation), shapes
// given through onShapeChange, enqueue on device buffers, compared with float64.
// ---------------------------------------------------------------------------------------------
enum class Mod
{
    kFull,   // shift/scale (and gate) of X's shape
    kRowsOfB, // [B, H], B = X's dim modulation_axis (0 unless given), broadcast over the other dims
    kOneRow  // [1, H], one row for all of X
};

char const* modName(Mod mod)
{
    return mod == Mod::kFull ? "full" : mod == Mod::kRowsOfB ? "[B,H]" : "[1,H]";
}

//! The shape of the modulation tensors for an X of `shape` ([B, H]: B its dim `axis`).
std::vector<int64_t> modShape(std::vector<int64_t> const& shape, Mod mod, int32_t axis = 0)
{
    return mod == Mod::kFull ? shape
        : mod == Mod::kRowsOfB ? std::vector<int64_t>{shape[static_cast<size_t>(axis)], shape.back()}
                               : std::vector<int64_t>{1, shape.back()};
}

//! The modulation row of row `r` of X ([B, H] of X's dim `axis`: the row's index along that dim,
//! (r / inner) % B with `inner` the product of the dims after it but the last; for axis 0 the rows
//! of one batch share one).
int64_t modRow(Mod mod, int64_t r, int64_t inner, int64_t batch)
{
    return mod == Mod::kFull ? r : mod == Mod::kRowsOfB ? (r / inner) % batch : 0;
}

std::vector<double> toDouble(std::vector<float> const& v)
{
    return std::vector<double>(v.begin(), v.end());
}

//! float64 RMSNorm of each row of `hidden` values, from the formula: x / sqrt(mean(x^2) + eps) * scale.
std::vector<double> refRmsNorm(std::vector<double> const& x, int64_t hidden, std::vector<float> const& scale, double eps)
{
    std::vector<double> y(x.size());
    for (size_t base = 0; base < x.size(); base += static_cast<size_t>(hidden))
    {
        double ss = 0.0;
        for (int64_t j = 0; j < hidden; ++j)
        {
            ss += x[base + j] * x[base + j];
        }
        double const rstd = 1.0 / std::sqrt(ss / static_cast<double>(hidden) + eps);
        for (int64_t j = 0; j < hidden; ++j)
        {
            y[base + j] = x[base + j] * rstd * scale[j];
        }
    }
    return y;
}

//! float64 AdaLN-Zero of each row of `hidden` values, from the formula:
//! LayerNorm(x; weight, bias, eps) * (1 + scale) + shift (weight and bias empty: no affine).
std::vector<double> refAdaLNZero(std::vector<double> const& x, int64_t hidden, Mod mod, int64_t inner, int64_t batch,
    std::vector<float> const& shift, std::vector<float> const& scale, std::vector<float> const& weight,
    std::vector<float> const& bias, double eps)
{
    std::vector<double> y(x.size());
    for (int64_t r = 0; r * hidden < static_cast<int64_t>(x.size()); ++r)
    {
        double const* row = x.data() + r * hidden;
        double mean = 0.0;
        for (int64_t j = 0; j < hidden; ++j)
        {
            mean += row[j];
        }
        mean /= static_cast<double>(hidden);
        double var = 0.0;
        for (int64_t j = 0; j < hidden; ++j)
        {
            var += (row[j] - mean) * (row[j] - mean);
        }
        double const rstd = 1.0 / std::sqrt(var / static_cast<double>(hidden) + eps);
        int64_t const m = modRow(mod, r, inner, batch) * hidden;
        for (int64_t j = 0; j < hidden; ++j)
        {
            double ln = (row[j] - mean) * rstd;
            if (!weight.empty())
            {
                ln = ln * weight[j] + bias[j];
            }
            y[r * hidden + j] = ln * (1.0 + scale[m + j]) + shift[m + j];
        }
    }
    return y;
}

//! enqueue of a runtime plugin made from `fields` (as at engine deserialisation) on device
//! buffers holding `inputs` (of `shapes`), after onShapeChange; `nbOutputs` outputs of X's shape.
//! `ok`: every step succeeded; `outputs` read back (empty, with a failed check, when no plugin).
struct Enqueued
{
    bool ok{false};
    std::vector<std::vector<float>> outputs;
};

Enqueued enqueueOnDevice(IPluginCreatorV3One* creator, std::vector<PluginField> fields,
    std::vector<std::vector<int64_t>> const& shapes, std::vector<std::vector<float>> const& inputs, int32_t nbOutputs,
    std::string const& what)
{
    Enqueued result;
    PluginFieldCollection fc{static_cast<int32_t>(fields.size()), fields.data()};
    IPluginV3* plugin = creator->createPlugin("enqueue", &fc, TensorRTPhase::kRUNTIME);
    if (plugin == nullptr)
    {
        check(false, what + ": no plugin");
        return result;
    }
    int32_t const nbInputs = static_cast<int32_t>(inputs.size());
    std::vector<PluginTensorDesc> in;
    for (auto const& s : shapes)
    {
        in.push_back(desc(s));
    }
    std::vector<PluginTensorDesc> out(nbOutputs, desc(shapes[0]));
    std::vector<std::unique_ptr<DeviceBuffer>> buffers;
    std::vector<void const*> ins;
    std::vector<void*> outs;
    for (auto const& v : inputs)
    {
        buffers.push_back(std::make_unique<DeviceBuffer>(v));
        ins.push_back(buffers.back()->ptr);
    }
    for (int32_t o = 0; o < nbOutputs; ++o)
    {
        buffers.push_back(std::make_unique<DeviceBuffer>(std::vector<float>(inputs[0].size(), 0.F)));
        outs.push_back(buffers.back()->ptr);
    }
    IPluginV3OneRuntime* rt = capabilities(plugin).runtime;
    int32_t const shaped = rt->onShapeChange(in.data(), nbInputs, out.data(), nbOutputs);
    int32_t const rc = rt->enqueue(in.data(), out.data(), ins.data(), outs.data(), nullptr, nullptr);
    result.ok = shaped == 0 && rc == 0 && synchronize();
    for (int32_t o = 0; o < nbOutputs; ++o)
    {
        result.outputs.push_back(buffers[nbInputs + o]->read());
    }
    delete plugin;
    return result;
}

void checkRMSNormEnqueue(IPluginCreatorV3One* creator, std::vector<int64_t> const& shape, int32_t axis)
{
    float const eps = 1e-5F;
    std::string const what = std::string("RMSNorm enqueue on ") + kWHERE + " " + shapeString(shape) + " axis "
        + std::to_string(axis);
    size_t const first = static_cast<size_t>(axis < 0 ? axis + static_cast<int32_t>(shape.size()) : axis);
    int64_t const hidden = product(shape, first, shape.size());
    std::vector<int64_t> const scaleShape(shape.begin() + static_cast<std::ptrdiff_t>(first), shape.end());
    std::vector<float> const x = pattern(product(shape, 0, shape.size()), 2.0F, 0.3F);
    std::vector<float> const w = pattern(hidden, 0.5F, 1.7F);
    Enqueued const run = enqueueOnDevice(creator,
        {{"epsilon", &eps, PluginFieldType::kFLOAT32, 1}, {"axis", &axis, PluginFieldType::kINT32, 1}},
        {shape, scaleShape}, {x, w}, 1, what);
    if (run.outputs.empty())
    {
        return;
    }
    double const err = maxRelErr(run.outputs[0], refRmsNorm(toDouble(x), hidden, w, eps));
    check(run.ok && err < 1e-5, what + " matches float64 (max rel err " + sci(err) + ")");
}

//! AdaLNZero, or with `gated` GatedAdaLNZero (the AdaLN-Zero of Sum = X + gate * update, Sum its
//! second output), enqueued with modulation `mod` and with / without the affine inputs; a [B, H]
//! modulation follows X's dim `axis` (the modulation_axis field, passed when not 0 as the ONNX
//! parser passes a node's attributes).
void checkAdaLNEnqueue(IPluginCreatorV3One* creator, std::vector<int64_t> const& shape, Mod mod, bool affine, bool gated,
    int32_t axis = 0)
{
    float const eps = 1e-6F;
    int32_t const nbInputs = (gated ? 5 : 3) + (affine ? 2 : 0);
    std::string const what = std::string(gated ? "GatedAdaLNZero" : "AdaLNZero") + " enqueue on " + kWHERE + " "
        + shapeString(shape) + " modulation " + modName(mod) + (affine ? " affine" : "")
        + (axis != 0 ? " modulation_axis " + std::to_string(axis) : std::string());
    int64_t const hidden = shape.back();
    size_t const a = mod == Mod::kRowsOfB ? static_cast<size_t>(axis) : 0;
    int64_t const inner = product(shape, a + 1, shape.size() - 1);
    int64_t const batch = shape[a];
    std::vector<int64_t> const mshape = modShape(shape, mod, axis);
    std::vector<float> const x = pattern(product(shape, 0, shape.size()), 3.0F, 0.1F);
    std::vector<float> const upd = pattern(x.size(), 1.0F, 1.1F);
    std::vector<float> const gate = pattern(product(mshape, 0, mshape.size()), 0.8F, 0.4F);
    std::vector<float> const shift = pattern(gate.size(), 0.4F, 2.2F);
    std::vector<float> const scale = pattern(gate.size(), 0.3F, 0.9F);
    std::vector<float> const w = affine ? pattern(hidden, 0.7F, 1.3F) : std::vector<float>{};
    std::vector<float> const b = affine ? pattern(hidden, 0.2F, 0.5F) : std::vector<float>{};
    std::vector<std::vector<float>> inputs = {x};
    std::vector<std::vector<int64_t>> shapes = {shape};
    if (gated)
    {
        inputs.insert(inputs.end(), {upd, gate});
        shapes.insert(shapes.end(), {shape, mshape});
    }
    inputs.insert(inputs.end(), {shift, scale});
    shapes.insert(shapes.end(), {mshape, mshape});
    if (affine)
    {
        inputs.insert(inputs.end(), {w, b});
        shapes.insert(shapes.end(), {{hidden}, {hidden}});
    }
    std::vector<PluginField> fields
        = {{"epsilon", &eps, PluginFieldType::kFLOAT32, 1}, {"nb_inputs", &nbInputs, PluginFieldType::kINT32, 1}};
    if (axis != 0)
    {
        fields.push_back({"modulation_axis", &axis, PluginFieldType::kINT32, 1});
    }
    Enqueued const run = enqueueOnDevice(creator, fields, shapes, inputs, gated ? 2 : 1, what);
    if (run.outputs.empty())
    {
        return;
    }
    std::vector<double> sum = toDouble(x);
    for (size_t i = 0; gated && i < x.size(); ++i)
    {
        int64_t const r = static_cast<int64_t>(i) / hidden;
        int64_t const j = static_cast<int64_t>(i) % hidden;
        sum[i] += static_cast<double>(gate[modRow(mod, r, inner, batch) * hidden + j]) * upd[i];
    }
    std::vector<double> const ref = refAdaLNZero(sum, hidden, mod, inner, batch, shift, scale, w, b, eps);
    double const errY = maxRelErr(run.outputs[0], ref);
    double const errS = gated ? maxRelErr(run.outputs[1], sum) : 0.0;
    check(run.ok && errY < 1e-5 && errS < 1e-6,
        what + " matches float64 (Y " + sci(errY) + (gated ? ", Sum " + sci(errS) : std::string()) + ")");
}

void checkSkipRMSNormEnqueue(IPluginCreatorV3One* creator, std::vector<int64_t> const& shape, bool bias)
{
    float const eps = 1e-5F;
    int32_t const nbInputs = bias ? 4 : 3;
    std::string const what = std::string("SkipRMSNorm enqueue on ") + kWHERE + " " + shapeString(shape) + (bias ? " bias" : "");
    int64_t const hidden = shape.back();
    std::vector<float> const x = pattern(product(shape, 0, shape.size()), 2.0F, 0.3F);
    std::vector<float> const skip = pattern(x.size(), 1.5F, 2.1F);
    std::vector<float> const w = pattern(hidden, 0.5F, 1.7F);
    std::vector<float> const b = pattern(hidden, 0.4F, 0.6F);
    std::vector<std::vector<float>> inputs = {x, skip, w};
    std::vector<std::vector<int64_t>> shapes = {shape, shape, {hidden}};
    if (bias)
    {
        inputs.push_back(b);
        shapes.push_back({hidden});
    }
    Enqueued const run = enqueueOnDevice(creator,
        {{"epsilon", &eps, PluginFieldType::kFLOAT32, 1}, {"nb_inputs", &nbInputs, PluginFieldType::kINT32, 1}},
        shapes, inputs, 2, what);
    if (run.outputs.empty())
    {
        return;
    }
    std::vector<double> sum(x.size());
    for (size_t i = 0; i < x.size(); ++i)
    {
        sum[i] = static_cast<double>(x[i]) + skip[i] + (bias ? b[i % hidden] : 0.0);
    }
    double const errY = maxRelErr(run.outputs[0], refRmsNorm(sum, hidden, w, eps));
    double const errS = maxRelErr(run.outputs[1], sum);
    check(run.ok && errY < 1e-5 && errS < 1e-6, what + " matches float64 (Y " + sci(errY) + ", Sum " + sci(errS) + ")");
}

// ---------------------------------------------------------------------------------------------
// RMSNorm
// ---------------------------------------------------------------------------------------------
void testRMSNorm(IPluginCreatorV3One* creator, RecordingLogger& log, bool device)
{
    std::string const who = "RMSNorm";
    // Fields as TensorRT's ONNX parser passes an ONNX node's attributes (float -> kFLOAT32,
    // int -> kINT32), plus the parser's own plugin_namespace string.
    float const eps = 1e-5F;
    int32_t const axis = -1;
    char const ns[] = "normexport";
    PluginField fields[] = {{"epsilon", &eps, PluginFieldType::kFLOAT32, 1},
        {"axis", &axis, PluginFieldType::kINT32, 1}, {"plugin_namespace", ns, PluginFieldType::kCHAR, 10}};
    PluginFieldCollection fc{3, fields};
    Capabilities caps{};
    IPluginV3* plugin = createBuildPlugin(creator, &fc, who, {"epsilon", "axis"}, caps);
    if (plugin == nullptr)
    {
        return;
    }

    // Build phase.
    check(caps.build->getNbOutputs() == 1, who + " has one output");
    DataType inTypes[2] = {DataType::kHALF, DataType::kHALF};
    DataType outType = DataType::kFLOAT;
    check(caps.build->getOutputDataTypes(&outType, 1, inTypes, 2) == 0 && outType == DataType::kHALF,
        who + " output dtype follows X (float16)");
    NoExprBuilder exprBuilder;
    NoDimExpr dimExprs[3];
    DimsExprs inShapes[2]{};
    inShapes[0].nbDims = 3;
    for (int32_t i = 0; i < 3; ++i)
    {
        inShapes[0].d[i] = &dimExprs[i];
    }
    inShapes[1].nbDims = 1;
    inShapes[1].d[0] = &dimExprs[2];
    DimsExprs outShape{};
    check(caps.build->getOutputShapes(inShapes, 2, nullptr, 0, &outShape, 1, exprBuilder) == 0 && outShape.nbDims == 3
            && outShape.d[0] == &dimExprs[0] && outShape.d[1] == &dimExprs[1] && outShape.d[2] == &dimExprs[2],
        who + " output shape = input shape");

    for (DataType t : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16})
    {
        DynamicPluginTensorDesc io[3] = {dyn({2, 3, 64}, t), dyn({64}, t), dyn({2, 3, 64}, t)};
        bool all = true;
        for (int32_t pos = 0; pos < 3; ++pos)
        {
            all = all && caps.build->supportsFormatCombination(pos, io, 2, 1);
        }
        char const* name = t == DataType::kFLOAT ? "float32" : t == DataType::kHALF ? "float16" : "bfloat16";
        check(all, who + " supports linear " + name + " for every tensor");
    }
    {
        DynamicPluginTensorDesc io[3] = {dyn({2, 3, 64}, DataType::kINT8), dyn({64}), dyn({2, 3, 64})};
        check(!caps.build->supportsFormatCombination(0, io, 2, 1), who + " rejects int8");
        io[0] = dyn({2, 3, 64}, DataType::kFLOAT, TensorFormat::kCHW32);
        check(!caps.build->supportsFormatCombination(0, io, 2, 1), who + " rejects a non-linear format");
        io[0] = dyn({2, 3, 64});
        io[1] = dyn({64}, DataType::kHALF);
        check(!caps.build->supportsFormatCombination(1, io, 2, 1), who + " rejects scale of another dtype than X");
    }
    {
        DynamicPluginTensorDesc in[2] = {dyn({-1, -1, 64}), dyn({64})};
        DynamicPluginTensorDesc out[1] = {dyn({-1, -1, 64})};
        check(caps.build->configurePlugin(in, 2, out, 1) == 0, who + " configurePlugin with dynamic batch/seq");
        in[1] = dyn({32});
        check(caps.build->configurePlugin(in, 2, out, 1) != 0 && log.lastErrorHas("scale has 32 elements"),
            who + " configurePlugin rejects scale [32] for hidden 64, with a logged reason");
        check(caps.build->getWorkspaceSize(in, 2, out, 1) == 0, who + " needs no workspace");
    }

    // Serialisation round trip (engine build -> engine deserialisation).
    PluginFieldCollection const* ser = caps.runtime->getFieldsToSerialize();
    float const* serEps = fieldData<float>(ser, "epsilon", PluginFieldType::kFLOAT32);
    int32_t const* serAxis = fieldData<int32_t>(ser, "axis", PluginFieldType::kINT32);
    check(serEps != nullptr && *serEps == eps && serAxis != nullptr && *serAxis == axis,
        who + " serialises epsilon and axis");
    IPluginV3* attached = deserialiseAndAttach(creator, "rms0", ser, who);
    delete plugin; // after deserialisation: `ser` points into it
    if (attached == nullptr)
    {
        return;
    }
    Capabilities rt = capabilities(attached);
    PluginFieldCollection const* again = rt.runtime->getFieldsToSerialize();
    check(fieldData<float>(again, "epsilon", PluginFieldType::kFLOAT32) != nullptr
            && *fieldData<float>(again, "epsilon", PluginFieldType::kFLOAT32) == eps,
        who + " epsilon survives serialise -> deserialise -> attach");

    // Runtime phase.
    int64_t const B = 2, S = 3, H = 64;
    PluginTensorDesc in[2] = {desc({B, S, H}), desc({H})};
    PluginTensorDesc out[1] = {desc({B, S, H})};
    check(rt.runtime->onShapeChange(in, 2, out, 1) == 0, who + " onShapeChange [2,3,64]");
    {
        PluginTensorDesc empty[2] = {desc({0, S, H}), desc({H})};
        PluginTensorDesc emptyOut[1] = {desc({0, S, H})};
        int32_t dummy = 0;
        void const* ins[2] = {&dummy, &dummy};
        void* outs[1] = {&dummy};
        check(rt.runtime->enqueue(empty, emptyOut, ins, outs, nullptr, nullptr) == 0,
            who + " enqueue of an empty tensor is a no-op");
        PluginTensorDesc bad[2] = {desc({B, S, H}, DataType::kINT8), desc({H}, DataType::kINT8)};
        check(rt.runtime->enqueue(bad, out, ins, outs, nullptr, nullptr) != 0
                && log.lastErrorHas("unsupported data type"),
            who + " enqueue rejects int8 with a logged reason");
        PluginTensorDesc mixed[2] = {desc({B, S, H}), desc({H}, DataType::kHALF)};
        check(rt.runtime->enqueue(mixed, out, ins, outs, nullptr, nullptr) != 0
                && log.lastErrorHas("unsupported data type"),
            who + " enqueue rejects a float16 scale for a float32 X with a logged reason");
    }
    if (device)
    {
        checkRMSNormEnqueue(creator, {B, S, H}, -1);
        checkRMSNormEnqueue(creator, {B, S, H}, -2); // normalise over the last two dims
        checkRMSNormEnqueue(creator, {5, 1000}, 1);  // positive axis
        checkRMSNormEnqueue(creator, {3, 37}, -1);   // odd hidden: scalar path
        checkRMSNormEnqueue(creator, {2, 4096}, -1); // one block per row
    }
    else
    {
        std::vector<float> x = pattern(B * S * H, 2.0F, 0.3F);
        std::vector<float> w = pattern(H, 0.5F, 1.7F);
        void const* ins[2] = {x.data(), w.data()};
        void* outs[1] = {x.data()};
        check(rt.runtime->enqueue(in, out, ins, outs, nullptr, nullptr) != 0 && log.lastErrorHas("kernel launch failed"),
            who + " enqueue without a CUDA device fails with a logged reason");
    }
    delete attached;

    // Bad fields: nullptr and a logged reason, never a plugin with a silent default.
    int32_t const intEps = 1;
    PluginField badEps[] = {{"epsilon", &intEps, PluginFieldType::kINT32, 1}};
    PluginFieldCollection badEpsFc{1, badEps};
    check(creator->createPlugin("r", &badEpsFc, TensorRTPhase::kBUILD) == nullptr && log.lastErrorHas("epsilon"),
        who + " rejects an int32 epsilon");
    float const negEps = -1.F;
    PluginField negEpsF[] = {{"epsilon", &negEps, PluginFieldType::kFLOAT32, 1}};
    PluginFieldCollection negEpsFc{1, negEpsF};
    check(creator->createPlugin("r", &negEpsFc, TensorRTPhase::kBUILD) == nullptr && log.lastErrorHas("epsilon"),
        who + " rejects epsilon < 0");
    int64_t const badAxis = 9;
    PluginField badAxisF[] = {{"axis", &badAxis, PluginFieldType::kINT64, 1}};
    PluginFieldCollection badAxisFc{1, badAxisF};
    check(creator->createPlugin("r", &badAxisFc, TensorRTPhase::kBUILD) == nullptr && log.lastErrorHas("axis"),
        who + " rejects axis 9");
    IPluginV3* defaults = creator->createPlugin("r", nullptr, TensorRTPhase::kBUILD);
    bool defaultsOk = false;
    if (defaults != nullptr)
    {
        PluginFieldCollection const* d = capabilities(defaults).runtime->getFieldsToSerialize();
        float const* e = fieldData<float>(d, "epsilon", PluginFieldType::kFLOAT32);
        int32_t const* a = fieldData<int32_t>(d, "axis", PluginFieldType::kINT32);
        defaultsOk = e != nullptr && *e == 1e-6F && a != nullptr && *a == -1;
        delete defaults;
    }
    check(defaultsOk, who + " defaults: epsilon 1e-6, axis -1 (the ONNX schema's)");
}

// ---------------------------------------------------------------------------------------------
// AdaLNZero
// ---------------------------------------------------------------------------------------------
//! The modulation_axis field of AdaLNZero / GatedAdaLNZero (`gated`): a [B, H] modulation whose B
//! is X's dim 1 (sequence-first X [S, B, H]) configures only with the field, the field is
//! serialised and read back, and an axis X's rank does not allow is refused with a logged reason.
void checkModulationAxis(IPluginCreatorV3One* creator, RecordingLogger& log, std::string const& who, bool gated)
{
    int64_t const S = 5, B = 3, H = 48;
    float const eps = 1e-6F;
    int32_t const axis = 1;
    int32_t const n = gated ? 5 : 3;
    std::vector<DynamicPluginTensorDesc> io(gated ? 7 : 4, dyn({B, H}));
    io[0] = dyn({S, B, H});
    if (gated)
    {
        io[1] = dyn({S, B, H});
    }
    for (int32_t o = n; o < static_cast<int32_t>(io.size()); ++o)
    {
        io[o] = dyn({S, B, H});
    }
    int32_t const nbOut = gated ? 2 : 1;
    {
        PluginField f[] = {{"epsilon", &eps, PluginFieldType::kFLOAT32, 1}};
        PluginFieldCollection fc{1, f};
        IPluginV3* plain = creator->createPlugin("mod0", &fc, TensorRTPhase::kBUILD);
        check(plain != nullptr && capabilities(plain).build->configurePlugin(io.data(), n, io.data() + n, nbOut) != 0
                && log.lastErrorHas("expected the shape of X"),
            who + " without modulation_axis rejects [B, H] of X [S, B, H]'s dim 1 (it follows dim 0)");
        delete plain;
    }
    PluginField f[] = {{"epsilon", &eps, PluginFieldType::kFLOAT32, 1}, {"modulation_axis", &axis, PluginFieldType::kINT32, 1}};
    PluginFieldCollection fc{2, f};
    IPluginV3* plugin = creator->createPlugin("mod1", &fc, TensorRTPhase::kBUILD);
    check(plugin != nullptr, who + " createPlugin with modulation_axis 1");
    if (plugin == nullptr)
    {
        return;
    }
    Capabilities caps = capabilities(plugin);
    check(caps.build->configurePlugin(io.data(), n, io.data() + n, nbOut) == 0,
        who + " modulation_axis 1: configurePlugin X [S, B, H] with [B, H] modulation");
    std::vector<DynamicPluginTensorDesc> wrong = io;
    wrong[n - 1] = dyn({S, H}); // scale [S, H]: rows of dim 0, not dim 1
    wrong[n - 2] = dyn({S, H});
    if (gated)
    {
        wrong[2] = dyn({S, H});
    }
    check(caps.build->configurePlugin(wrong.data(), n, wrong.data() + n, nbOut) != 0
            && log.lastErrorHas("(B: dim 1 of X)"),
        who + " modulation_axis 1 rejects [S, H] modulation, with a logged reason");
    std::vector<DynamicPluginTensorDesc> rank2 = io;
    rank2[0] = dyn({S * B, H});
    for (int32_t o = n; o < static_cast<int32_t>(rank2.size()); ++o)
    {
        rank2[o] = dyn({S * B, H});
    }
    if (gated)
    {
        rank2[1] = dyn({S * B, H});
    }
    check(caps.build->configurePlugin(rank2.data(), n, rank2.data() + n, nbOut) != 0
            && log.lastErrorHas("modulation_axis 1 is out of range"),
        who + " modulation_axis 1 rejects an X of rank 2, with a logged reason");
    check(caps.build->configurePlugin(io.data(), n, io.data() + n, nbOut) == 0, who + " configurePlugin again");
    PluginFieldCollection const* ser = caps.runtime->getFieldsToSerialize();
    int32_t const* serModAxis = fieldData<int32_t>(ser, "modulation_axis", PluginFieldType::kINT32);
    check(serModAxis != nullptr && *serModAxis == 1, who + " serialises modulation_axis 1");
    IPluginV3* again = creator->createPlugin("mod1rt", ser, TensorRTPhase::kRUNTIME);
    delete plugin;
    if (again != nullptr)
    {
        std::vector<PluginTensorDesc> in;
        for (auto const& d : io)
        {
            in.push_back(d.desc);
        }
        check(capabilities(again).runtime->onShapeChange(in.data(), n, in.data() + n, nbOut) == 0,
            who + " deserialised with modulation_axis 1 takes X [S, B, H] with [B, H] modulation");
        delete again;
    }
    else
    {
        check(false, who + " createPlugin(kRUNTIME) from fields with modulation_axis");
    }
    for (int32_t bad : {-1, 7})
    {
        PluginField bf[] = {{"modulation_axis", &bad, PluginFieldType::kINT32, 1}};
        PluginFieldCollection bfc{1, bf};
        check(creator->createPlugin("modbad", &bfc, TensorRTPhase::kBUILD) == nullptr
                && log.lastErrorHas("modulation_axis"),
            who + " rejects modulation_axis " + std::to_string(bad) + ", with a logged reason");
    }
}

void testAdaLNZero(IPluginCreatorV3One* creator, RecordingLogger& log, bool device)
{
    std::string const who = "AdaLNZero";
    float const eps = 1e-6F;
    PluginField fields[] = {{"epsilon", &eps, PluginFieldType::kFLOAT32, 1}};
    PluginFieldCollection fc{1, fields};
    Capabilities caps{};
    IPluginV3* plugin = createBuildPlugin(creator, &fc, who, {"epsilon", "modulation_axis"}, caps);
    if (plugin == nullptr)
    {
        return;
    }

    int64_t const B = 2, S = 5, H = 48;
    for (int32_t nbInputs : {3, 5})
    {
        std::string const tag = who + " (" + std::to_string(nbInputs) + " inputs)";
        DataType inTypes[5] = {DataType::kBF16, DataType::kBF16, DataType::kBF16, DataType::kBF16, DataType::kBF16};
        DataType outType = DataType::kFLOAT;
        check(caps.build->getOutputDataTypes(&outType, 1, inTypes, nbInputs) == 0 && outType == DataType::kBF16,
            tag + " output dtype follows X (bfloat16)");
        DynamicPluginTensorDesc io[6] = {dyn({-1, -1, H}), dyn({-1, H}), dyn({-1, H}), dyn({H}), dyn({H}), {}};
        io[nbInputs] = dyn({-1, -1, H});
        bool all = true;
        for (int32_t pos = 0; pos <= nbInputs; ++pos)
        {
            all = all && caps.build->supportsFormatCombination(pos, io, nbInputs, 1);
        }
        check(all, tag + " supports linear float32 for every tensor");
        check(caps.build->configurePlugin(io, nbInputs, &io[nbInputs], 1) == 0,
            tag + " configurePlugin, [B, H] modulation, dynamic batch/seq");
    }
    {
        DynamicPluginTensorDesc io[4] = {dyn({B, S, H}), dyn({B, S, H}), dyn({B, S, H}), dyn({B, S, H})};
        check(caps.build->configurePlugin(io, 3, &io[3], 1) == 0, who + " configurePlugin, full-shape modulation");
        io[2] = dyn({B, H});
        check(caps.build->configurePlugin(io, 3, &io[3], 1) != 0 && log.lastErrorHas("different layouts"),
            who + " rejects shift and scale of different layouts, with a logged reason");
        io[1] = dyn({B, H + 1});
        check(caps.build->configurePlugin(io, 3, &io[3], 1) != 0 && log.lastErrorHas("shift has shape"),
            who + " rejects shift [B, H+1], with a logged reason");
        check(caps.build->configurePlugin(io, 4, &io[3], 1) != 0 && log.lastErrorHas("3 or 5 inputs"),
            who + " rejects 4 inputs");
    }
    // Leave the build plugin configured with 5 inputs, then serialise.
    DynamicPluginTensorDesc io5[6] = {dyn({B, S, H}), dyn({B, H}), dyn({B, H}), dyn({H}), dyn({H}), dyn({B, S, H})};
    check(caps.build->configurePlugin(io5, 5, &io5[5], 1) == 0, who + " configurePlugin, 5 inputs");
    PluginFieldCollection const* ser = caps.runtime->getFieldsToSerialize();
    int32_t const* nb = fieldData<int32_t>(ser, "nb_inputs", PluginFieldType::kINT32);
    float const* serEps = fieldData<float>(ser, "epsilon", PluginFieldType::kFLOAT32);
    int32_t const* serModAxis = fieldData<int32_t>(ser, "modulation_axis", PluginFieldType::kINT32);
    check(nb != nullptr && *nb == 5 && serEps != nullptr && *serEps == eps && serModAxis != nullptr && *serModAxis == 0,
        who + " serialises epsilon, modulation_axis (default 0) and nb_inputs");
    IPluginV3* attached = deserialiseAndAttach(creator, "ada0", ser, who);
    delete plugin; // after deserialisation: `ser` points into it
    if (attached == nullptr)
    {
        return;
    }
    Capabilities rt = capabilities(attached);
    PluginTensorDesc in[5] = {desc({B, S, H}), desc({B, H}), desc({B, H}), desc({H}), desc({H})};
    PluginTensorDesc out[1] = {desc({B, S, H})};
    check(rt.runtime->onShapeChange(in, 5, out, 1) == 0, who + " onShapeChange [2,5,48] with [B,H] modulation");

    std::vector<float> x = pattern(B * S * H, 3.0F, 0.1F);
    std::vector<float> shift = pattern(B * H, 0.4F, 2.2F);
    std::vector<float> scale = pattern(B * H, 0.3F, 0.9F);
    std::vector<float> w = pattern(H, 0.7F, 1.3F);
    std::vector<float> b = pattern(H, 0.2F, 0.5F);
    if (device)
    {
        checkAdaLNEnqueue(creator, {B, S, H}, Mod::kRowsOfB, true, false);
        checkAdaLNEnqueue(creator, {B, S, H}, Mod::kRowsOfB, false, false);
        checkAdaLNEnqueue(creator, {B, S, H}, Mod::kFull, false, false);
        checkAdaLNEnqueue(creator, {B, S, H}, Mod::kOneRow, true, false);
        checkAdaLNEnqueue(creator, {2, 3, 4, 40}, Mod::kRowsOfB, true, false); // rank 4: [B, H] over 12 rows
        checkAdaLNEnqueue(creator, {2, 3, 1152}, Mod::kRowsOfB, true, false);  // DiT-XL hidden size
        // sequence-first X [S, B, H] (modulation_axis 1): row r takes modulation row r % B
        checkAdaLNEnqueue(creator, {5, 3, 48}, Mod::kRowsOfB, true, false, 1);
        checkAdaLNEnqueue(creator, {7, 2, 1152}, Mod::kRowsOfB, false, false, 1);
        checkAdaLNEnqueue(creator, {5, 1, 48}, Mod::kRowsOfB, true, false, 1);   // B = 1
        checkAdaLNEnqueue(creator, {1, 3, 48}, Mod::kRowsOfB, true, false, 1);   // S = 1: the [B, H] kernels
        checkAdaLNEnqueue(creator, {2, 3, 4, 40}, Mod::kRowsOfB, true, false, 1); // (r / 4) % 3
        checkAdaLNEnqueue(creator, {2, 3, 4, 40}, Mod::kRowsOfB, false, false, 2); // r % 4
        checkAdaLNEnqueue(creator, {5, 3, 48}, Mod::kFull, true, false, 1);     // no effect on full shape
    }
    else
    {
        void const* ins[5] = {x.data(), shift.data(), scale.data(), w.data(), b.data()};
        void* outs[1] = {x.data()};
        check(rt.runtime->enqueue(in, out, ins, outs, nullptr, nullptr) != 0 && log.lastErrorHas("kernel launch failed"),
            who + " enqueue without a CUDA device fails with a logged reason");
    }
    delete attached;

    checkModulationAxis(creator, log, who, false);

    int32_t const badNb = 4;
    PluginField badNbF[] = {{"epsilon", &eps, PluginFieldType::kFLOAT32, 1}, {"nb_inputs", &badNb, PluginFieldType::kINT32, 1}};
    PluginFieldCollection badNbFc{2, badNbF};
    check(creator->createPlugin("a", &badNbFc, TensorRTPhase::kRUNTIME) == nullptr && log.lastErrorHas("nb_inputs"),
        who + " rejects nb_inputs 4");
    // A runtime plugin that never saw its input count refuses to run rather than guessing.
    IPluginV3* unconfigured = creator->createPlugin("a", &fc, TensorRTPhase::kRUNTIME);
    if (unconfigured != nullptr)
    {
        void const* ins[5] = {x.data(), shift.data(), scale.data(), w.data(), b.data()};
        void* outs[1] = {x.data()};
        check(capabilities(unconfigured).runtime->enqueue(in, out, ins, outs, nullptr, nullptr) != 0
                && log.lastErrorHas("not configured"),
            who + " enqueue before any shape information fails with a logged reason");
        delete unconfigured;
    }
}

// ---------------------------------------------------------------------------------------------
// Fused residual ops (two outputs, Y and Sum): SkipRMSNorm, GatedAdaLNZero
// ---------------------------------------------------------------------------------------------
//! Build-time checks shared by both fused creators: fields, two outputs of X's type and shape,
//! formats, configurePlugin with a wrong input rejected (logged), serialisation round trip.
IPluginV3* checkFusedBuild(IPluginCreatorV3One* creator, RecordingLogger& log, std::string const& who,
    std::vector<std::vector<int64_t>> const& inShapes, int32_t badInput, char const* badMessage,
    std::vector<std::string> const& fieldNames)
{
    float const eps = 1e-5F;
    char const ns[] = "normexport";
    PluginField fields[] = {{"epsilon", &eps, PluginFieldType::kFLOAT32, 1},
        {"plugin_namespace", ns, PluginFieldType::kCHAR, 10}};
    PluginFieldCollection fc{2, fields};
    Capabilities caps{};
    IPluginV3* plugin = createBuildPlugin(creator, &fc, who, fieldNames, caps);
    if (plugin == nullptr)
    {
        return nullptr;
    }
    check(caps.build->getNbOutputs() == 2, who + " has two outputs (Y, Sum)");
    int32_t const n = static_cast<int32_t>(inShapes.size());
    std::vector<DataType> inTypes(n, DataType::kBF16);
    DataType outTypes[2] = {DataType::kFLOAT, DataType::kFLOAT};
    check(caps.build->getOutputDataTypes(outTypes, 2, inTypes.data(), n) == 0 && outTypes[0] == DataType::kBF16
            && outTypes[1] == DataType::kBF16,
        who + " both output dtypes follow X (bfloat16)");
    NoExprBuilder exprBuilder;
    NoDimExpr dimExprs[3];
    std::vector<DimsExprs> exprs(n);
    for (auto& e : exprs)
    {
        e.nbDims = 3;
        for (int32_t i = 0; i < 3; ++i)
        {
            e.d[i] = &dimExprs[i];
        }
    }
    DimsExprs outShapes[2]{};
    check(caps.build->getOutputShapes(exprs.data(), n, nullptr, 0, outShapes, 2, exprBuilder) == 0
            && outShapes[0].nbDims == 3 && outShapes[1].nbDims == 3 && outShapes[1].d[2] == &dimExprs[2],
        who + " output shapes = X's shape");
    std::vector<DynamicPluginTensorDesc> io;
    for (auto const& sh : inShapes)
    {
        io.push_back(dyn(sh));
    }
    io.push_back(dyn(inShapes[0]));
    io.push_back(dyn(inShapes[0]));
    bool all = true;
    for (int32_t pos = 0; pos < n + 2; ++pos)
    {
        all = all && caps.build->supportsFormatCombination(pos, io.data(), n, 2);
    }
    check(all, who + " supports linear float32 for every tensor");
    io[1] = dyn(inShapes[1], DataType::kHALF);
    check(!caps.build->supportsFormatCombination(1, io.data(), n, 2), who + " rejects an input of another dtype than X");
    io[1] = dyn(inShapes[1]);
    check(!caps.build->supportsFormatCombination(0, io.data(), n, 1), who + " rejects one output");
    check(caps.build->configurePlugin(io.data(), n, io.data() + n, 2) == 0, who + " configurePlugin");
    std::vector<DynamicPluginTensorDesc> bad = io;
    std::vector<int64_t> wrong = inShapes[badInput];
    wrong.back() += 1;
    bad[badInput] = dyn(wrong);
    check(caps.build->configurePlugin(bad.data(), n, bad.data() + n, 2) != 0 && log.lastErrorHas(badMessage),
        who + " configurePlugin rejects a wrong input " + std::to_string(badInput) + ", with a logged reason");
    check(caps.build->configurePlugin(io.data(), n, io.data() + n, 2) == 0, who + " configurePlugin again");
    PluginFieldCollection const* ser = caps.runtime->getFieldsToSerialize();
    int32_t const* nb = fieldData<int32_t>(ser, "nb_inputs", PluginFieldType::kINT32);
    float const* serEps = fieldData<float>(ser, "epsilon", PluginFieldType::kFLOAT32);
    check(nb != nullptr && *nb == n && serEps != nullptr && *serEps == eps, who + " serialises epsilon and nb_inputs");
    IPluginV3* attached = deserialiseAndAttach(creator, "fused0", ser, who);
    delete plugin;
    return attached;
}

void testSkipRMSNorm(IPluginCreatorV3One* creator, RecordingLogger& log, bool device)
{
    int64_t const B = 2, S = 3, H = 64;
    IPluginV3* attached
        = checkFusedBuild(creator, log, "SkipRMSNorm", {{B, S, H}, {B, S, H}, {H}, {H}}, 1, "skip has shape", {"epsilon"});
    if (attached == nullptr)
    {
        return;
    }
    delete attached;
    if (device)
    {
        checkSkipRMSNormEnqueue(creator, {B, S, H}, true);
        checkSkipRMSNormEnqueue(creator, {B, S, H}, false);
        checkSkipRMSNormEnqueue(creator, {3, 37}, true);   // odd hidden: scalar path
        checkSkipRMSNormEnqueue(creator, {2, 4096}, false); // one block per row
    }
}

void testGatedAdaLNZero(IPluginCreatorV3One* creator, RecordingLogger& log, bool device)
{
    int64_t const B = 2, S = 5, H = 48;
    IPluginV3* attached = checkFusedBuild(creator, log, "GatedAdaLNZero",
        {{B, S, H}, {B, S, H}, {B, H}, {B, H}, {B, H}, {H}, {H}}, 3, "shift has shape", {"epsilon", "modulation_axis"});
    if (attached == nullptr)
    {
        return;
    }
    {
        // gate, shift, scale of different layouts
        Capabilities rt = capabilities(attached);
        PluginTensorDesc in[7] = {desc({B, S, H}), desc({B, S, H}), desc({B, S, H}), desc({B, H}), desc({B, H}),
            desc({H}), desc({H})};
        PluginTensorDesc out[2] = {desc({B, S, H}), desc({B, S, H})};
        check(rt.runtime->onShapeChange(in, 7, out, 2) != 0 && log.lastErrorHas("different layouts"),
            "GatedAdaLNZero rejects gate [B,S,H] with shift [B,H], with a logged reason");
        in[1] = desc({B, S + 1, H});
        in[2] = desc({B, H});
        check(rt.runtime->onShapeChange(in, 7, out, 2) != 0 && log.lastErrorHas("update has shape"),
            "GatedAdaLNZero rejects an update of another shape than X, with a logged reason");
    }
    delete attached;
    checkModulationAxis(creator, log, "GatedAdaLNZero", true);
    if (device)
    {
        checkAdaLNEnqueue(creator, {B, S, H}, Mod::kRowsOfB, true, true);
        checkAdaLNEnqueue(creator, {B, S, H}, Mod::kFull, false, true);
        checkAdaLNEnqueue(creator, {B, S, H}, Mod::kOneRow, true, true);
        checkAdaLNEnqueue(creator, {2, 3, 1152}, Mod::kRowsOfB, true, true); // DiT-XL hidden size
        checkAdaLNEnqueue(creator, {5, 3, 48}, Mod::kRowsOfB, true, true, 1); // sequence-first: r % B
        checkAdaLNEnqueue(creator, {7, 2, 1152}, Mod::kRowsOfB, false, true, 1);
    }
}

} // namespace

int main(int argc, char** argv)
{
    if (argc != 2)
    {
        std::fprintf(stderr, "usage: %s path/to/libnormexport_plugins.so\n", argv[0]);
        return 2;
    }
    void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr)
    {
        std::fprintf(stderr, "cannot load %s: %s\n", argv[1], dlerror());
        return 2;
    }
    using GetCreatorsFn = IPluginCreatorInterface* const* (*) (int32_t&);
    using SetLoggerFinderFn = void (*)(ILoggerFinder*);
    auto getCreators = reinterpret_cast<GetCreatorsFn>(dlsym(lib, "getCreators"));
    auto setLoggerFinder = reinterpret_cast<SetLoggerFinderFn>(dlsym(lib, "setLoggerFinder"));
    check(getCreators != nullptr, "library exports getCreators");
    check(setLoggerFinder != nullptr, "library exports setLoggerFinder");
    if (getCreators == nullptr || setLoggerFinder == nullptr)
    {
        return 1;
    }
    RecordingLogger logger;
    Finder finder(&logger);
    setLoggerFinder(&finder);

    int32_t nb = -1;
    IPluginCreatorInterface* const* creators = getCreators(nb);
    check(creators != nullptr && nb == 4, "getCreators returns 4 creators");
    bool const device = hasDevice();
    std::printf("INFO CUDA device present: %s\n", device ? "yes (enqueue runs the kernels)" : "no");
    int found = 0;
    for (int32_t i = 0; creators != nullptr && i < nb; ++i)
    {
        InterfaceInfo const info = creators[i]->getInterfaceInfo();
        check(std::strcmp(info.kind, "PLUGIN CREATOR_V3ONE") == 0 && info.major == 1,
            std::string("creator ") + std::to_string(i) + " is a PLUGIN CREATOR_V3ONE v1");
        auto* creator = static_cast<IPluginCreatorV3One*>(creators[i]);
        check(std::strcmp(creator->getPluginNamespace(), "normexport") == 0,
            std::string(creator->getPluginName()) + " creator namespace is normexport");
        if (std::strcmp(creator->getPluginName(), "RMSNorm") == 0)
        {
            ++found;
            testRMSNorm(creator, logger, device);
        }
        else if (std::strcmp(creator->getPluginName(), "AdaLNZero") == 0)
        {
            ++found;
            testAdaLNZero(creator, logger, device);
        }
        else if (std::strcmp(creator->getPluginName(), "SkipRMSNorm") == 0)
        {
            ++found;
            testSkipRMSNorm(creator, logger, device);
        }
        else if (std::strcmp(creator->getPluginName(), "GatedAdaLNZero") == 0)
        {
            ++found;
            testGatedAdaLNZero(creator, logger, device);
        }
    }
    check(found == 4, "creators named RMSNorm, AdaLNZero, SkipRMSNorm and GatedAdaLNZero");
    std::printf("%d checks, %d failed\n", gChecks, gFailures);
    return gFailures == 0 ? 0 : 1;
}
