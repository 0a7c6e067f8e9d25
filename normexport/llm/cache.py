"""A causal LM with its KV cache as flat tensors (docs/design.md §10).

`CacheLM(model)` is an nn.Module whose forward takes

    input_ids [batch, sequence], attention_mask [batch, past + sequence], position_ids [batch, sequence],
    past_key_values.{i}.key / .value [batch, kv_heads_i, past, head_dim_i]  (i = 0 .. layers - 1)

builds a transformers `DynamicCache` from the past tensors, runs the model with it and returns

    logits [batch, sequence, vocab], present.{i}.key / .value [batch, kv_heads_i, past + sequence, head_dim_i]

The same module is exported (torch.onnx, dynamo) and run eagerly by the generation check, so the
file and the eager reference share one cache semantics. Every layer is a full `DynamicLayer`:
sliding-window layers keep their whole past and the model's sliding mask applies the window (the
logits are those of a windowed cache; the cache grows with the context). One graph serves prefill
(past length 0) and decode (past length >= 1): the past length is a dynamic dim.

The cache's layout (layers, KV heads, head size per layer) is read from the model itself by one
forward of one token with `use_cache=True`, never from config attribute names.
"""

from __future__ import annotations

import dataclasses
import inspect
import types

import torch
from torch import nn

from ..errors import UsageError

INPUT_NAMES = ("input_ids", "attention_mask", "position_ids")
KV = ("key", "value")
#: names of the dims of the file's inputs and outputs (the exporter's s0, s1, ... renamed)
DIM_BATCH, DIM_SEQUENCE, DIM_PAST, DIM_TOTAL = "batch", "sequence", "past_sequence", "total_sequence"


def past_names(layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in KV]


def present_names(layers: int) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(layers) for kv in KV]


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Per cache layer: (KV heads, head size) of keys and of values; the cache dtype."""

    keys: tuple[tuple[int, int], ...]
    values: tuple[tuple[int, int], ...]
    dtype: torch.dtype

    @property
    def layers(self) -> int:
        return len(self.keys)

    def empty(self, batch: int, past: int, generator: torch.Generator | None = None, dtype=None) -> list[torch.Tensor]:
        """past_key_values tensors of `past` positions (random values: an example for export)."""
        out = []
        for (hk, dk), (hv, dv) in zip(self.keys, self.values):
            for h, d in ((hk, dk), (hv, dv)):
                out.append(torch.randn(batch, h, past, d, generator=generator, dtype=torch.float32).to(dtype or self.dtype))
        return out


class NoKVCache(UsageError):
    """The model's cache is not what CacheLM carries (a KV cache of [batch, heads, past, head_dim]
    tensors, one key and one value per layer): `reason` says what the layout probe saw."""

    def __init__(self, reason: str):
        super().__init__(f"{reason}: export it with --task text-generation")
        self.reason = reason


def cache_argument(model: nn.Module) -> str:
    """The forward keyword that takes the cache: `cache` (transformers >= 5.x) or `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise NoKVCache(f"{type(model).__name__}.forward takes no KV cache (no `cache` / `past_key_values` parameter)")


def output_cache(out):
    """The cache object a transformers causal-LM output returns."""
    for name in ("cache", "past_key_values"):
        c = getattr(out, name, None) if not isinstance(out, dict) else out.get(name)
        if c is not None:
            return c
    return None


def _holds_tensor(value) -> bool:
    """A tensor of at least one dim, or a container of them (per-sequence state; a 0-dim tensor
    is a setting, e.g. a sliding layer's window size)."""
    if isinstance(value, torch.Tensor):
        return value.dim() >= 1
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, (list, tuple)) and any(_holds_tensor(v) for v in value)


def layer_state(layer) -> tuple[bool, list[str]]:
    """(holds keys and values, names of the other tensor state it holds: conv / recurrent (SSM)
    states, indexer keys, ...): read from the layer object's attributes, whatever its class."""
    kv = isinstance(getattr(layer, "keys", None), torch.Tensor) and isinstance(getattr(layer, "values", None),
                                                                               torch.Tensor)
    attrs = vars(layer) if hasattr(layer, "__dict__") else {}
    other = [n for n, v in attrs.items() if n not in KV + ("keys", "values") and _holds_tensor(v)]
    return kv, other


def _layers_text(indices: list[int], total: int) -> str:
    if len(indices) == total:
        return f"its {total} layer{'s' if total > 1 else ''}" if total > 1 else "its layer"
    runs, start = [], None
    for i, j in zip(indices, indices[1:] + [None]):
        start = i if start is None else start
        if j != i + 1:
            runs.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ("layer " if len(indices) == 1 else "layers ") + ", ".join(runs)


def cache_tensors(cache, owner: str = "the model") -> list[torch.Tensor]:
    """The flat [k0, v0, k1, v1, ...] of a transformers Cache whose every layer holds keys and
    values and nothing else; else NoKVCache saying what the layers hold (SSM / recurrent state,
    nothing: layers sharing another's cache or without attention)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise NoKVCache(f"{owner} returns a {type(cache).__name__}, not a transformers Cache of key / value layers")
    groups: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        kv, other = layer_state(layer)
        what = ", ".join((["keys / values"] if kv else []) + other) or "no state (shares another layer's or has none)"
        groups.setdefault(what, []).append(i)
    if list(groups) != ["keys / values"]:
        n = len(layers)
        held = "; ".join(f"{_layers_text(ix, n)} hold{'s' if len(ix) == 1 else ''} {what}"
                         for what, ix in groups.items())
        raise NoKVCache(f"{owner}'s cache is not a KV cache of [batch, heads, past, head_dim] tensors only ({held})")
    flat = []
    for layer in layers:
        flat += [layer.keys, layer.values]
    return flat


def probe_layout(model: nn.Module) -> CacheLayout:
    """The cache layout from one forward of one token (batch 1) with use_cache=True; NoKVCache
    (a UsageError with the reason) when the model's cache is not a KV cache CacheLM can carry."""
    name = type(model).__name__
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    except Exception as e:  # noqa: BLE001
        raise NoKVCache(f"{name} does not run with use_cache=True ({str(e).strip()[:160]})") from None
    if getattr(out, "logits", None) is None:
        raise NoKVCache(f"{name} returns no logits")
    cache = output_cache(out)
    if cache is None:
        fields = [k for k, v in (out.items() if hasattr(out, "items") else []) if v is not None and k != "logits"]
        state = ", ".join(f"`{k}` ({_describe(out[k])})" for k in fields)
        raise NoKVCache(f"{name} returns no transformers cache" + (f" (its state: {state})" if state else ""))
    flat = cache_tensors(cache, name)
    for t in flat:
        if t.dim() != 4 or t.shape[0] != 1 or t.shape[2] != 1:
            raise NoKVCache(f"{name}'s cache holds tensors of shape {list(t.shape)}, not "
                            "[batch, heads, positions, head_dim]")
    cache_argument(model)
    keys = tuple((int(k.shape[1]), int(k.shape[3])) for k in flat[0::2])
    values = tuple((int(v.shape[1]), int(v.shape[3])) for v in flat[1::2])
    return CacheLayout(keys, values, flat[0].dtype)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return "a tensor " + "x".join(map(str, value.shape))
    if isinstance(value, (list, tuple)):
        tensors = " tensors" if value and all(isinstance(v, torch.Tensor) for v in value) else ""
        return f"a {type(value).__name__} of {len(value)}{tensors}"
    return f"a {type(value).__name__}"


class FlatCacheLM(nn.Module):
    """The file's interface (module docstring), shared by every model exported with its cache:
    forward(input_ids, attention_mask, position_ids, *past) -> (logits, *present), one named
    positional parameter per input. A subclass sets `layout` and `vocab_size`, calls
    `_bind_names()` and implements `_forward`; `label` names the model in reports, `generates`
    is the transformers model whose `generate` the check compares with (None: none)."""

    layout: CacheLayout
    vocab_size: int
    label: str
    generates: nn.Module | None = None

    def _bind_names(self) -> None:
        self.input_names = list(INPUT_NAMES) + past_names(self.layout.layers)
        self.output_names = ["logits"] + present_names(self.layout.layers)
        # one named positional parameter per input (torch.export binds dynamic shapes, and
        # normexport.load names inputs, by the forward's signature; *past would be one tuple)
        params = [inspect.Parameter(n.replace(".", "_"), inspect.Parameter.POSITIONAL_OR_KEYWORD)
                  for n in self.input_names]

        def forward(module, *inputs):
            return module._forward(*inputs)

        forward.__signature__ = inspect.Signature(
            [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + params)
        # a bound method: copy.deepcopy rebinds it to the copy (the float64 reference is one)
        self.forward = types.MethodType(forward, self)

    def _forward(self, input_ids, attention_mask, position_ids, *past):
        raise NotImplementedError

    def example_inputs(self, batch: int = 2, sequence: int = 3, past: int = 5, seed: int = 0) -> tuple:
        """Inputs for export: distinct sizes per dim (torch.export gives equal sizes one symbol),
        each >= 2 (sizes 0 / 1 are specialised); the file serves past length 0 too."""
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, max(self.vocab_size, 2), (batch, sequence), generator=g)
        mask = torch.ones(batch, past + sequence, dtype=torch.long)
        pos = torch.arange(past, past + sequence).expand(batch, sequence).contiguous()
        return (ids, mask, pos, *self.layout.empty(batch, past, g))

    def dynamic_axes(self) -> dict[str, list[int]]:
        axes = {"input_ids": [0, 1], "attention_mask": [0, 1], "position_ids": [0, 1]}
        axes.update({n: [0, 2] for n in past_names(self.layout.layers)})
        return axes


class CacheLM(FlatCacheLM):
    """forward(input_ids, attention_mask, position_ids, *past) -> (logits, *present) (module docstring)."""

    def __init__(self, model: nn.Module, layout: CacheLayout | None = None):
        super().__init__()
        self.inner = model
        self.layout = layout or probe_layout(model)
        self._cache_arg = cache_argument(model)
        # what resolve.cast reads: the modules the class keeps in float32
        self._keep_in_fp32_modules = getattr(model, "_keep_in_fp32_modules", None)
        self.vocab_size = getattr(getattr(model, "config", None), "vocab_size", None) or 2
        self.label = type(model).__name__
        self._bind_names()

    @property
    def generates(self) -> nn.Module:
        return self.inner

    def _forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        if len(past) != 2 * self.layout.layers:
            raise ValueError(f"expected {2 * self.layout.layers} past tensors, got {len(past)}")
        cache = DynamicCache(ddp_cache_data=list(zip(past[0::2], past[1::2])))
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{self._cache_arg: cache})
        return (out.logits, *cache_tensors(output_cache(out)))


def name_dims(model_ir, layers: int) -> None:
    """Give the file's symbolic dims their meaning (batch, sequence, past_sequence,
    total_sequence) in place of the exporter's s0, s1, ...: every value of the main graph whose
    dims use a renamed symbol gets the new name (sums written out, e.g. `past_sequence + sequence`)."""
    import re

    import onnx_ir as ir

    inputs = {v.name: v for v in model_ir.graph.inputs}
    rename: dict[str, str] = {}

    def take(name, axis, meaning):
        v = inputs.get(name)
        if v is None or v.shape is None or axis >= len(v.shape):
            return
        d = v.shape[axis]
        if isinstance(d, ir.SymbolicDim) and d.value and re.fullmatch(r"[a-z]\d+", d.value):
            rename.setdefault(d.value, meaning)

    for n in INPUT_NAMES:
        take(n, 0, DIM_BATCH)
    take("input_ids", 1, DIM_SEQUENCE)
    take("position_ids", 1, DIM_SEQUENCE)
    take("attention_mask", 1, DIM_TOTAL)
    for n in past_names(layers):
        take(n, 0, DIM_BATCH)
        take(n, 2, DIM_PAST)
    if not rename:
        return
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(rename, key=len, reverse=True))) + r")\b")

    def fix(value):
        if value.shape is None:
            return
        dims, changed = [], False
        for d in value.shape:
            if isinstance(d, ir.SymbolicDim) and d.value and pattern.search(d.value):
                d = ir.SymbolicDim(pattern.sub(lambda m: rename[m.group(1)], d.value))
                changed = True
            dims.append(d)
        if changed:
            value.shape = ir.Shape(dims)

    for v in model_ir.graph.inputs:
        fix(v)
    for node in model_ir.graph:
        for v in node.outputs:
            fix(v)
    for v in model_ir.graph.outputs:
        fix(v)
