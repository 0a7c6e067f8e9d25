"""The rewritten onnx_ir model made whole: one AdaLNZero form, the function bodies of our custom ops."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from normexport import ops as _ops


def _one_adaln_form(ir_model: ir.Model) -> None:
    """attach_functions wants one arity per op: when AdaLNZero nodes with and without affine are
    mixed, give the ones without an explicit weight = 1 / bias = 0 (the same math)."""
    nodes = [n for n in ir_model.graph if n.domain == _ops.DOMAIN and n.op_type == "AdaLNZero"]
    if len({len(n.inputs) for n in nodes}) < 2:
        return
    for n in nodes:
        x = n.inputs[0]
        if len(n.inputs) != 3 or x.shape is None or not isinstance(x.shape[-1], int) or x.dtype is None:
            continue
        extra = []
        for tag, v in (("unit_weight", 1.0), ("zero_bias", 0.0)):
            name = f"{n.outputs[0].name}__{tag}"
            t = ir.tensor(np.full([x.shape[-1]], v, dtype=x.dtype.numpy()), name=name)
            val = ir.Value(name=name, shape=ir.Shape([x.shape[-1]]), type=ir.TensorType(x.dtype), const_value=t)
            ir_model.graph.register_initializer(val)
            extra.append(val)
        n.resize_inputs(5)
        n.replace_input_with(3, extra[0])
        n.replace_input_with(4, extra[1])


def finish(ir_model: ir.Model) -> None:
    """In place: one AdaLNZero form, and the ONNX functions (and plugin attributes) of the
    normexport nodes the model has."""
    _one_adaln_form(ir_model)
    _ops.attach_functions_ir(ir_model)
