"""A `.pt2` program that takes a KV cache, seen through the file's cache interface (docs/design.md §10).

A torch.export program's call is fixed at export, but where it takes a KV cache and returns the
grown cache it can still generate: `ProgramLM(program)` is a `FlatCacheLM` (input_ids,
attention_mask, position_ids, past_key_values.{i}.key / .value -> logits, present.{i}.key /
.value) that feeds the program its own inputs in its own order. Nothing is read from names but
the token inputs' roles (`input_ids`, and where the program takes them `attention_mask`,
`position_ids`, `cache_position`: the parameter names of transformers' forward, which
torch.export keeps); which inputs are the cache and which outputs its grown copies is found by
running the program once on its own example inputs:

- logits: the first floating output of shape [batch, sequence, vocab] (batch, sequence: input_ids');
- each floating input of rank >= 3 is a past tensor [batch, heads, past, head_dim] whose present is
  the one output of the same shape but longer along dim 2 by the sequence, whose first positions
  equal the past exactly (a KV cache appends: this pairs them and proves it), dim 2 dynamic;
- the program then runs again with an empty cache (past length 0: the prefill).

The program is run without its input guards: torch.export records past >= 2 for a dynamic dim
(sizes 0 and 1 are specialised while tracing), which a prefill with an empty cache violates; the
graph itself is shape-generic, and the file exported from it serves past length 0 alike.

`NoKVCache` (a UsageError with the reason) where any of this does not hold: an input with no role,
a static past length or sequence, a cache that is not [batch, heads, past, head_dim], no logits.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..load.call import CallAdapter
from ..load.model import LoadedModel
from .cache import CacheLayout, FlatCacheLM, NoKVCache

#: the token inputs a program may take, by the names transformers' forward gives them
ROLES = ("input_ids", "attention_mask", "position_ids", "cache_position")


def takes_cache(loaded: LoadedModel) -> bool:
    """The program may be a causal LM with a cache: an `input_ids` input and a floating input of rank
    >= 3 (whether it is a KV cache, ProgramLM finds out by running it)."""
    names = loaded.input_names or []
    example = loaded.example_inputs or ()
    return "input_ids" in names and any(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 3
                                        for t in example)


def _unguarded(loaded: LoadedModel) -> nn.Module:
    """The program's module without its input guards (module docstring), in the call adapter the
    loader put around it (nested or keyword inputs)."""
    ep = loaded.exported_program
    module = ep.module(check_guards=False)
    module.validate_inputs = False  # the range checks of torch.export's pre-hook
    return loaded.module.with_inner(module) if isinstance(loaded.module, CallAdapter) else module


def _flat_outputs(out) -> list:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _grown_dim(past: torch.Tensor, out: torch.Tensor, sequence: int) -> int | None:
    """The dim along which `out` is `past` with `sequence` positions appended, else None."""
    if out.dim() != past.dim() or out.dtype != past.dtype:
        return None
    dims = [d for d in range(past.dim()) if out.shape[d] != past.shape[d]]
    if len(dims) != 1 or out.shape[dims[0]] != past.shape[dims[0]] + sequence:
        return None
    d = dims[0]
    return d if torch.equal(out.narrow(d, 0, past.shape[d]), past) else None


class ProgramLM(FlatCacheLM):
    """A .pt2 program with a KV cache as the file's interface (module docstring)."""

    def __init__(self, loaded: LoadedModel, label: str = "the program"):
        super().__init__()
        names = list(loaded.input_names or [])
        example = tuple(loaded.example_inputs or ())
        self.label = label
        if len(names) != len(example) or "input_ids" not in names:
            raise NoKVCache(f"{label} has no input_ids input among its tensor inputs ({', '.join(names) or 'none'})")
        self.roles = {r: names.index(r) for r in ROLES if r in names}
        ids = example[self.roles["input_ids"]]
        if ids.dim() != 2 or ids.is_floating_point():
            raise NoKVCache(f"{label}'s input_ids is not [batch, sequence] token ids ({list(ids.shape)}, {ids.dtype})")
        self.past_slots = [i for i, t in enumerate(example) if i not in self.roles.values()]
        stray = [names[i] for i in self.past_slots if not (example[i].is_floating_point() and example[i].dim() >= 3)]
        if stray:
            raise NoKVCache(f"{label}'s input{'s' if len(stray) > 1 else ''} {', '.join(stray)} "
                            f"{'are' if len(stray) > 1 else 'is'} neither a token input ({', '.join(ROLES)}) nor a "
                            "cache tensor")
        if not self.past_slots or len(self.past_slots) % 2:
            raise NoKVCache(f"{label} takes {len(self.past_slots)} cache tensors: a KV cache has one key and one "
                            "value per layer")
        dynamic = loaded.dynamic_axes or {}
        if 1 not in dynamic.get("input_ids", []):
            raise NoKVCache(f"{label} was exported with a static sequence length ({ids.shape[1]}): prefill and "
                            "decode need input_ids' dim 1 dynamic")
        self.inner = _unguarded(loaded)
        batch, sequence = ids.shape
        with torch.no_grad():
            outs = _flat_outputs(self.inner(*example))
        self.logits_slot = next((j for j, o in enumerate(outs) if o.is_floating_point() and o.dim() == 3
                                 and tuple(o.shape[:2]) == (batch, sequence)), None)
        if self.logits_slot is None:
            raise NoKVCache(f"{label} returns no logits of shape [batch, sequence, vocab] = [{batch}, {sequence}, V]")
        self.vocab_size = int(outs[self.logits_slot].shape[-1])
        self.present_slots = []
        for i in self.past_slots:
            past = example[i]
            if past.dim() != 4 or past.shape[2] < 1:
                raise NoKVCache(f"{label}'s cache input {names[i]} of shape {list(past.shape)} is not [batch, heads, "
                                "past, head_dim] with a past of at least one position in its example")
            hits = [j for j, o in enumerate(outs) if j != self.logits_slot and _grown_dim(past, o, sequence) == 2]
            if len(hits) != 1:
                what = "no output that is" if not hits else f"{len(hits)} outputs that are"
                raise NoKVCache(f"{label} returns {what} its cache input {names[i]} with the {sequence} new positions "
                                "appended along dim 2")
            if 2 not in dynamic.get(names[i], []):
                raise NoKVCache(f"{label} was exported with a static past length ({past.shape[2]} positions in "
                                f"{names[i]}): a cache that grows needs dim 2 dynamic")
            self.present_slots.append(hits[0])
        pasts = [example[i] for i in self.past_slots]
        self.layout = CacheLayout(tuple((int(k.shape[1]), int(k.shape[3])) for k in pasts[0::2]),
                                  tuple((int(v.shape[1]), int(v.shape[3])) for v in pasts[1::2]), pasts[0].dtype)
        self._bind_names()
        try:  # the prefill: an empty cache
            with torch.no_grad():
                first = self(*self.example_inputs(batch=batch, sequence=sequence, past=0))
        except Exception as e:  # noqa: BLE001
            raise NoKVCache(f"{label} does not run with an empty cache (past length 0, the prefill): "
                            f"{str(e).strip().splitlines()[-1][:160] if str(e).strip() else type(e).__name__}") from None
        if tuple(first[1].shape[2:3]) != (sequence,):
            raise NoKVCache(f"{label}'s cache does not grow by the sequence from an empty cache")

    def _forward(self, input_ids, attention_mask, position_ids, *past):
        n = len(self.roles) + len(self.past_slots)
        inputs: list = [None] * n
        given = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                 "cache_position": position_ids[0]}
        for role, slot in self.roles.items():
            inputs[slot] = given[role]
        for slot, t in zip(self.past_slots, past):
            inputs[slot] = t
        outs = _flat_outputs(self.inner(*inputs))
        return (outs[self.logits_slot], *(outs[j] for j in self.present_slots))
