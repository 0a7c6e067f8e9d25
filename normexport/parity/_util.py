"""Small helpers shared by the parity modules: dtypes, ONNX value infos, tensor conversion."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from torch.utils import _pytree as pytree

from ..errors import UsageError, first_line

_ONNX_TO_TORCH = {
    onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16, onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.INT64: torch.int64, onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT16: torch.int16, onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8, onnx.TensorProto.BOOL: torch.bool,
}
_LOW_FLOATS = (torch.float32, torch.float16, torch.bfloat16)



def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _short(e: BaseException) -> str:
    return first_line(e, 200)


def _flatten(out) -> list[torch.Tensor]:
    leaves, _ = pytree.tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def _dims(vi: onnx.ValueInfoProto) -> list[int | str | None]:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return []
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]


def _elem_dtype(vi: onnx.ValueInfoProto):
    return _ONNX_TO_TORCH.get(vi.type.tensor_type.elem_type)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    return t.numpy()


def _as_float64(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        return (a.double() if a.is_floating_point() or a.dtype == torch.bool else a.to(torch.float64)).numpy()
    a = np.asarray(a)
    if a.dtype.kind == "V" or str(a.dtype) == "bfloat16":
        a = a.astype(np.float32)
    return a.astype(np.float64)


def _resolve_dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    from ..load.inputs import DTYPES

    if str(dtype).replace("torch.", "") not in DTYPES:
        raise UsageError(f"unknown dtype '{dtype}': use float32, float16 or bfloat16")
    return DTYPES[str(dtype).replace("torch.", "")]
