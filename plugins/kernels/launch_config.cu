// normexport_launch_config_for: the dispatcher's choice, reported to the host (no launch).
#include "norm_common.cuh"

extern "C" NORMEXPORT_API int normexport_launch_config_for(int op, int dtype, int64_t rows, int64_t hidden,
    int aligned, normexport_launch_config* out)
{
    using namespace normexport;
    if (out == nullptr || op < NORMEXPORT_OP_RMS_NORM || op > NORMEXPORT_OP_GATED_ADALN_ZERO
        || !valid_common(&out, &out, rows, hidden, dtype, 0.f))
        return cudaErrorInvalidValue;
    int const elem_size = dtype == NORMEXPORT_FLOAT32 ? 4 : 2;
    *out = choose_config(static_cast<NormKind>(op), elem_size, rows, hidden, aligned != 0);
    return cudaSuccess;
}
