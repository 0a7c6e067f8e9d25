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
struct adaln_zero
{
    static constexpr char const* kNAME{"AdaLNZero"};
    static constexpr char const* kSIGNATURE{"(X, shift, scale[, weight, bias]) -> Y"};
    static constexpr int32_t kMIN_INPUTS{3};
    static constexpr int32_t kMAX_INPUTS{5};
    static constexpr int32_t kNB_OUTPUTS{1};
    //! LayerNorm epsilon
    static constexpr char const* kEPSILON{"epsilon"};
    static constexpr float kEPSILON_DEFAULT{1e-06F};
    //! the dim of X the rows of a [B, H] modulation follow (0: X [B, ..., H]; 1: X [S, B, H]), 0..rank(X)-2; no effect on a full-shape or [1, H] modulation
    static constexpr char const* kMODULATION_AXIS{"modulation_axis"};
    static constexpr int32_t kMODULATION_AXIS_DEFAULT{0};
    static constexpr bool kHAS_AXIS{false};
    static constexpr bool kHAS_EPSILON{true};
    static constexpr bool kHAS_MODULATION_AXIS{true};
};

//! Sum = X + gate * update (rounded to X's dtype); Y = LayerNorm(Sum; weight, bias, epsilon) * (1 + scale) + shift; statistics in float32.
struct gated_adaln_zero
{
    static constexpr char const* kNAME{"GatedAdaLNZero"};
    static constexpr char const* kSIGNATURE{"(X, update, gate, shift, scale[, weight, bias]) -> (Y, Sum)"};
    static constexpr int32_t kMIN_INPUTS{5};
    static constexpr int32_t kMAX_INPUTS{7};
    static constexpr int32_t kNB_OUTPUTS{2};
    //! LayerNorm epsilon
    static constexpr char const* kEPSILON{"epsilon"};
    static constexpr float kEPSILON_DEFAULT{1e-06F};
    //! the dim of X the rows of a [B, H] modulation follow (0: X [B, ..., H]; 1: X [S, B, H]), 0..rank(X)-2; no effect on a full-shape or [1, H] modulation
    static constexpr char const* kMODULATION_AXIS{"modulation_axis"};
    static constexpr int32_t kMODULATION_AXIS_DEFAULT{0};
    static constexpr bool kHAS_AXIS{false};
    static constexpr bool kHAS_EPSILON{true};
    static constexpr bool kHAS_MODULATION_AXIS{true};
};

//! Y = X / sqrt(mean(X^2 over dims axis..rank-1) + epsilon) * scale; statistics in float32.
struct rms_norm
{
    static constexpr char const* kNAME{"RMSNorm"};
    static constexpr char const* kSIGNATURE{"(X, scale) -> Y"};
    static constexpr int32_t kMIN_INPUTS{2};
    static constexpr int32_t kMAX_INPUTS{2};
    static constexpr int32_t kNB_OUTPUTS{1};
    //! added to the mean of squares
    static constexpr char const* kEPSILON{"epsilon"};
    static constexpr float kEPSILON_DEFAULT{1e-06F};
    //! first normalized dim; dims axis..rank-1 are normalized
    static constexpr char const* kAXIS{"axis"};
    static constexpr int32_t kAXIS_DEFAULT{-1};
    static constexpr bool kHAS_AXIS{true};
    static constexpr bool kHAS_EPSILON{true};
    static constexpr bool kHAS_MODULATION_AXIS{false};
};

//! Sum = X + skip [+ bias] (rounded to X's dtype); Y = Sum / sqrt(mean(Sum^2, last dim) + epsilon) * scale; statistics in float32.
struct skip_rms_norm
{
    static constexpr char const* kNAME{"SkipRMSNorm"};
    static constexpr char const* kSIGNATURE{"(X, skip, scale[, bias]) -> (Y, Sum)"};
    static constexpr int32_t kMIN_INPUTS{3};
    static constexpr int32_t kMAX_INPUTS{4};
    static constexpr int32_t kNB_OUTPUTS{2};
    //! added to the mean of squares
    static constexpr char const* kEPSILON{"epsilon"};
    static constexpr float kEPSILON_DEFAULT{1e-06F};
    static constexpr bool kHAS_AXIS{false};
    static constexpr bool kHAS_EPSILON{true};
    static constexpr bool kHAS_MODULATION_AXIS{false};
};

} // namespace spec
} // namespace plugin
} // namespace normexport
