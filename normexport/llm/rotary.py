"""Rotary (RoPE) analysis for the GroupQueryAttention fusion (normexport.llm.attention): the
constant inverse frequencies behind a rotary's cos / sin, where they are transformers' default
RoPE as exported (cos / sin of position_ids x a constant inv_freq, duplicated); anything else is
not fused."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..ir_utils import constant_array


def _const(value: ir.Value | None) -> np.ndarray | None:
    """The constant behind `value` (an initializer, a graph input's included, or a Constant's
    `value` tensor), else None (normexport.ir_utils.constant_array)."""
    return constant_array(value, graph_inputs=True, tensor_only=True, raise_unreadable=True)


def producer(value, op_type: str):
    """The node of ONNX op `op_type` (default domain) that makes `value`, else None."""
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain == "" else None


def inv_freq(cos: ir.Value, sin: ir.Value) -> tuple[np.ndarray | None, str | None]:
    """The constant inverse frequencies [head_dim / 2] where cos / sin are Unsqueeze(Cos / Sin(Concat(f, f)), 1)
    with f = Cast(Unsqueeze(position_ids, 2), float) x inv_freq (transformers' default RoPE, as exported),
    else (None, why)."""
    found = []
    for val, fn in ((cos, "Cos"), (sin, "Sin")):
        un = producer(val, "Unsqueeze")
        if un is None or list(_const(un.inputs[1]) if _const(un.inputs[1]) is not None else []) != [1]:
            return None, f"{val.name} is not Unsqueeze(., [1])"
        x = un.inputs[0]
        if producer(x, "Cast") is not None:  # a cast to the model's dtype
            x = producer(x, "Cast").inputs[0]
        trig = producer(x, fn)
        if trig is None:
            return None, f"{val.name} is not {fn}(...)"
        cat = producer(trig.inputs[0], "Concat")
        if cat is None or len(cat.inputs) != 2 or cat.inputs[0] is not cat.inputs[1] or cat.attributes.get_int("axis") != -1:
            return None, "the angles are not Concat(freqs, freqs, axis=-1)"
        found.append(cat.inputs[0])
    if found[0] is not found[1]:
        return None, "cos and sin of different angles"
    mul = producer(found[0], "Mul")
    if mul is None:
        return None, "the angles are not position_ids x inv_freq"
    for pos, freq in (mul.inputs, mul.inputs[::-1]):
        inv = _const(freq)
        cast = producer(pos, "Cast")
        if inv is None or cast is None or cast.attributes.get_int("to") != ir.DataType.FLOAT:
            continue
        un = producer(cast.inputs[0], "Unsqueeze")
        if un is None or un.inputs[0] is None or un.inputs[0].name != "position_ids" or \
                list(_const(un.inputs[1]) if _const(un.inputs[1]) is not None else []) != [2]:
            continue
        inv = np.asarray(inv, dtype=np.float32).reshape(-1)
        return inv, None
    return None, "the angles are not Cast(Unsqueeze(position_ids, 2)) x a constant inv_freq"

