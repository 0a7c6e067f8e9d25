"""The exported file's large weights predicted from the eager model, so that their write can start
before the export (issue 47 item 2; docs/design.md §8): convert --target ort of a causal LM checked
by path writes every weight into the check's data file, and on a 2-core machine that write (4.4 GB
for a 1.1B model) is the longest step after the export. Started from this plan it runs beside the
export instead of after it.

    with observe(module) as calls:            # each nn.Linear's input, by object, in call order
        module(*inputs)                       # (convert's one eager call)
    plan = predict(module, calls)             # Entries: the tensors the exported, packed file will hold
    ...                                       # written by llm.files.Workdir.write_planned
    recipe(tensor)                            # what an initializer's bytes are made of, to match a plan

A prediction, never trusted: what the exporter and the passes make is matched tensor by tensor
(`recipe`: the same memory read the same way is the same bytes) when the file is final
(llm.files.Workdir.adopt); an entry no initializer matches throws the plan away and the weights are
written from the file as before. What it predicts, from nothing but torch's module structure:
- an nn.Linear's weight [out, in] is a MatMul's [in, out] (the exporter's Transpose, folded by
  the optimizer into a transposed view of the parameter);
- nn.Linears called once each on the same input tensor (q / k / v, gate / up) are one MatMul over
  their weights concatenated along the output axis, in call order (llm.packing.pack_siblings);
- an nn.Linear called more than once is a MatMul of its own (its input not one value);
- every other parameter of a module that ran (embeddings, a tied embedding's own use, norms,
  biases) is itself.
Only tensors over PLAN_MIN_BYTES are planned; smaller ones are appended when the file is written."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict

from ..io import _uint_view

#: tensors planned from this many bytes on (onnx-ir's align threshold: these are 64 KiB aligned in the
#: data file); smaller ones are appended to it when the file is written (llm.files.Workdir._append)
PLAN_MIN_BYTES = 1 << 20


@dataclasses.dataclass
class Entry:
    """One tensor of the data file: the C-order bytes of `parts` concatenated along axis 1 (one part:
    its own C-order bytes); `name` says where it comes from."""

    name: str
    parts: list
    nbytes: int

    @property
    def key(self) -> tuple:
        return _key(self.parts)


class Calls:
    """What `observe` saw: each nn.Linear called, in call order, with the id of its input tensor, and
    every module called."""

    def __init__(self) -> None:
        self.order: list = []  # (module, id(input)) per call
        self.inputs: list = []  # the inputs themselves, held while observed (an id is unique while its object lives)
        self.called: set[int] = set()  # id() of every module called

    def linears(self) -> list:
        """(module, id(input) or None where it was called more than once), each Linear once, in call order."""
        count = defaultdict(int)
        for m, _ in self.order:
            count[id(m)] += 1
        seen, out = set(), []
        for m, x in self.order:
            if id(m) not in seen:
                seen.add(id(m))
                out.append((m, x if count[id(m)] == 1 else None))
        return out


@contextlib.contextmanager
def observe(module):
    """Forward pre-hooks on every nn.Linear of `module` for the time of the block; yields the Calls.
    A module that takes no hooks (a ScriptModule) yields an empty record."""
    from torch import nn

    calls = Calls()
    handles = []

    def linear(mod, args):
        calls.order.append((mod, id(args[0]) if args else None))
        calls.inputs.append(args[0] if args else None)

    def called(mod, args):
        calls.called.add(id(mod))

    try:
        for m in module.modules():
            handles.append(m.register_forward_pre_hook(called))
            if type(m) is nn.Linear:  # (subclasses may compute their weight: not predicted)
                handles.append(m.register_forward_pre_hook(linear))
    except (RuntimeError, AttributeError):  # ScriptModule: no hooks, nothing predicted
        for h in handles:
            h.remove()
        handles.clear()
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()
        calls.inputs.clear()


def predict(module, calls: Calls, min_bytes: int | None = None) -> list[Entry]:
    """The large tensors the exported file will hold (module docstring), in the module's order: of the
    modules that ran while observed."""
    import torch
    from torch import nn

    min_bytes = PLAN_MIN_BYTES if min_bytes is None else min_bytes
    linears = calls.linears()
    by_input: dict = defaultdict(list)
    for m, x in linears:
        by_input[x if x is not None else id(m)].append(m)  # (called more than once: a group of its own)
    planned_as_linear: set[int] = set()  # id() of the weights used as a MatMul's (transposed)
    entries: list[Entry] = []
    names = {id(m): n for n, m in module.named_modules()}
    for m, x in linears:
        group = by_input[x if x is not None else id(m)]
        if m is not group[0]:
            continue  # (planned with its group's first)
        kinds: dict = defaultdict(list)  # pack_siblings packs per (K, dtype)
        for g in group:
            kinds[(g.in_features, g.weight.dtype)].append(g)
        for members in kinds.values():
            parts = [_transposed(g.weight) for g in members]
            if any(p is None for p in parts):
                continue
            if len(members) == 1 or all(p.shape[0] == parts[0].shape[0] for p in parts):
                nbytes = sum(p.nbytes for p in parts)
                if nbytes > min_bytes:
                    entries.append(Entry("+".join(names.get(id(g), "?") for g in members), parts, nbytes))
                planned_as_linear.update(id(g.weight) for g in members)
    owners = _owners(module)
    for name, p in module.named_parameters():
        own = owners.get(id(p), [])
        if id(p) in planned_as_linear and all(type(m) is nn.Linear and attr == "weight" for m, attr in own):
            continue  # (used as a MatMul's weight alone)
        if not any(id(m) in calls.called for m, _ in own):
            continue  # (its modules not run: not in the file, or used by another module directly: appended)
        if not isinstance(p, torch.Tensor) or p.nbytes <= min_bytes:
            continue
        a = _array(p)
        if a is not None and a.flags.c_contiguous:
            entries.append(Entry(name, [a], a.nbytes))
    return entries


def _owners(module) -> dict:
    """id() of each parameter -> the (module, attribute) pairs that hold it (a tied weight: several)."""
    owners: dict = defaultdict(list)
    for m in module.modules():
        for attr, p in m.named_parameters(recurse=False):
            owners[id(p)].append((m, attr))
    return owners


def _array(t):
    """A CPU tensor's memory as an unsigned-integer numpy array of its item size (no copy), else None."""
    import torch

    if t.device.type != "cpu" or t.layout != torch.strided or t.is_conj() or t.is_neg():
        return None
    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    if kind is None or t.is_complex():
        return None
    try:
        a = t.detach().view(kind).numpy()
    except (RuntimeError, TypeError):
        return None
    return _uint_view(a)


def _transposed(weight):
    a = _array(weight)
    return a.T if a is not None and a.ndim == 2 else None


def _key(parts) -> tuple:
    """The bytes `parts` stand for, by what they read: memory address, shape, strides, item size."""
    return tuple((p.__array_interface__["data"][0], p.shape, p.strides, p.dtype.itemsize) for p in parts)


def recipe(t) -> tuple | None:
    """What initializer `t`'s bytes are made of (an Entry.key's form), read without copying: a packed
    projection's members (llm.packing), a strided view, or a tensor's own memory; None where unknown."""
    from ..io import _matrix, _parts

    parts = _parts(t)
    if parts is None:
        a = _matrix(t, None)
        if a is None:
            return None
        parts = [a]
    return _key(parts)
