"""torch.einsum with its operands promoted to one dtype while a module is exported (issue 46 item 6).

Eager `torch.einsum` promotes mixed operands (float32 positions x a float64 frequency table, as
diffusers' HiDream `rope` computes its RoPE: the result is float64); torch.onnx's translation of
aten::einsum, in both the dynamo and the TorchScript exporter (torch 2.13), writes the ONNX Einsum
on the operands as they are, which ONNX requires to share one type: the export stops at shape
inference ("[ShapeInferenceError] (op_type:Einsum) Inputs has inconsistent type tensor(double)").
That is torch's translation, not the model's code or ours. While an exporter runs, `torch.einsum`
casts its operands to `torch.result_type` of them first: the arithmetic eager does, written as
Casts before the Einsum; a call whose operands already agree is passed through unchanged.
"""

from __future__ import annotations

import contextlib
import functools

import torch


def _promoting(original):
    @functools.wraps(original)
    def einsum(equation, *operands):
        ops = list(operands[0]) if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else list(operands)
        tensors = [o for o in ops if isinstance(o, torch.Tensor)]
        if len(tensors) > 1 and len({t.dtype for t in tensors}) > 1:
            dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
            ops = [o.to(dtype) if isinstance(o, torch.Tensor) else o for o in ops]
        return original(equation, *ops)

    einsum.__wrapped_by_normexport__ = True
    return einsum


@contextlib.contextmanager
def promoted_einsum():
    """torch.einsum promotes its operands to one dtype inside the block (module doc)."""
    original = torch.einsum
    if getattr(original, "__wrapped_by_normexport__", False):  # nested: already promoting
        yield
        return
    torch.einsum = _promoting(original)
    try:
        yield
    finally:
        torch.einsum = original
