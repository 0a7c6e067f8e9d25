"""How a model is called, and what its inputs and outputs are named (docs/design.md §4).

The exporter and the parity check call every model with a flat tuple of tensors. Models that
take keyword inputs (`input_ids=...`), nested inputs (`position_embeddings=(cos, sin)`) or
non-tensor arguments (`use_cache=False`) are wrapped in a `CallAdapter`: it holds the call as a
pytree of (args, kwargs), takes the tensor leaves positionally, keeps the other leaves as
constants, and returns the tensor leaves of the model's output.

Names: inputs are named after the forward's parameters (a nested leaf gets its path:
`position_embeddings.0`); outputs after the output structure (`logits`, `sample`,
`last_hidden_state`); `out_0`, `out_1`.. only where the structure gives no name.

Complex inputs (a RoPE table of complex64 a pipeline passes, issue 40): ONNX has no complex type,
so a complex leaf is taken as view_as_real's real pairs (its name kept, its shape + (2,)) and given
to the model as view_as_complex of them; under normexport.prepare.complex's lowering that is a real
pair again, so no complex value reaches the exporter (`complex_inputs` lists them).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
import torch.utils._pytree as pytree
from torch import nn


class CallAdapter(nn.Module):
    """`inner(*args, **kwargs)` with the tensors of (args, kwargs) given positionally."""

    def __init__(self, inner: nn.Module, args: tuple, kwargs: dict):
        super().__init__()
        self.inner = inner
        leaves, self._spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        self._slots = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        self._constants = [None if isinstance(v, torch.Tensor) else v for v in leaves]
        paths = [p for p, _ in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]]
        params = _positional_names(inner, len(args))
        self.input_names = [_input_name(paths[i], params) for i in self._slots]
        self._complex_slots = {i for i in self._slots if leaves[i].dtype.is_complex}
        self.example_inputs = tuple(_as_pair(leaves[i]) if i in self._complex_slots else leaves[i] for i in self._slots)
        self.complex_inputs = {n: (leaves[i].dtype, tuple(leaves[i].shape))  # {input name: (complex dtype, shape)}
                               for n, i in zip(self.input_names, self._slots) if i in self._complex_slots}
        top = [(params[i], v) for i, v in enumerate(args)] + list(kwargs.items())
        self._constant_names = {n: v for n, v in top if v is not None and not any(
            isinstance(x, torch.Tensor) for x in pytree.tree_leaves(v))}  # whole plain values (img_shapes)
        self._constant_names.update({_input_name(paths[i], params): v for i, v in enumerate(leaves)  # inside nests
                                     if not isinstance(v, torch.Tensor) and v is not None
                                     and _input_name(paths[i], params).split(".")[0] not in self._constant_names})

    def with_inner(self, inner: nn.Module) -> "CallAdapter":
        """The same call (inputs, names, constants) of another module."""
        new = CallAdapter.__new__(CallAdapter)
        nn.Module.__init__(new)
        new.inner = inner
        for attr in ("_spec", "_slots", "_constants", "input_names", "example_inputs", "_constant_names",
                     "_complex_slots", "complex_inputs"):
            setattr(new, attr, getattr(self, attr))
        return new

    def constants(self) -> dict:
        """The plain (non-tensor, non-None) values of the call, by input path: fixed in an export."""
        return dict(getattr(self, "_constant_names", {}))

    def forward(self, *tensors):
        return tuple(t for t in pytree.tree_leaves(self.call_inner(*tensors)) if isinstance(t, torch.Tensor))

    def call_inner(self, *tensors):
        """The inner model's own output (a ModelOutput, dict, ...) for these input tensors."""
        leaves = list(self._constants)
        pairs = getattr(self, "_complex_slots", ())
        for slot, t in zip(self._slots, tensors):
            leaves[slot] = _as_complex(t) if slot in pairs else t
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        return self.inner(*args, **kwargs)


def _as_pair(z: torch.Tensor) -> torch.Tensor:
    """A complex input as the real tensor the file takes: view_as_real's [..., 2] (re, im)."""
    return torch.view_as_real(z.detach().resolve_conj()).clone()


def _as_complex(t: torch.Tensor) -> torch.Tensor:
    """The model's complex input from its real pairs (float16 / bfloat16 pairs, e.g. after --dtype, as complex64)."""
    return torch.view_as_complex((t if t.dtype in (torch.float32, torch.float64) else t.float()).contiguous())


def unwrap(module: nn.Module) -> nn.Module:
    """The user's model inside a CallAdapter (the module itself otherwise)."""
    return module.inner if isinstance(module, CallAdapter) else module


def forward_parameter_names(module: nn.Module) -> list[str] | None:
    """Names of forward's positional parameters (None when the signature cannot be read)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _positional_names(module: nn.Module, n: int) -> list[str]:
    names = forward_parameter_names(module) or []
    return [names[i] if i < len(names) else f"input_{i}" for i in range(n)]


def _input_name(path: tuple, params: list[str]) -> str:
    # path: (SequenceKey(0 args | 1 kwargs), SequenceKey(i) | MappingKey(name), nested keys...)
    head, key, rest = path[0], path[1], path[2:]
    base = params[key.idx] if head.idx == 0 else str(key.key)
    return ".".join([base] + [_key_text(k) for k in rest])


def _key_text(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def output_names(outputs) -> list[str]:
    """Names of the tensor leaves of a model's output, in pytree order (the exporter's order):
    mapping keys and attribute names joined by '.', `out_i` for a leaf reached by indices only."""
    named: list[str | None] = []

    def walk(node, keys: list[str], named_path: bool):
        if isinstance(node, torch.Tensor):
            named.append(".".join(keys) if named_path else None)
        elif isinstance(node, Mapping):  # dict, ModelOutput (transformers), BaseOutput (diffusers)
            for k, v in node.items():
                if v is not None:
                    walk(v, keys + [str(k)], True)
        elif isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            for i, v in enumerate(node):
                walk(v, keys + [str(i)], named_path)
        else:
            try:
                leaves = pytree.tree_flatten_with_path(node)[0]
            except Exception:
                leaves = [((), t) for t in pytree.tree_leaves(node)]
            for path, leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    sub = [_key_text(k) for k in path]
                    has_name = named_path or any(not isinstance(k, pytree.SequenceKey) for k in path)
                    named.append(".".join(keys + sub) if has_name else None)

    walk(outputs, [], False)
    names = [n if n is not None else f"out_{i}" for i, n in enumerate(named)]
    if len(set(names)) != len(names):  # never two outputs of one name
        names = [f"{n}_{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]
    return names


def input_names(module: nn.Module, n: int) -> list[str]:
    """Names of n positional inputs: the forward's parameter names, input_i past them."""
    return _positional_names(unwrap(module), n) if not isinstance(module, CallAdapter) else module.input_names[:n]


def describe(output) -> dict | None:
    """The output structure, tensors numbered in the file's output order (the order of
    load.call.output_names: mapping items that are not None, sequence items by index)."""
    count = [0]

    def walk(node):
        if isinstance(node, torch.Tensor):
            count[0] += 1
            return {"tensor": count[0] - 1}
        if node is None:
            return None
        if isinstance(node, Mapping):
            cls = type(node)
            kind = "dict" if cls is dict else f"{cls.__module__}:{cls.__qualname__}"
            items = [(str(k), walk(v)) for k, v in node.items() if v is not None]
            return {"mapping": kind, "keys": [k for k, _ in items], "values": [v for _, v in items]}
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            return {"sequence": "list" if isinstance(node, list) else "tuple", "items": [walk(v) for v in node]}
        return {"other": type(node).__name__}

    return walk(output)
