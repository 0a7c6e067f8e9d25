"""Export a deep stack of identical blocks once, shallow, and grow the file to full depth (issue 31
item 3: torch.export's trace and decompositions grow with the number of layers; a 22-layer LLaMA
spends ~35 s there on 2 cores, a 2-layer copy of it ~5 s).

    stack = find_stack(module)               # the longest nn.ModuleList of identical blocks, or None
    with shallow(stack, 2):                  # the list (and the config's layer count) cut to 2 blocks
        small = export(...)                  # the dynamo exporter's file, not optimized
    full = grow(small, stack, weights=..., io_layer=...)   # blocks 2 .. n-1 copied from block 1

What makes a stack growable (checked, else the caller exports the whole model):
- torch side (`find_stack`): every block has the same class, the same parameter / buffer names,
  shapes and dtypes, and the same plain attributes in every submodule (but one that is each block's
  own index: `layer_idx`). A block whose behaviour depends on its index through anything
  else (a sliding-window layer every sixth block, `layer_types`) differs in an attribute and the
  stack is not grown.
- file side (`grow`): block 1, the template (its nodes by the exporter's name scopes; constants are
  shared values), matches block 0 node for node in order (the same ops with the same attributes),
  but for nodes of block 0 that the exporter put there as sizes shared by every block: those block 1
  reads (or the graph after the stack), and nothing else (`_only_shared_extras`). Block 1 reads from
  block 0 what block 0 reads from the stack's input, and every other input is the same value for
  both (shared) or the same per-block input / weight with the block's index in its name. Where two
  blocks do not match (issue 47 item 2: 1.3 s less trace on TinyLlama than three), the stack is
  traced DEEPER (3) and block 2 must match block 1 exactly, reading from block 1 what block 1 reads
  from block 0 (an output of the same op).
Copies read the per-block weights from the full model by name (`weights`); a weight the optimizer
folded into a view (a transposed MatMul weight) is the same view of the block's weight. Per-block
graph inputs and outputs are named by `io_layer`. The shallow file is optimized as torch.onnx would
(onnxscript's optimizer) before it grows; one that does not grow then is grown first and optimized
whole. The grown file is checked against eager by the caller (convert: the attention fusion's local
check, the generation check)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from typing import Callable

import onnx_ir as ir
import torch
from torch import nn

#: a stack is grown from a shallow export only from this many blocks (below: the whole trace is cheap)
MIN_BLOCKS = 6
#: blocks kept in the shallow export: block 0 and block 1, the template, checked against block 0 (whose
#: extra nodes are the exporter's shared sizes, read by block 1: `_only_shared_extras`)
SHALLOW = 2
#: the deeper trace where the two blocks do not match: block 0, block 1, block 2 (the template, checked
#: against block 1 node for node)
DEEPER = 3

_SKIP_ATTRS = {"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set"}
_SCOPES = "pkg.torch.onnx.name_scopes"


class NotGrowable(Exception):
    """The shallow file cannot be grown (the reason); the caller exports the whole model."""


@dataclasses.dataclass
class Stack:
    """A ModuleList of `len(blocks)` identical blocks at `path` (its qualified name in the module
    exported), owned by `owner` as attribute `attr`; `counts`: (object, attribute) of the config
    entries that hold the block count, `lists`: those holding one entry per block."""

    path: str
    owner: nn.Module
    attr: str
    blocks: nn.ModuleList
    counts: list = dataclasses.field(default_factory=list)
    lists: list = dataclasses.field(default_factory=list)

    @property
    def depth(self) -> int:
        return len(self.blocks)


def find_stack(module: nn.Module, min_blocks: int = MIN_BLOCKS) -> Stack | None:
    """The longest ModuleList of at least `min_blocks` identical blocks (module docstring) whose
    count the model's config states, or None."""
    best = None
    for name, m in module.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) < min_blocks or (best and len(m) <= best.depth):
            continue
        if not _uniform(m):
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        best = Stack(name, owner, attr, m)
    if best is None:
        return None
    for cfg in _configs(module):
        for key, value in vars(cfg).items():
            if isinstance(value, int) and not isinstance(value, bool) and value == best.depth and "layer" in key:
                best.counts.append((cfg, key))
            elif isinstance(value, (list, tuple)) and len(value) == best.depth and "layer" in key:
                if len(set(map(repr, value))) > 1:
                    return None  # per-block settings that differ (layer_types mixing sliding and full)
                best.lists.append((cfg, key))
    return best if best.counts else None


def _configs(module: nn.Module) -> list:
    seen, out = set(), []
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "__dict__") and id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
            sub = getattr(cfg, "get_text_config", None)
            text = sub() if callable(sub) else None
            if text is not None and id(text) not in seen:
                seen.add(id(text))
                out.append(text)
    return out


def _signature(block: nn.Module):
    """What must be equal between two blocks: per submodule its class, tensors' names / shapes /
    dtypes and plain attributes (objects by identity: the shared config is equal, per-block
    objects are not; a functools.partial by its function and arguments)."""
    sig = []
    for name, sub in block.named_modules():
        tensors = [(n, tuple(t.shape), t.dtype) for n, t in list(sub._parameters.items()) + list(sub._buffers.items())
                   if t is not None]
        sig.append((name, type(sub), tuple(tensors)))
        for k, v in sorted(vars(sub).items()):
            if k in _SKIP_ATTRS or k.startswith("_forward") or k.startswith("_backward") or k.startswith("_state_dict") \
                    or k.startswith("_load_state_dict") or isinstance(v, (nn.Module, torch.Tensor)):
                continue
            if isinstance(v, functools.partial):  # made per block (transformers' GELUTanh.act): equal by what it calls
                v = ("partial", id(v.func), repr(v.args), repr(sorted(v.keywords.items())))
            elif not isinstance(v, (int, float, str, bool, type(None), tuple, list)):
                v = ("object", id(v))
            sig.append((name, k, repr(v)))
    return sig


def _uniform(blocks: nn.ModuleList) -> bool:
    """Every block's signature equal, but for entries that are each block's own index (layer_idx)."""
    sigs = [_signature(b) for b in blocks]
    if any(len(s) != len(sigs[0]) for s in sigs):
        return False
    for entries in zip(*sigs):
        if all(e == entries[0] for e in entries):
            continue
        if all(len(e) == 3 and e[:2] == entries[0][:2] and e[2] == repr(i) for i, e in enumerate(entries)):
            continue  # the block's index
        return False
    return True


@contextlib.contextmanager
def shallow(stack: Stack, keep: int = SHALLOW):
    """The stack cut to its first `keep` blocks (and the config's counts / per-block lists with it)
    inside the block; all restored on the way out."""
    saved_counts = [(c, k, getattr(c, k)) for c, k in stack.counts]
    saved_lists = [(c, k, getattr(c, k)) for c, k in stack.lists]
    setattr(stack.owner, stack.attr, nn.ModuleList(list(stack.blocks)[:keep]))
    try:
        for c, k, _ in saved_counts:
            setattr(c, k, keep)
        for c, k, v in saved_lists:
            setattr(c, k, type(v)(list(v)[:keep]))
        yield
    finally:
        setattr(stack.owner, stack.attr, stack.blocks)
        for c, k, v in saved_counts + saved_lists:
            setattr(c, k, v)


# ---- the file side -----------------------------------------------------------------------------------------

def _block_of(node: ir.Node, pattern: re.Pattern) -> int | None:
    m = pattern.search(node.metadata_props.get(_SCOPES, ""))
    return int(m.group(1)) if m else None


def _signature_of(node: ir.Node) -> tuple:
    return (node.op_type, node.domain, node.overload, len(node.inputs), len(node.outputs),
            repr(sorted((k, repr(a.value)) for k, a in node.attributes.items())))


def grow(model: ir.Model, stack: Stack, *, weights: Callable[[str], torch.Tensor],
         io_layer: Callable[[str], tuple[int, Callable[[int], str]] | None], keep: int = SHALLOW) -> int:
    """Grow `model` (the dynamo exporter's file of the stack cut to `keep` blocks, in place) to
    `stack.depth` blocks; returns the number of blocks added. `weights(name)`: the full model's
    tensor of that qualified name; `io_layer(name)`: (block, name_of(block)) of a per-block graph
    input / output (the cache's past_key_values.i.key), None for the others. NotGrowable says why
    the file is not grown (then `model` is unchanged).

    The last block is the template; it is checked against the block before it, the reference: node
    for node (DEEPER), or (SHALLOW: the reference is block 0) against the nodes of block 0 it matches
    in order, block 0's others being the exporter's shared sizes that block 1 reads
    (`_only_shared_extras`)."""
    from torch.onnx._internal.exporter._core import TorchTensor

    graph = model.graph
    pattern = re.compile(re.escape(stack.path) + r"\.(\d+)(?:['.]|$)")
    nodes = list(graph)
    blocks: dict[int, list[ir.Node]] = {}
    for n in nodes:
        b = _block_of(n, pattern)
        if b is not None and not _is_constant(n):  # constants: shared values (the exporter reuses them across blocks)
            blocks.setdefault(b, []).append(n)
    if sorted(blocks) != list(range(keep)):
        raise NotGrowable(f"the file's blocks by name scope are {sorted(blocks)}, not 0..{keep - 1}")
    _attach_readers(nodes, blocks, pattern, io_layer)
    prev, this = keep - 2, keep - 1  # the reference block and the template
    ref, tmpl = blocks[prev], blocks[this]
    before = set(blocks[prev - 1]) if prev >= 1 else set()  # the block the reference reads (DEEPER)
    in_blocks = {n for b in blocks.values() for n in b}
    exact = keep > SHALLOW
    if exact and len(ref) != len(tmpl):
        raise NotGrowable(f"blocks {prev} / {this} have {len(ref)} / {len(tmpl)} nodes")
    if any(any(isinstance(a.value, (ir.Graph, list)) and a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
               for a in n.attributes.values()) for n in tmpl):
        raise NotGrowable("a block holds a subgraph (If / Loop)")
    t_index = {n: k for k, n in enumerate(tmpl)}
    r_index: dict[ir.Node, int] = {}  # a reference node -> the template index of the node it matches
    ref_set = set(ref)
    views = _Views(stack, weights, keep)
    weight_re = re.compile(re.escape(stack.path) + r"\.(\d+)\.")
    graph_inputs = {v.name: v for v in graph.inputs}
    initializers = graph.initializers

    def stack_input(v_prev, p_prev) -> bool:
        """SHALLOW: v_prev, read by block 0, is the stack's input (made outside the blocks, or a graph
        input that is not a per-block one) and block 1 does not read it."""
        outside = p_prev not in in_blocks if p_prev is not None else \
            v_prev.name in graph_inputs and io_layer(v_prev.name) is None
        return not exact and outside and not any(u in t_index for u, _ in v_prev.uses())

    def role(v_prev, v_this):
        """How the template reads v_this where the reference reads v_prev."""
        if v_this is v_prev:
            return ("shared",)
        if v_this is None or v_prev is None:
            raise NotGrowable("an optional input present in one block only")
        p_prev, p_this = v_prev.producer(), v_this.producer()
        if p_this is not None and p_prev is not None and _is_constant(p_this) and _is_constant(p_prev):
            if {k: repr(a.value) for k, a in p_this.attributes.items()} == \
                    {k: repr(a.value) for k, a in p_prev.attributes.items()}:
                return ("shared",)  # equal constants: the copies read the template's
            raise NotGrowable(f"blocks {prev} and {this} read different constants")
        if p_this is not None and p_prev is not None and p_this not in t_index and p_this not in r_index \
                and p_prev not in r_index and p_prev not in before and p_this.op_type == p_prev.op_type \
                and _sizes_only(v_this) and _sizes_only(v_prev):
            return ("shared",)  # a size read from each block's own cache input: the same in every call
        if p_this is not None and p_prev is not None:
            if p_this in t_index and p_prev in r_index and t_index[p_this] == r_index[p_prev] \
                    and v_this.index() == v_prev.index():
                return ("own", t_index[p_this], v_this.index())
            if p_this in ref_set and v_this.index() == v_prev.index() and (
                    (p_prev in before and p_this.op_type == p_prev.op_type)  # the block before's output (blocks 0
                    or stack_input(v_prev, p_prev)):  # and 1 may differ in the exporter's shared sizes)
                return ("previous", p_this, v_this.index())  # its template index once aligned
            raise NotGrowable(f"{v_this.name} / {v_prev.name}: blocks {prev} and {this} read different values")
        if p_prev is None and p_this in ref_set and stack_input(v_prev, p_prev):
            return ("previous", p_this, v_this.index())  # block 0 reads the stack's input as a graph input
        if v_this.name in initializers and v_prev.name in initializers:
            m_this, m_prev = weight_re.match(v_this.name), weight_re.match(v_prev.name)
            if m_this and m_prev and int(m_this.group(1)) == this and int(m_prev.group(1)) == prev \
                    and v_this.name[m_this.end():] == v_prev.name[m_prev.end():]:
                return ("weight", v_this.name[m_this.end():])
            a, b = views.of(v_this), views.of(v_prev)  # folded by the optimizer: a view of one weight each
            if a and b and a[1:] == b[1:]:
                m_this, m_prev = weight_re.match(a[0]), weight_re.match(b[0])
                if m_this and m_prev and int(m_this.group(1)) == this and int(m_prev.group(1)) == prev \
                        and a[0][m_this.end():] == b[0][m_prev.end():]:
                    return ("view", a[0][m_this.end():], a[1:])
            raise NotGrowable(f"initializers {v_prev.name} / {v_this.name} are not one weight of blocks {prev} / {this}")
        if v_this.name in graph_inputs and v_prev.name in graph_inputs:
            a, b = io_layer(v_this.name), io_layer(v_prev.name)
            if a and b and a[0] == this and b[0] == prev and b[1](this) == v_this.name:
                return ("input", a[1])
        raise NotGrowable(f"{v_prev.name} / {v_this.name}: not one role in blocks {prev} and {this}")

    roles = []  # per node of the template, per input: its role
    pos = 0  # the reference's nodes before it are matched or skipped
    for k, n2 in enumerate(tmpl):
        sig, why = _signature_of(n2), None
        for j in range(pos, pos + 1 if exact else len(ref)):
            n1 = ref[j]
            if _signature_of(n1) != sig:
                why = why or NotGrowable(f"blocks {prev} and {this} differ at {n1.op_type} / {n2.op_type}")
                continue
            try:
                rs = [role(v1, v2) for v1, v2 in zip(n1.inputs, n2.inputs)]
            except NotGrowable as e:
                why = e
                continue
            r_index[n1] = k
            roles.append(rs)
            pos = j + 1
            break
        else:
            raise why or NotGrowable(f"block {this}'s {n2.op_type} has no counterpart in block {prev}")
    for rs in roles:  # the reference's outputs the template reads: by their template index
        for i, r in enumerate(rs):
            if r[0] == "previous":
                if r[1] not in r_index:
                    raise NotGrowable(f"block {this} reads a value of block {prev} that has no counterpart in it "
                                      f"({r[1].op_type})")
                rs[i] = ("previous", r_index[r[1]], r[2])
    if not exact:
        _only_shared_extras(ref, r_index, t_index, in_blocks)
    # the template's values read outside the blocks: per-block graph outputs, and the stack's output
    outputs = {v.name: v for v in graph.outputs}
    tail = []  # (node index, output index, its consumers outside the blocks)
    for k, n in enumerate(tmpl):
        for v in n.outputs:
            users = [(u, i) for u, i in v.uses() if u not in t_index]
            out_pos = [i for i, o in enumerate(graph.outputs) if o is v]
            if out_pos and io_layer(v.name) is None:
                raise NotGrowable(f"graph output {v.name} comes from block {this} and names no block")
            if users:
                tail.append((k, v.index(), users))
    per_block_outputs = [(k, v.index(), io_layer(v.name)[1]) for k, n in enumerate(tmpl) for v in n.outputs
                         if v.name in outputs and io_layer(v.name) is not None]

    # every weight the copies read, found (and its shape checked) before the graph changes
    tensors = {}
    for n2, rs in zip(tmpl, roles):
        for v, r in zip(n2.inputs, rs):
            if r[0] == "view":
                for b in range(keep, stack.depth):
                    tensors[(v.name, b)] = views.make(f"{stack.path}.{b}.{r[1]}", r[2])
            if r[0] != "weight":
                continue
            for b in range(keep, stack.depth):
                name = f"{stack.path}.{b}.{r[1]}"
                try:
                    t = weights(name)
                except KeyError:
                    raise NotGrowable(f"the model has no weight {name}") from None
                if v.const_value is None or tuple(t.shape) != tuple(v.const_value.shape) or \
                        TorchTensor(t[:0]).dtype != v.const_value.dtype:
                    raise NotGrowable(f"{name} is not shaped as block {this}'s {v.name}")
                tensors[name] = t
    # ---- grow: blocks keep .. depth-1, each a copy of the template reading the block before it
    prev_nodes = tmpl
    new_inputs, new_outputs, new_inits = [], [], []
    added = 0
    for b in range(keep, stack.depth):
        copies: list[ir.Node] = []
        for k, (n2, rs) in enumerate(zip(tmpl, roles)):
            ins = []
            for v, r in zip(n2.inputs, rs):
                if r[0] == "shared":
                    ins.append(v)
                elif r[0] == "own":
                    ins.append(copies[r[1]].outputs[r[2]])
                elif r[0] == "previous":
                    ins.append(prev_nodes[r[1]].outputs[r[2]])
                elif r[0] == "weight":
                    name = f"{stack.path}.{b}.{r[1]}"
                    init = initializers.get(name)
                    if init is None:
                        init = ir.Value(name=name, shape=v.shape, type=v.type,
                                        const_value=TorchTensor(tensors[name], name=name))
                        new_inits.append(init)
                        initializers[name] = init
                    ins.append(init)
                elif r[0] == "view":  # the same view of this block's weight (the optimizer folded the template's)
                    name = f"{v.name}__b{b}"
                    init = ir.Value(name=name, shape=v.shape, type=v.type,
                                    const_value=ir.Tensor(tensors[(v.name, b)], dtype=v.const_value.dtype, name=name))
                    new_inits.append(init)
                    initializers[name] = init
                    ins.append(init)
                else:  # a per-block graph input
                    name = r[1](b)
                    gi = graph_inputs.get(name)
                    if gi is None:
                        gi = graph_inputs[name] = ir.Value(name=name, shape=v.shape, type=v.type)
                        new_inputs.append(gi)
                    ins.append(gi)
            attrs = list(n2.attributes.values())
            scopes = n2.metadata_props.get(_SCOPES)
            meta = {_SCOPES: pattern.sub(lambda m: f"{stack.path}.{b}" + m.group(0)[len(stack.path) + 1 + len(m.group(1)):],
                                         scopes)} if scopes else {}
            node = ir.Node(n2.domain, n2.op_type, ins, attrs, overload=n2.overload, num_outputs=len(n2.outputs),
                           version=n2.version,
                           name=f"{n2.name}__b{b}" if n2.name else None, metadata_props=meta)
            for o_new, o2 in zip(node.outputs, n2.outputs):
                o_new.name = f"{o2.name}__b{b}" if o2.name else None
                o_new.shape, o_new.type = o2.shape, o2.type
            copies.append(node)
        graph.extend(copies)  # appended in order: every copy reads earlier nodes
        for k, j, name_of in per_block_outputs:
            v = copies[k].outputs[j]
            v.name = name_of(b)
            new_outputs.append(v)
        prev_nodes = copies
        added += 1
    # the stack's output: what read the template outside the blocks now reads the last block
    for k, j, users in tail:
        v_last = prev_nodes[k].outputs[j]
        for u, i in users:
            u.replace_input_with(i, v_last)
    # nodes read their inputs in order: consumers of the stack's output come after the new blocks
    graph.sort()
    graph.inputs.extend(new_inputs)
    graph.outputs.extend(new_outputs)
    return added


class _Views:
    """Initializers the optimizer folded from one weight without copying it (a transposed numpy view
    of the parameter): which weight and how (shape, strides, offset, dtype), and the same view of
    another block's weight."""

    def __init__(self, stack: Stack, weights, keep: int):
        self.weights = weights
        self.by_address = {}
        for i, block in enumerate(stack.blocks[:keep]):
            for name, p in block.named_parameters():
                if p.numel():
                    self.by_address[p.data_ptr()] = (f"{stack.path}.{i}.{name}", p)

    def of(self, value: ir.Value):
        """(weight name, shape, strides, offset, dtype) of a view of a block's weight, else None."""
        import numpy as np

        raw = getattr(value.const_value, "raw", None)
        if not isinstance(raw, np.ndarray) or raw.base is None:
            return None
        root = raw
        while isinstance(root.base, np.ndarray):
            root = root.base
        start = root.__array_interface__["data"][0]
        hit = self.by_address.get(start)
        if hit is None:
            return None
        name, p = hit
        if root.nbytes != p.numel() * p.element_size() or not root.flags["C_CONTIGUOUS"]:
            return None
        offset = raw.__array_interface__["data"][0] - start
        return name, raw.shape, raw.strides, offset, raw.dtype

    def make(self, name: str, geometry):
        """The view `geometry` (shape, strides, offset, dtype) of weight `name` of the full model."""
        import numpy as np

        from torch.onnx._internal.exporter._core import TorchTensor

        shape, strides, offset, dtype = geometry
        try:
            t = self.weights(name)
        except KeyError:
            raise NotGrowable(f"the model has no weight {name}") from None
        if not t.is_contiguous():
            raise NotGrowable(f"{name}: not a contiguous weight to view")
        try:  # the exporter's own numpy form of the weight (bfloat16 as ml_dtypes'), no copy
            base = TorchTensor(t.detach()).numpy().reshape(-1).view(np.uint8)
            flat = base[offset:].view(dtype)
            return np.lib.stride_tricks.as_strided(flat, shape=shape, strides=strides, writeable=False)
        except (TypeError, ValueError) as e:
            raise NotGrowable(f"{name}: cannot make the view ({e})") from None


def _only_shared_extras(ref: list[ir.Node], matched: dict, template: dict, in_blocks: set) -> None:
    """Block 0's nodes that match none of block 1's must be the exporter's shared sizes: each one's
    outputs read by block 1, by nodes outside the blocks, or by another such node that is; a node
    block 0 computes for itself alone (a first-block-only step) is not grown from block 1."""
    extras = [n for n in ref if n not in matched]
    needed: set = set()
    for n in reversed(extras):  # graph order: readers come after
        if any(u in template or u not in in_blocks or u in needed for v in n.outputs for u, _ in v.uses()):
            needed.add(n)
    alone = [n for n in extras if n not in needed]
    if alone:
        raise NotGrowable(f"block 0 computes {len(alone)} node(s) that block 1 neither has nor reads "
                          f"(first: {alone[0].op_type})")


def _sizes_only(value: ir.Value, limit: int = 64) -> bool:
    """`value` depends on the graph inputs only through their shapes (Shape / Size nodes)."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if v is None or id(v) in seen:
            continue
        seen.add(id(v))
        if len(seen) > limit:
            return False
        p = v.producer()
        if p is None:
            if v.const_value is None and not v.is_initializer():
                return False  # a graph input's values
            continue
        if p.op_type in ("Shape", "Size") and p.domain in ("", "ai.onnx"):
            continue
        stack.extend(p.inputs)
    return True


def _is_constant(node: ir.Node) -> bool:
    return node.op_type == "Constant" and node.domain in ("", "ai.onnx") and not node.inputs


def _attach_readers(nodes, blocks, pattern, io_layer) -> None:
    """Nodes outside every block's name scope that read only one block's per-block graph inputs and
    feed only that block (the cache's Identity of past_key_values.i.*) join that block; so do nodes
    without a name scope that read one block's values (and shared ones) and feed only that block."""
    where = {n: b for b, ns in blocks.items() for n in ns}
    for n in nodes:
        if n in where:
            continue
        layers = set()
        for v in n.inputs:
            if v is None:
                continue
            lay = io_layer(v.name) if v.producer() is None else None
            if lay is None:
                layers.add(None)
            else:
                layers.add(lay[0])
        users = {where.get(u) for v in n.outputs for u, _ in v.uses()}
        if len(layers) == 1 and None not in layers and users == layers:
            b = layers.pop()
            blocks[b].append(n)
            where[n] = b
            continue
        # a node the optimizer made (no name scope: a Split of a chunked projection) that reads one
        # block's values and feeds only that block is that block's
        made = {where.get(v.producer()) for v in n.inputs if v is not None and v.producer() is not None}
        if len(users) == 1 and None not in users and made - {None} == users and not _is_constant(n) \
                and not n.metadata_props.get(_SCOPES):
            b = next(iter(users))
            blocks[b].append(n)
            where[n] = b
    order = {n: i for i, n in enumerate(nodes)}
    for b in blocks:  # graph order within each block
        blocks[b].sort(key=order.__getitem__)


@dataclasses.dataclass
class Plan:
    """How one module is exported shallow and grown (the exporter's dynamic rung takes it):
    `stack` (find_stack), `narrowed(keep)`: a context giving the shallow call's (args, names,
    output_names, dynamic_axes) while the stack is cut, `weights(name)`: the full model's tensor,
    `io_layer(name)`: grow's per-block graph input / output naming."""

    stack: Stack
    narrowed: Callable
    weights: Callable[[str], torch.Tensor]
    io_layer: Callable

    #: the blocks traced in the file `export` returned (SHALLOW, or DEEPER where two did not grow: why)
    traced: int = 0
    shallow_reason: str = ""

    def export(self, module, exporter) -> ir.Model:
        """`exporter(module, args, names, output_names, dynamic_axes)`: the dynamo exporter's file,
        not optimized; returns it grown to full depth and optimized as torch.onnx does (its no-op
        rules exact: optimizer_rules), or raises NotGrowable (nothing of the shallow export is kept).
        Traced SHALLOW blocks deep first; where that file does not grow, DEEPER (a third block, the
        template checked node for node against the second)."""
        from torch.onnx._internal._lazy_import import onnxscript_apis

        from .optimizer_rules import exact_no_op_rules

        for keep in (SHALLOW, DEEPER):
            with shallow(self.stack, keep), self.narrowed(keep) as (args, names, output_names, axes), \
                    exact_no_op_rules():
                # optimized shallow (7x fewer nodes for the optimizer's rules), then grown: the weights it
                # folded are views of the template's, made again of each block's (_Views)
                small = onnxscript_apis.optimize(exporter(module, args, names, output_names, axes))
                try:
                    grow(small, self.stack, weights=self.weights, io_layer=self.io_layer, keep=keep)
                    self.traced = keep
                    return small
                except NotGrowable as e:
                    if keep == SHALLOW:
                        self.shallow_reason = str(e)
                        continue
                    small = exporter(module, args, names, output_names, axes)  # grown first, then optimized
        grow(small, self.stack, weights=self.weights, io_layer=self.io_layer, keep=DEEPER)
        self.traced = DEEPER
        with exact_no_op_rules():
            return onnxscript_apis.optimize(small)
