/*
 * The plugin creators of the normexport ops, one per op: each <op>Plugin.cpp instantiates the
 * shared NormPlugin / NormPluginCreator (normPlugin.h) with its op and returns its creator here.
 * plugins.cpp hands them to TensorRT (getCreators).
 */
#pragma once

#include "NvInferRuntime.h"

namespace normexport
{
namespace plugin
{

nvinfer1::IPluginCreatorV3One* rmsNormPluginCreator();
nvinfer1::IPluginCreatorV3One* adaLNZeroPluginCreator();
nvinfer1::IPluginCreatorV3One* skipRmsNormPluginCreator();
nvinfer1::IPluginCreatorV3One* gatedAdaLNZeroPluginCreator();

} // namespace plugin
} // namespace normexport
