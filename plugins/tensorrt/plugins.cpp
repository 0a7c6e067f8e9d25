/*
 * Entry points of libnormexport_plugins.so for TensorRT's plugin-library loading
 * (IPluginRegistry::loadLibrary, trt.get_plugin_registry().load_library(), trtexec --dynamicPlugins,
 * IBuilderConfig::setPluginsToSerialize):
 *   extern "C" void setLoggerFinder(nvinfer1::ILoggerFinder* finder);
 *   extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
 * No static registration: loading the library with dlopen alone registers nothing.
 */
#include "creators.h"
#include "pluginCommon.h"

#include <mutex>

#define NORMEXPORT_PLUGIN_API __attribute__((visibility("default")))

namespace normexport
{
namespace plugin
{
namespace
{
std::mutex gLoggerMutex;
nvinfer1::ILoggerFinder* gLoggerFinder{nullptr};
} // namespace

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept
{
    std::lock_guard<std::mutex> lock(gLoggerMutex);
    if (gLoggerFinder == nullptr && finder != nullptr)
    {
        gLoggerFinder = finder;
    }
}

void logError(char const* pluginName, std::string const& msg) noexcept
{
    try
    {
        nvinfer1::ILogger* logger = nullptr;
        {
            std::lock_guard<std::mutex> lock(gLoggerMutex);
            if (gLoggerFinder != nullptr)
            {
                logger = gLoggerFinder->findLogger();
            }
        }
        if (logger != nullptr)
        {
            std::string const line = std::string("[normexport::") + pluginName + "] " + msg;
            logger->log(nvinfer1::ILogger::Severity::kERROR, line.c_str());
        }
    }
    catch (...)
    {
    }
}

} // namespace plugin
} // namespace normexport

extern "C" NORMEXPORT_PLUGIN_API void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    normexport::plugin::setLoggerFinder(finder);
}

extern "C" NORMEXPORT_PLUGIN_API nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    using namespace normexport::plugin;
    static nvinfer1::IPluginCreatorInterface* const kCreators[] = {
        rmsNormPluginCreator(), adaLNZeroPluginCreator(), skipRmsNormPluginCreator(), gatedAdaLNZeroPluginCreator()};
    nbCreators = static_cast<int32_t>(sizeof(kCreators) / sizeof(kCreators[0]));
    return kCreators;
}
