"""Graph helpers on onnx-ir values shared by the rewriter, the canonical pass and the LLM fusion
(in the manner of onnxscript's ``rewriter/_ir_utils.py``): one copy each, imported everywhere.

- ``constant_array(value, ...)``: the numpy array of the constant behind a value (an initializer
  that is not a graph input, or a Constant node), with keyword switches for what each caller needs;
- ``constant_node_array(node)``: a copy of a Constant node's value, read off its one attribute;
- ``rank_of``: a value's rank, None if unknown;
- ``same_dim`` / ``same_shape``: whether two dims / shapes are known to be equal;
- ``ONNX_DOMAINS``: the two names of the default domain.
"""

from __future__ import annotations

from typing import Collection

import numpy as np
import onnx_ir as ir

ONNX_DOMAINS = ("", "ai.onnx")

_MAX_DEPTH = 8  # (Identity / Transpose chains looked through)


def constant_node_array(node: ir.Node) -> np.ndarray | None:
    """A copy of a Constant node's value, read off its single attribute (``value``, ``value_float(s)``,
    ``value_int(s)``); None for any other attribute (strings, sparse), a reference attribute, or a
    node without exactly one attribute.  (onnx-ir's get_const_tensor would name the tensor: a
    caller's proto, shared, would change.)"""
    if len(node.attributes) != 1:
        return None
    (attr,) = node.attributes.values()
    try:
        if attr.name == "value":
            return np.array(attr.value.numpy(), order="C")
        if attr.name in ("value_float", "value_floats"):
            return np.array(attr.value, np.float32)
        if attr.name in ("value_int", "value_ints"):
            return np.array(attr.value, np.int64)
    except Exception:  # noqa: BLE001 - a string, sparse or reference attribute
        return None
    return None


def constant_array(value: ir.Value | None, *, graph_inputs: bool = False, through: Collection[str] = (),
                   max_size: int | None = None, tensor_only: bool = False,
                   raise_unreadable: bool = False, _depth: int = 0) -> np.ndarray | None:
    """The numpy array of the constant behind ``value``, or None.

    A constant is an initializer (``const_value``) or the output of a Constant node (ONNX domain).
    - ``graph_inputs``: also read an initializer that is a graph input (overridable: by default it
      is not a constant);
    - ``through``: op types looked through (ONNX domain, up to 8 deep): ``"Identity"`` (the legacy
      exporter reads deduplicated initializers through Identity) and ``"Transpose"`` (its
      MatMul(x, Transpose(weight)) for a Linear when constant folding is off; ``perm`` applied);
    - ``max_size``: an initializer with more elements is not read (None if larger: weights stay
      where they lie, docs/design.md §8); a Constant node, already in memory, is read at any size;
    - ``tensor_only``: read a Constant node only through its ``value`` tensor attribute (not
      ``value_float(s)`` / ``value_int(s)``);
    - ``raise_unreadable``: let an initializer that cannot be read (external data not found) raise
      instead of giving None.

    The Constant node's array is a copy; an initializer's is whatever its tensor's ``numpy()`` gives.
    Callers: rewriter rules (``tensor_only=True``), the canonical pass (``max_size=FOLD_LIMIT``),
    bn_fold / bn_affine (``through=("Identity", "Transpose"), raise_unreadable=True``), the LLM
    attention fusion (``graph_inputs=True, tensor_only=True, raise_unreadable=True``)."""
    if value is None or _depth > _MAX_DEPTH or (value.is_graph_input() and not graph_inputs):
        return None
    t = value.const_value
    if t is not None:
        if max_size is not None:
            try:
                if t.size > max_size:
                    return None
            except Exception:  # noqa: BLE001 - a tensor without a size
                return None
        if raise_unreadable:
            return t.numpy()
        try:
            return t.numpy()
        except Exception:  # noqa: BLE001 - external data not loaded
            return None
    node = value.producer()
    if node is None or node.domain not in ONNX_DOMAINS:
        return None
    if node.op_type == "Constant":
        if tensor_only and not (len(node.attributes) == 1 and "value" in node.attributes):
            return None
        return constant_node_array(node)
    if node.op_type not in through:
        return None
    a = constant_array(node.inputs[0] if node.inputs else None, graph_inputs=graph_inputs, through=through,
                       max_size=max_size, tensor_only=tensor_only, raise_unreadable=raise_unreadable,
                       _depth=_depth + 1)
    if a is None or node.op_type == "Identity":
        return a
    if node.op_type == "Transpose":
        perm = node.attributes.get("perm")
        return np.transpose(a, perm.as_ints() if perm is not None else None)
    raise ValueError(f"constant_array cannot look through {node.op_type}")


def rank_of(v: ir.Value | None) -> int | None:
    """The rank of `v` (None: no value, or its shape unknown)."""
    return None if v is None or v.shape is None else len(v.shape)


def same_dim(d1, d2) -> bool:
    """Whether two dims are known to be equal (ints, or named symbolic dims of the same name)."""
    if isinstance(d1, int) and isinstance(d2, int):
        return d1 == d2
    if isinstance(d1, ir.SymbolicDim) and isinstance(d2, ir.SymbolicDim):
        return d1.value is not None and d1.value == d2.value
    return False


def same_shape(s1, s2) -> bool:
    """Whether two shapes (None: unknown) are known to be equal, dim by dim (same_dim)."""
    return s1 is not None and s2 is not None and len(s1) == len(s2) and all(same_dim(a, b) for a, b in zip(s1, s2))
