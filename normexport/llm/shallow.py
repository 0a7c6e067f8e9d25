"""A causal LM with its cache exported shallow and grown (normexport.exporter.depth, issue 31
item 3): the plan for a FlatCacheLM whose decoder is a stack of identical blocks. The shallow
export is the same module with its first blocks, its cache inputs / outputs cut to theirs."""

from __future__ import annotations

import contextlib
import re

from ..exporter import depth
from .cache import CacheLayout, FlatCacheLM

_PER_LAYER = re.compile(r"^(past_key_values|present)\.(\d+)\.(.+)$")


def io_layer(name: str):
    """(layer, name_of(layer)) of past_key_values.i.* / present.i.*, else None."""
    m = _PER_LAYER.match(name)
    if m is None:
        return None
    head, tail = m.group(1), m.group(3)
    return int(m.group(2)), (lambda i: f"{head}.{i}.{tail}")


def plan(lm, args: tuple, names: list[str], output_names: list[str], dynamic_axes: dict):
    """depth.Plan for `lm` (a FlatCacheLM whose cache has one layer per block of its deepest
    uniform stack), None where its depth does not qualify."""
    if not isinstance(lm, FlatCacheLM):
        return None
    stack = depth.find_stack(lm)
    if stack is None or stack.depth != lm.layout.layers:
        return None
    tensors = dict(lm.named_parameters(remove_duplicate=False))
    tensors.update(dict(lm.named_buffers(remove_duplicate=False)))

    @contextlib.contextmanager
    def narrowed(keep: int):
        layout = lm.layout
        lm.layout = CacheLayout(layout.keys[:keep], layout.values[:keep], layout.dtype)
        lm._bind_names()
        try:
            n_in = len(args) - 2 * (layout.layers - keep)
            kept_names = names[:n_in]
            outs = output_names[:len(output_names) - 2 * (layout.layers - keep)]
            axes = {k: v for k, v in (dynamic_axes or {}).items() if k in kept_names}
            yield args[:n_in], kept_names, outs, axes
        finally:
            lm.layout = layout
            lm._bind_names()

    return depth.Plan(stack, narrowed, tensors.__getitem__, io_layer)
