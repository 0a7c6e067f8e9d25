// Generated from the op specs in normexport/ops/ by `python -m normexport.ops.plugin_fields`.
// Do not edit: tests/test_plugins_build.py fails when this file and the specs disagree.
#pragma once

#include <cstdint>

namespace normexport
{
namespace plugin
{
namespace spec
{

constexpr char const* kNAMESPACE{"normexport"};
constexpr char const* kVERSION{"1"};

//! Y = LayerNorm(X; weight, bias, epsilon) * (1 + scale) + shift; statistics in float32.
namespace adaln_zero
{
constexpr char const* kNAME{"AdaLNZero"};
constexpr int32_t kMIN_INPUTS{3};
constexpr int32_t kMAX_INPUTS{5};
//! LayerNorm epsilon
constexpr char const* kEPSILON{"epsilon"};
constexpr float kEPSILON_DEFAULT{1e-06F};
} // namespace adaln_zero

//! Sum = X + gate * update (rounded to X's dtype); Y = LayerNorm(Sum; weight, bias, epsilon) * (1 + scale) + shift; statistics in float32.
namespace gated_adaln_zero
{
constexpr char const* kNAME{"GatedAdaLNZero"};
constexpr int32_t kMIN_INPUTS{5};
constexpr int32_t kMAX_INPUTS{7};
//! LayerNorm epsilon
constexpr char const* kEPSILON{"epsilon"};
constexpr float kEPSILON_DEFAULT{1e-06F};
} // namespace gated_adaln_zero

//! Y = X / sqrt(mean(X^2 over dims axis..rank-1) + epsilon) * scale; statistics in float32.
namespace rms_norm
{
constexpr char const* kNAME{"RMSNorm"};
constexpr int32_t kMIN_INPUTS{2};
constexpr int32_t kMAX_INPUTS{2};
//! added to the mean of squares
constexpr char const* kEPSILON{"epsilon"};
constexpr float kEPSILON_DEFAULT{1e-06F};
//! first normalized dim; dims axis..rank-1 are normalized
constexpr char const* kAXIS{"axis"};
constexpr int32_t kAXIS_DEFAULT{-1};
} // namespace rms_norm

//! Sum = X + skip [+ bias] (rounded to X's dtype); Y = Sum / sqrt(mean(Sum^2, last dim) + epsilon) * scale; statistics in float32.
namespace skip_rms_norm
{
constexpr char const* kNAME{"SkipRMSNorm"};
constexpr int32_t kMIN_INPUTS{3};
constexpr int32_t kMAX_INPUTS{4};
//! added to the mean of squares
constexpr char const* kEPSILON{"epsilon"};
constexpr float kEPSILON_DEFAULT{1e-06F};
} // namespace skip_rms_norm

} // namespace spec
} // namespace plugin
} // namespace normexport
