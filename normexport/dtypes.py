"""ONNX element types as numpy dtypes, and docs/design.md §7's tolerance per dtype (one place for both:
normexport.sizes, the rewriter and its checks read them here)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx

#: relative part / absolute part of the tolerance per output dtype (docs/design.md §7)
TOL = {
    np.dtype(np.float32): (1e-5, 1e-6),
    np.dtype(np.float64): (1e-5, 1e-6),
    np.dtype(np.float16): (2e-3, 0.0),
}
BF16_TOL = (1.6e-2, 0.0)
#: numpy has no bfloat16: onnx's own dependency ml_dtypes provides it; onnxruntime takes and gives
#: it as raw 16-bit OrtValues
BF16 = np.dtype(ml_dtypes.bfloat16)
#: the floating-point ONNX element types (onnx.TensorProto ints: onnx-ir's ir.DataType members, an IntEnum
#: of the same numbers, are found in it too); the rewriter's rules, canonical pass and local check, and
#: normexport.sizes read it here
FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                         onnx.TensorProto.DOUBLE})


def np_dtype(elem_type: int) -> np.dtype | None:
    """The numpy dtype of an ONNX element type (ml_dtypes.bfloat16 for BFLOAT16); None for types
    numpy cannot hold (float8 and friends, strings)."""
    if elem_type == onnx.TensorProto.BFLOAT16:
        return BF16
    try:
        dt = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except Exception:  # float8 and friends
        return None
    return dt if dt.kind in "fiub" else None


def tolerance(dt: np.dtype | None) -> tuple[float, float]:
    """(relative, absolute) tolerance of docs/design.md §7 for outputs of dtype `dt`."""
    return TOL.get(dt, BF16_TOL) if dt is not None else BF16_TOL
