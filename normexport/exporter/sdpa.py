"""scaled_dot_product_attention's fully masked rows as torch computes them (docs/design.md §9).

torch's SDPA (every backend since 2.5, the math one by `_safe_softmax`) gives 0 for a query row whose
keys are all masked (a boolean mask all False, or a float mask all -inf along the keys).
onnxscript's translation (torch_lib `aten_scaled_dot_product_attention`, used by torch.onnx below
opset 23) fills a boolean mask with the dtype's finite minimum, so such a row's softmax is uniform and
the row becomes the mean of the values; a float mask of -inf gives NaN. An encoder fed a prompt that
is all padding (an empty negative prompt under a padding mask: Flux2-Klein's Qwen3 text encoder)
then differs from eager at every masked row, and a pipeline that reads those rows (its denoiser
attends to the whole padded text) generates another image (33.6 dB from eager; the plain torch.onnx
export the same). The translation here is torch_lib's, with those rows set to 0 after it: exact
wherever a row has a key (the same nodes), torch's value where it has none.
"""

from __future__ import annotations

#: torch.onnx's own translation from this opset on (ONNX Attention) is not replaced
LAST_OPSET = 22


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False):
    """torch.onnx custom_translation_table entry for aten.scaled_dot_product_attention.default."""
    import onnx_ir as ir
    from onnxscript.function_libs.torch_lib.ops import nn
    from onnxscript.onnx_opset import opset18 as op

    out = nn.aten_scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is None:
        return out
    last = op.Constant(value_ints=[-1])
    if attn_mask.dtype == ir.DataType.BOOL:  # a row with a True key
        seen = op.Greater(op.ReduceMax(op.Cast(attn_mask, to=ir.DataType.FLOAT), last, keepdims=1),
                          op.Constant(value_float=0.0))
    else:  # a row whose largest mask value is not -inf
        seen = op.Not(op.IsInf(op.ReduceMax(attn_mask, last, keepdims=1), detect_positive=0))
    return op.Where(seen, out, op.CastLike(op.Constant(value_float=0.0), out))


def table(opset: int) -> dict:
    """The entries for torch.onnx's custom_translation_table at `opset`."""
    if opset > LAST_OPSET:
        return {}
    import torch

    return {torch.ops.aten.scaled_dot_product_attention.default: scaled_dot_product_attention}
