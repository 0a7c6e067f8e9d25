"""Attention as onnxruntime's fused `com.microsoft.GroupQueryAttention` for `--target ort`
(docs/design.md §10, issue 31 item 2): an LLM-graph transform applied to the KV-cache file after it is
exported and rewritten, before the generation check; never a norm rule.

What it does, on a copy of the file (the caller keeps the original):

1. onnxscript's ORT fusions that find the pieces: its preliminary optimisation (shape inference,
   constant folding, shape rules), `fuse_rotary_embedding` (q and k rotated by rotate-half) and
   `fuse_sdpa` (the softmax(q k^T x scale + mask) v chain, its scale read off the graph).
2. `GroupQueryAttentionFusion`, this module's rule in onnxscript's pattern API, matches per layer
   q / k / v projections reshaped to heads (q and k optionally through an RMSNormalization over
   the head dim: Qwen 3), rotated, the cache concatenated (`present.{i}.*`), k / v repeated over
   the head groups, the SDPA, and back to [batch, sequence, hidden]; and writes one
   GroupQueryAttention: num_heads / kv_num_heads / head size from the shapes, `scale` from the
   SDPA, `do_rotary=1` with cos / sin caches [max positions, head_dim / 2] computed from the
   graph's own inverse frequencies (the rotary's cos / sin must be cos / sin of position_ids x a
   constant inv_freq, duplicated: the plain RoPE of transformers; anything else is not fused),
   `seqlens_k` = attention_mask.sum(-1) - 1 and `total_sequence_length` = attention_mask.shape[1]
   (int32), as onnxruntime-genai's builder feeds them.
   onnxscript's own GQA rule (ort_fusions/gqa.py) is not used: it matches an older transformers
   causal-mask spelling, q / k norms only as SimplifiedLayerNormalization, drops the SDPA's scale
   and takes seqlens_k from position_ids.
3. What the rule matched as the mask is checked by running it: each distinct mask subgraph is cut
   out and run in onnxruntime on small feeds (prefill, decode, a padded attention_mask); it must
   be the plain causal + attention_mask mask (query i at past p attends key j iff j <= p + i and
   attention_mask[b, j]), 0 where attended, the dtype's minimum elsewhere. A sliding window
   (Mistral, Gemma 3), or any other mask, is not that: not fused.
4. All layers or none: one GroupQueryAttention per layer, else the file is left as it was.
5. The local check (`compare`): the fused file in onnxruntime on random feeds, a prefill (batch 2,
   empty past) and decode steps with its own cache fed back: logits and every present.* within
   docs/design.md §7's tolerance of the eager model's on the same feeds (a float32 model), else of the
   unfused file's. Against eager, the unfused file runs only when the fused one fails, to say which
   is wrong. The share-buffer check then reruns the first row of that run with one buffer.

The caller (convert) then runs the generation check on the fused file; where that fails it keeps
the unfused file and says so.

Limits of the fused form (GroupQueryAttention's contract): it reads the mask only as each row's
count of ones (seqlens_k) and takes positions from it, not from position_ids (that input stays,
unused): exact for unpadded batches (attention_mask all ones, position_ids = past + arange: what
the generation check, onnxruntime-genai and optimum feed at batch 1 or equal lengths); a
left-padded batch (zeros before the tokens) is not what the unfused graph computes. The cos / sin
caches cover `max_positions` positions (the model's context length): onnxruntime refuses a longer
run. onnxruntime's CPU kernel takes head sizes that are multiples of 16 (others are not fused) and
refuses batch > 1 with a prompt longer than 1 over a non-empty past (chunked prefill of a batch).

past_present_share_buffer (onnxruntime-genai's one buffer of max_length positions as past and
present): GroupQueryAttention writes the new positions at seqlens_k when its past and present
share a buffer; `share_buffer_check` runs the fused file that way (io binding, one OrtValue as
past and present, attention_mask of the buffer's length, zeros past the tokens) against the
concatenating run; where it agrees the flag `SHARE_BUFFER_KEY` is set in the model's metadata
and `deploy` writes past_present_share_buffer true.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx_ir as ir

#: metadata_props key set on a fused file whose past / present can share one buffer (read by deploy)
SHARE_BUFFER_KEY = "normexport.past_present_share_buffer"
MS = "com.microsoft"
_FUSION = "ai.onnxruntime._fusion"
#: onnxscript optimize's iterations before the fusions (it stops early at a fixed point: one more than its
#: default, so that the shape rules finding nothing leave a fixed point, not an iteration cap)
_ITERATIONS = 3
#: the local check's batch (rows of different tokens: each row's cache and seqlens_k its own)
LOCAL_BATCH = 2
#: the decomposed file's name in a workdir (normexport.llm.files.Workdir.decomposed: this, unless the
#: output has this name; the fused one has the output's)
DECOMPOSED = "decomposed.onnx"


@dataclasses.dataclass
class Fusion:
    """The outcome of `fuse`: `model` is the fused copy (None where not fused) and `reason` why not."""

    model: ir.Model | None
    layers: int
    fused: int = 0
    nodes_before: int = 0
    nodes_after: int = 0
    reason: str | None = None
    local: dict = dataclasses.field(default_factory=dict)
    share_buffer: bool = False
    share_buffer_reason: str | None = None
    attributes: dict = dataclasses.field(default_factory=dict)
    packed_qkv: int = 0  # GroupQueryAttention nodes given the packed q / k / v projection
    #: with a workdir (fuse): the fused file and the decomposed one, written there and checked by path
    path: Path | None = None
    decomposed_path: Path | None = None

    def to_dict(self) -> dict:
        return {"fused": self.model is not None, "group_query_attention": self.fused, "layers": self.layers,
                "nodes_before": self.nodes_before, "nodes_after": self.nodes_after, "reason": self.reason,
                "local_check": self.local, "attributes": self.attributes,
                "past_present_share_buffer": self.share_buffer,
                "share_buffer_reason": self.share_buffer_reason,
                "limits": "exact for unpadded batches (attention_mask all ones); GroupQueryAttention takes positions "
                          "from seqlens_k = attention_mask.sum(-1) - 1, not position_ids: left padding differs"}


# ---- the rule ----------------------------------------------------------------------------------------

def _rule_class():
    from onnxscript.rewriter import _fusion_utils, pattern

    class GroupQueryAttentionFusion(pattern.RewriteRuleClassBase):
        """One layer's decomposed attention with its concatenated cache -> GroupQueryAttention (module docstring)."""

        def __init__(self, max_positions: int):
            super().__init__("normexport_GroupQueryAttention", remove_nodes=False)
            self.max_positions = max_positions
            self.mask_checked: dict[int, str | None] = {}
            self.mask_failures: list[str] = []
            self.caches: dict = {}
            self.attributes: list[dict] = []
            self.presents: list[tuple[ir.Value, ir.Value]] = []

        def pattern(self, op, query_BSD, key_BSDkv, value_BSDkv, past_key, past_value, cos, sin, mask):
            q = op.Reshape(query_BSD, pattern.ANY_VALUE, _outputs=["query_BSHDh"])
            qn = op.RMSNormalization(q, pattern.ANY_VALUE, _allow_other_attributes=True, _outputs=["query_norm"])
            q = op.Transpose(pattern.OrValue([q, qn]), perm=[0, 2, 1, 3])
            q = op.RotaryEmbedding(q, cos, sin, _domain=_FUSION, _allow_other_attributes=True, _outputs=["query_rope"])
            k = op.Reshape(key_BSDkv, pattern.ANY_VALUE, _outputs=["key_BSHkvDh"])
            kn = op.RMSNormalization(k, pattern.ANY_VALUE, _allow_other_attributes=True, _outputs=["key_norm"])
            k = op.Transpose(pattern.OrValue([k, kn]), perm=[0, 2, 1, 3])
            k = op.RotaryEmbedding(k, cos, sin, _domain=_FUSION, _allow_other_attributes=True, _outputs=["key_rope"])
            v = op.Transpose(op.Reshape(value_BSDkv, pattern.ANY_VALUE), perm=[0, 2, 1, 3])
            present_key = op.Concat(past_key, k, axis=-2, _outputs=["present_key"])
            present_value = op.Concat(past_value, v, axis=-2, _outputs=["present_value"])
            k_rep = op.Reshape(op.Expand(op.Unsqueeze(present_key, [2]), pattern.ANY_VALUE), pattern.ANY_VALUE,
                               _outputs=["key_repeated"])
            v_rep = op.Reshape(op.Expand(op.Unsqueeze(present_value, [2]), pattern.ANY_VALUE), pattern.ANY_VALUE,
                               _outputs=["value_repeated"])
            attn = op.SDPA(q, pattern.OrValue([k_rep, present_key]), pattern.OrValue([v_rep, present_value]), mask,
                           key_format="BHSd", _domain=_FUSION, _allow_other_attributes=True, _outputs=["sdpa"])
            out = op.Reshape(op.Transpose(attn, perm=[0, 2, 1, 3]), pattern.ANY_VALUE, _outputs=["attention_BSD"])
            return out  # one output: onnxscript's multi-output matcher is quadratic in the graph (minutes at 22 layers)

        def check(self, context, query_BSD, key_BSDkv, value_BSDkv, past_key, past_value, cos, sin, mask,
                  query_BSHDh, key_BSHkvDh, query_rope, key_rope, sdpa, attention_BSD, key_repeated=None,
                  value_repeated=None, **_):
            result = pattern.MatchResult()
            bind: dict = {}
            for val, dims in ((query_BSD, "B S D"), (key_BSDkv, "B S Dkv"), (value_BSDkv, "B S Dkv"),
                              (query_BSHDh, "B S H Dh"), (key_BSHkvDh, "B S Hkv Dh"), (past_key, "B Hkv P Dh"),
                              (past_value, "B Hkv P Dh"), (attention_BSD, "B S D")):
                if not _fusion_utils.check_shape_bool(bind, val, dims.split()):
                    return result.fail(f"{val.name}: shape {val.shape} is not [{dims}]", val)
            heads, kv_heads, head_size, hidden = bind["H"], bind["Hkv"], bind["Dh"], bind["D"]
            if not all(isinstance(x, int) for x in (heads, kv_heads, head_size, hidden)):
                return result.fail("heads / KV heads / head size not static", query_BSHDh)
            if heads * head_size != hidden or heads % kv_heads:
                return result.fail(f"{heads} heads x {head_size} != {hidden} or not a multiple of {kv_heads}", query_BSD)
            if head_size % 16:  # onnxruntime's GroupQueryAttention (CPU) refuses other head sizes when it runs
                return result.fail(f"head size {head_size}: GroupQueryAttention takes multiples of 16", query_BSHDh)
            if (key_repeated is None) != (heads == kv_heads) or (value_repeated is None) != (heads == kv_heads):
                return result.fail("keys / values not repeated over the head groups", sdpa)
            for rep in (key_repeated, value_repeated):
                if rep is not None and not _fusion_utils.check_shape_bool(dict(bind), rep, ["B", "H", "T", "Dh"]):
                    return result.fail(f"{rep.name}: shape {rep.shape} is not [B, {heads}, T, {head_size}]", rep)
            if past_key.name is None or not past_key.name.startswith("past_key_values.") \
                    or past_key not in context.graph_or_function.inputs or past_value not in context.graph_or_function.inputs:
                return result.fail("the cache concatenated is not a past_key_values.* graph input", past_key)
            qa, ka = query_rope.producer().attributes, key_rope.producer().attributes
            interleaved = qa.get_int("interleaved", 0)
            if ka.get_int("interleaved", 0) != interleaved:
                return result.fail("q and k rotated differently", query_rope)
            dtype = query_BSD.dtype
            if dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
                return result.fail(f"dtype {dtype}: GroupQueryAttention on CPU takes float32 / float16", query_BSD)
            inv_freq, why = _inv_freq(cos, sin, context.graph_or_function)
            if inv_freq is None:
                return result.fail(f"rotary cos / sin: {why}", cos)
            if inv_freq.shape[0] * 2 != head_size:
                return result.fail("partial rotary (rotary dim != head size)", cos)
            inputs = {v.name: v for v in context.graph_or_function.inputs}
            if "attention_mask" not in inputs:
                return result.fail("no attention_mask graph input", mask)
            if id(mask) not in self.mask_checked:  # what the rule matched as the mask, run (module docstring)
                self.mask_checked[id(mask)] = check_mask(mask, dict(context.model.opset_imports), kv_heads, head_size,
                                                         np.float16 if dtype == ir.DataType.FLOAT16 else np.float32)
            if self.mask_checked[id(mask)]:
                self.mask_failures.append(f"mask {mask.name}: {self.mask_checked[id(mask)]}")
                return result.fail(self.mask_failures[-1], mask)
            scale = sdpa.producer().attributes.get_float("scale", None)
            self._match = dict(heads=heads, kv_heads=kv_heads, scale=1.0 / math.sqrt(head_size) if scale is None else scale,
                               interleaved=interleaved, inv_freq=inv_freq, dtype=dtype,
                               attention_mask=inputs["attention_mask"])
            return result

        def rewrite(self, op, query_BSD, key_BSDkv, value_BSDkv, past_key, past_value, mask, present_key,
                    present_value, query_norm=None, key_norm=None, **_):
            m = self._match
            if query_norm is not None:  # Qwen 3's q / k norms over the head dim: kept, reshaped back
                query_BSD = op.Reshape(query_norm, op.Constant(value_ints=[0, 0, -1]))
            if key_norm is not None:
                key_BSDkv = op.Reshape(key_norm, op.Constant(value_ints=[0, 0, -1]))
            am = m["attention_mask"]
            seqlens = op.Cast(op.Sub(op.ReduceSum(am, op.Constant(value_ints=[1]), keepdims=0),
                                     op.Constant(value=ir.tensor(np.array(1, dtype=np.int64)))), to=ir.DataType.INT32)
            total = op.Cast(op.Gather(op.Shape(am), op.Constant(value=ir.tensor(np.array(1, dtype=np.int64))), axis=0),
                            to=ir.DataType.INT32)
            key = (m["inv_freq"].tobytes(), m["dtype"])
            if key not in self.caches:
                angles = np.arange(self.max_positions, dtype=np.float32)[:, None] * m["inv_freq"].astype(np.float32)[None]
                np_dtype = np.float16 if m["dtype"] == ir.DataType.FLOAT16 else np.float32
                n = len(self.caches)  # one pair per distinct inv_freq (and dtype)
                self.caches[key] = (op.initializer(ir.tensor(np.cos(angles).astype(np_dtype)), name=f"gqa_cos_cache_{n}"),
                                    op.initializer(ir.tensor(np.sin(angles).astype(np_dtype)), name=f"gqa_sin_cache_{n}"))
            cos_cache, sin_cache = self.caches[key]
            attrs = dict(num_heads=m["heads"], kv_num_heads=m["kv_heads"], scale=float(m["scale"]), do_rotary=1,
                         rotary_interleaved=m["interleaved"], local_window_size=-1)
            self.attributes.append(attrs)
            out, new_key, new_value = op.GroupQueryAttention(query_BSD, key_BSDkv, value_BSDkv, past_key, past_value,
                                                             seqlens, total, cos_cache, sin_cache, **attrs, _domain=MS,
                                                             _outputs=3)
            self.presents += [(present_key, new_key), (present_value, new_value)]  # rewired by _take_presents
            return out

    return GroupQueryAttentionFusion


def packed_qkv(model: ir.Model) -> int:
    """GroupQueryAttention nodes whose query / key / value are exactly the outputs of one Split (the
    packed q / k / v projections, in that order) take the Split's input as packed query and no key /
    value. Returns how many; a Split left with no use is removed."""
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "GroupQueryAttention" or len(node.inputs) < 3:
            continue
        q, k, v = node.inputs[:3]
        split = q.producer() if q is not None else None
        if (split is None or split.op_type != "Split" or len(split.outputs) != 3
                or list(split.outputs) != [q, k, v]):
            continue
        node.replace_input_with(0, split.inputs[0])
        node.replace_input_with(1, None)
        node.replace_input_with(2, None)
        if not any(o.uses() for o in split.outputs) and not any(o in graph.outputs for o in split.outputs):
            sizes = split.inputs[1] if len(split.inputs) > 1 else None
            graph.remove(split, safe=True)
            if sizes is not None and sizes.is_initializer() and not sizes.uses():
                graph.initializers.pop(sizes.name, None)
        count += 1
    return count


def _const(value: ir.Value | None, graph) -> np.ndarray | None:
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is not None and node.op_type == "Constant" and node.domain == "" and "value" in node.attributes:
        return node.attributes["value"].as_tensor().numpy()
    return None


def _producer(value, op_type: str):
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain == "" else None


def _inv_freq(cos: ir.Value, sin: ir.Value, graph) -> tuple[np.ndarray | None, str | None]:
    """The constant inverse frequencies [head_dim / 2] where cos / sin are Unsqueeze(Cos / Sin(Concat(f, f)), 1)
    with f = Cast(Unsqueeze(position_ids, 2), float) x inv_freq (transformers' default RoPE, as exported),
    else (None, why)."""
    found = []
    for val, fn in ((cos, "Cos"), (sin, "Sin")):
        un = _producer(val, "Unsqueeze")
        if un is None or list(_const(un.inputs[1], graph) if _const(un.inputs[1], graph) is not None else []) != [1]:
            return None, f"{val.name} is not Unsqueeze(., [1])"
        x = un.inputs[0]
        if _producer(x, "Cast") is not None:  # a cast to the model's dtype
            x = _producer(x, "Cast").inputs[0]
        trig = _producer(x, fn)
        if trig is None:
            return None, f"{val.name} is not {fn}(...)"
        cat = _producer(trig.inputs[0], "Concat")
        if cat is None or len(cat.inputs) != 2 or cat.inputs[0] is not cat.inputs[1] or cat.attributes.get_int("axis") != -1:
            return None, "the angles are not Concat(freqs, freqs, axis=-1)"
        found.append(cat.inputs[0])
    if found[0] is not found[1]:
        return None, "cos and sin of different angles"
    mul = _producer(found[0], "Mul")
    if mul is None:
        return None, "the angles are not position_ids x inv_freq"
    for pos, freq in (mul.inputs, mul.inputs[::-1]):
        inv = _const(freq, graph)
        cast = _producer(pos, "Cast")
        if inv is None or cast is None or cast.attributes.get_int("to") != ir.DataType.FLOAT:
            continue
        un = _producer(cast.inputs[0], "Unsqueeze")
        if un is None or un.inputs[0] is None or un.inputs[0].name != "position_ids" or \
                list(_const(un.inputs[1], graph) if _const(un.inputs[1], graph) is not None else []) != [2]:
            continue
        inv = np.asarray(inv, dtype=np.float32).reshape(-1)
        return inv, None
    return None, "the angles are not Cast(Unsqueeze(position_ids, 2)) x a constant inv_freq"


# ---- the mask, run -------------------------------------------------------------------------------------

def _cone(value: ir.Value):
    """(nodes in graph order, graph inputs, initializers) that compute `value`."""
    nodes, inputs, inits, seen = [], [], [], set()
    stack = [value]
    while stack:
        v = stack.pop()
        if v is None or id(v) in seen:
            continue
        seen.add(id(v))
        node = v.producer()
        if node is None:
            (inits if v.const_value is not None else inputs).append(v)
            continue
        if id(node) not in seen:
            seen.add(id(node))
            nodes.append(node)
            stack.extend(node.inputs)
    order = {id(n): i for i, n in enumerate(value.graph or [])} if value.graph is not None else {}
    nodes.sort(key=lambda n: order.get(id(n), 0))
    return nodes, inputs, inits


def _mask_model(value: ir.Value, opsets: dict):
    import onnx

    nodes, inputs, inits = _cone(value)
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in nodes], "mask",
        [ir.serde.serialize_value(v) for v in inputs],
        [onnx.helper.make_value_info(value.name, onnx.TypeProto())],
        initializer=[ir.serde.serialize_tensor(v.const_value) for v in inits])
    for t, v in zip(graph.initializer, inits):
        t.name = v.name
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()])
    model.ir_version = 10
    return model, [v.name for v in inputs]


def check_mask(value: ir.Value, opsets: dict, kv_heads: int, head_size: int, dtype=np.float32) -> str | None:
    """None where the mask subgraph computing `value` is the plain causal + attention_mask mask
    (module docstring), else why not."""
    import onnxruntime as ort

    try:
        proto, names = _mask_model(value, opsets)
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001
        return f"the mask subgraph does not run on its own ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    rng = np.random.default_rng(0)
    cases = [(2, 5, 0, None), (2, 1, 6, None), (3, 3, 4, "padded")]
    for batch, seq, past, kind in cases:
        am = np.ones((batch, past + seq), np.int64)
        if kind:
            am = (rng.random((batch, past + seq)) > 0.3).astype(np.int64)
            am[:, -1] = 1
        feeds = {"input_ids": np.zeros((batch, seq), np.int64), "attention_mask": am,
                 "position_ids": np.tile(np.arange(past, past + seq, dtype=np.int64), (batch, 1))}
        for name in names:
            if name.startswith("past_key_values."):
                feeds[name] = np.zeros((batch, kv_heads, past, head_size), dtype)
        missing = [n for n in names if n not in feeds]
        if missing:
            return f"the mask reads {', '.join(missing)}"
        try:
            got = sess.run(None, {n: feeds[n] for n in names})[0]
        except Exception as e:  # noqa: BLE001
            return f"the mask subgraph failed on batch {batch}, sequence {seq}, past {past}: {str(e).splitlines()[0][:160]}"
        i = np.arange(seq)[:, None]
        j = np.arange(past + seq)[None, :]
        allowed = (j <= past + i)[None, None] & am[:, None, None, :].astype(bool)
        try:
            got = np.broadcast_to(got, allowed.shape)
        except ValueError:
            return f"the mask has shape {list(got.shape)}, not [batch, 1, sequence, total]"
        low = np.finfo(got.dtype).min if got.dtype.kind == "f" else None
        if low is None or not (np.all(got[allowed] == 0) and np.all(got[~allowed] <= low / 2)):
            return (f"not the causal + attention_mask mask (batch {batch}, sequence {seq}, past {past}"
                    f"{', padded attention_mask' if kind else ''}): a sliding window or another mask")
    return None


# ---- the fusion ------------------------------------------------------------------------------------------

_TERM = re.compile(r"^([A-Za-z_]\w*|\d+)$")


def _canonical_dims(model: ir.Model) -> None:
    """Symbolic dims that are sums of the same terms spelled in one order (the exporter writes both
    `past_sequence + sequence` and `sequence + past_sequence`; onnxscript's shape checks compare
    names): the terms sorted. Labels only: the same sizes."""
    def canon(d):
        name = getattr(d, "value", None)
        if not isinstance(name, str) or "+" not in name:
            return d
        terms = [t.strip() for t in name.split("+")]
        return ir.SymbolicDim(" + ".join(sorted(terms))) if all(_TERM.match(t) for t in terms) else d

    values = list(model.graph.inputs) + [o for n in model.graph for o in n.outputs]
    for v in values:
        if v.shape is not None and any(isinstance(getattr(d, "value", None), str) and "+" in d.value for d in v.shape):
            v.shape = ir.Shape([canon(d) for d in v.shape])


def _take_presents(model: ir.Model, pairs) -> None:
    """The cache GroupQueryAttention returns replaces the concatenated one (graph outputs by name)."""
    outputs = model.graph.outputs
    for old, new in pairs:
        if old in outputs:
            name = old.name
            old.name = f"{name}_concatenated"
            outputs[outputs.index(old)] = new
            new.name = name
        ir.convenience.replace_all_uses_with(old, new)


def _count(model: ir.Model) -> int:
    return sum(1 for _ in model.graph)


def _copy(model: ir.Model) -> ir.Model:
    """The graph copied, its weights shared (onnx-ir's clone: the same tensor objects, no bytes
    copied; the fusion's passes replace values, never a tensor's contents)."""
    return model.clone()


def _float32(lm):
    """The eager reference of the local check: a float32 FlatCacheLM (others: their check is by generation)."""
    import torch

    if lm is None or getattr(getattr(lm, "layout", None), "dtype", None) != torch.float32:
        return None
    return lm


def fuse(model_ir: ir.Model, *, max_positions: int, local_check: bool = True, workdir=None,
         sessions: dict | None = None, reference=None) -> Fusion:
    """The fused copy of a KV-cache file (module docstring); `model_ir` itself is left as it is.

    `workdir` (normexport.llm.files.Workdir): the checks run from files, for a model of any size:
    the decomposed file is written there as `workdir.decomposed` (the weights streamed once, by a
    forked process while the fusion passes run: Workdir.write_behind), the fused one as the
    output's name sharing its data file (`Fusion.path`, `Fusion.decomposed_path`); one onnxruntime session at a time. Without it the
    files are serialised in memory (up to 2 GiB). `sessions` (a dict): receives the fused file's
    onnxruntime session as "fused" where the fusion is kept, for the generation check to run on
    (one session of the file made, not two)."""
    copy = _copy(model_ir)  # before the write below swaps model_ir's initializers for streaming ones
    behind = None  # the decomposed file written while the passes run
    if workdir is not None and local_check and workdir.decomposed not in workdir.files:
        behind = workdir.write_behind(model_ir, workdir.decomposed)
    try:  # (eager's steps are not run here too: on 2 cores they and the write each slowed the other, ~no gain)
        result = _fused_copy(model_ir, copy, max_positions)
    finally:
        write_error = behind.exception() if behind is not None else None  # waits for the write
    model = result.model
    if model is None or not local_check:
        return result
    files = None
    if workdir is not None:
        try:
            if write_error is not None:
                raise write_error
            files = (workdir.files.get(workdir.decomposed) or workdir.write(model_ir, workdir.decomposed),
                     workdir.write(model, workdir.out.name))
        except OSError as e:
            result.model, result.reason = None, f"cannot write the files to check ({e.strerror or e})"
            return result
        result.decomposed_path, result.path = files
    shared: dict = {}  # the fused file's session and run, reused by the share-buffer check
    result.local = compare(model_ir, model, files=files, keep=shared, reference=_float32(reference))
    if not result.local.get("passed"):
        result.reason = f"local check failed: {result.local.get('reason')}"
        result.model = None
        return result
    ok, why = share_buffer_check(model, session=shared.get("fused"), reference=shared.get("run"))
    if sessions is not None and "fused" in shared:
        sessions["fused"] = shared["fused"]
    shared.clear()
    result.share_buffer, result.share_buffer_reason = ok, why
    if ok:
        model.metadata_props[SHARE_BUFFER_KEY] = "true"
        if workdir is not None:  # the flag is in the file too (deploy reads the model's metadata)
            result.path = workdir.write(model, workdir.out.name)
    return result


def _fused_copy(model_ir: ir.Model, model: ir.Model, max_positions: int) -> Fusion:
    """The fusion passes on `model`, a copy of `model_ir` (module docstring, items 1-4), reading of
    `model_ir` its interface alone: `Fusion.model` the fused copy, unchecked, or None and
    `Fusion.reason`."""
    import onnx_ir.passes.common as common_passes
    from onnxscript.optimizer import optimize
    from onnxscript.rewriter.ort_fusions import shape_optimization
    from onnxscript.rewriter.ort_fusions.rotary_embedding import fuse_rotary_embedding
    from onnxscript.rewriter import pattern
    from onnxscript.rewriter.ort_fusions.sdpa import fuse_sdpa

    layers = sum(1 for v in model_ir.graph.inputs if v.name.startswith("past_key_values.") and v.name.endswith(".key"))
    result = Fusion(None, layers, nodes_before=_count(model_ir))
    if not layers:
        result.reason = "no past_key_values.*.key input"
        return result
    try:
        common_passes.ShapeInferencePass()(model)
        optimize(model, num_iterations=_ITERATIONS)
        if shape_optimization.rules.apply_to_model(model):  # else optimize's fixed point stands: not run again
            optimize(model, num_iterations=_ITERATIONS)
        _canonical_dims(model)
        rotary = fuse_rotary_embedding(model)
        sdpa = fuse_sdpa(model, apply_shape_inference=True)
        _canonical_dims(model)
        rule = _rule_class()(max_positions)
        count = pattern.RewriteRuleSet([pattern.RewriteRule(
            rule.pattern, rule.rewrite, rule.check, name=rule.name, remove_nodes=rule.remove_nodes)]).apply_to_model(model)
        _take_presents(model, rule.presents)
    except Exception as e:  # noqa: BLE001
        result.reason = f"onnxscript's fusions failed: {_why(e)}"
        return result
    result.fused = count
    if count != layers:
        result.reason = (f"{count} of {layers} layers matched (rotary {rotary}, sdpa {sdpa}): "
                         + (rule.mask_failures[0] if rule.mask_failures else "the attention is not the plain "
                            "grouped-query form (rotate-half RoPE from position_ids, concatenated cache, causal mask)"))
        return result
    optimize(model)  # the decomposed attention, its mask and the rotary's cos / sin are now unused
    common_passes.RemoveUnusedNodesPass()(model)
    common_passes.CommonSubexpressionEliminationPass()(model)
    model.opset_imports.setdefault(MS, 1)
    left = [n.op_type for n in model.graph if n.domain == _FUSION]
    got = sum(1 for n in model.graph if n.op_type == "GroupQueryAttention" and n.domain == MS)
    if left or got != layers:
        result.reason = f"after cleanup: {got} GroupQueryAttention, {len(left)} intermediate fusion op(s) left"
        return result
    _keep_interface(model, model_ir)
    result.packed_qkv = packed_qkv(model)  # q / k / v projections packed before the fusion: the packed query
    result.nodes_after = _count(model)
    a = rule.attributes[0]
    result.attributes = {k: a[k] for k in ("num_heads", "kv_num_heads", "scale", "do_rotary", "rotary_interleaved")}
    result.attributes["cos_sin_cache_positions"] = max_positions
    result.model = model
    return result


def _keep_interface(model: ir.Model, original: ir.Model) -> None:
    """The fused graph keeps the file's interface: inputs / outputs by name, their types and dim names."""
    outs = {v.name: v for v in original.graph.outputs}
    for v in model.graph.outputs:
        o = outs.get(v.name)
        if o is not None:
            v.shape, v.type = o.shape, o.type
    ins = {v.name: v for v in original.graph.inputs}
    for v in model.graph.inputs:
        o = ins.get(v.name)
        if o is not None:
            v.shape, v.type = o.shape, o.type


# ---- running the files -----------------------------------------------------------------------------------

def _session(model: ir.Model, path: Path | None = None):
    """An onnxruntime session of `model`: from its file where given (any size; external data read
    from disk), else from the model serialised in memory."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3  # the fused file leaves position_ids unused: no warning for it
    # no MatMul weight prepacking: the checks run a few steps, and prepacking a 4 GiB file's weights
    # takes 6-7 s per session (1.1B LLaMA, 2 cores; each run then ~0.4 s slower)
    so.add_session_config_entry("session.disable_prepacking", "1")
    source = str(path) if path is not None else ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])


def _np_dtype(model: ir.Model):
    v = next(v for v in model.graph.inputs if v.name == "past_key_values.0.key")
    return np.float16 if v.dtype == ir.DataType.FLOAT16 else np.float32


def _cache_dims(model: ir.Model) -> list[tuple[str, int, int]]:
    return [(v.name, v.shape[1], v.shape[3]) for v in model.graph.inputs if v.name.startswith("past_key_values.")]


def _vocab(model: ir.Model) -> int:
    emb = next((n for n in model.graph if n.op_type == "Gather" and n.inputs[1] is not None
                and n.inputs[1].name == "input_ids"), None)
    if emb is not None and emb.inputs[0] is not None and emb.inputs[0].shape is not None:
        return int(emb.inputs[0].shape[0])
    return 32


def _run_steps(sess, names: Sequence[str], dims, dtype, ids_steps, batch: int):
    """Per step (logits, presents): prefill then decode, each step's presents fed back."""
    past = {n: np.zeros((batch, h, 0, d), dtype) for n, h, d in dims}
    outs, total = [], 0
    for ids in ids_steps:
        seq = ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((batch, total + seq), np.int64),
                 "position_ids": np.tile(np.arange(total, total + seq, dtype=np.int64), (batch, 1)), **past}
        res = sess.run(None, {n: feeds[n] for n in names})
        outs.append(res)
        out_names = [o.name for o in sess.get_outputs()]
        past = {n.replace("present", "past_key_values"): r for n, r in zip(out_names[1:], res[1:])}
        total += seq
    return outs


def local_feeds(model: ir.Model, batch: int = LOCAL_BATCH, prompt: int = 5, decode: int = 3,
                seed: int = 0) -> list[np.ndarray]:
    """The local check's input_ids per step: a random prompt of `prompt` tokens (`batch` rows),
    then `decode` single tokens."""
    rng = np.random.default_rng(seed)
    vocab = _vocab(model)
    steps = [rng.integers(0, vocab, (batch, prompt)).astype(np.int64)]
    return steps + [rng.integers(0, vocab, (batch, 1)).astype(np.int64) for _ in range(decode)]


def compare(unfused: ir.Model, fused: ir.Model, *, batch: int = LOCAL_BATCH, prompt: int = 5, decode: int = 3,
            seed: int = 0, files: tuple[Path, Path] | None = None, keep: dict | None = None, reference=None) -> dict:
    """The local check, on random prefill + decode feeds (`local_feeds`; each run's own cache fed
    back), every logits and present.* within docs/design.md §7's tolerance of the reference's:

    - with `reference` (the FlatCacheLM exported, float32): the fused file against eager. The
      unfused file runs only where that fails, against eager too, to say which is wrong: the
      fusion, or the file itself (`eager_failed`: e.g. its blocks grown from a shallow trace);
    - without: the fused file against the unfused one, both in onnxruntime.

    `files`: the two as written (unfused, fused), the sessions made from them (one at a time);
    `keep`: receives the fused file's session as "fused" and its run as "run" (feeds, outputs per
    step), for share_buffer_check."""
    import torch

    try:
        dims, dtype = _cache_dims(unfused), _np_dtype(unfused)
        tdtype = torch.float16 if dtype == np.float16 else torch.float32
        steps = local_feeds(unfused, batch, prompt, decode, seed)

        def run(k: int):
            model = (unfused, fused)[k]
            sess = _session(model, files[k] if files else None)
            names = [i.name for i in sess.get_inputs()]
            return sess, _run_steps(sess, names, dims, dtype, steps, batch), [o.name for o in sess.get_outputs()]

        try:
            sess, got, names = run(1)
        except Exception as e:  # noqa: BLE001  (with eager: the decomposed file still checked below)
            if reference is None:
                raise
            got, names, failed = None, None, {"passed": False, "reason": _why(e)}
        else:
            if keep is not None:
                keep["fused"], keep["run"] = sess, (steps, got)
            del sess
        if reference is not None:
            want = _eager_steps(reference, dims, steps, batch)
            if got is not None:
                failed = _within(want, got, names, tdtype)
                if failed["passed"]:
                    return {**failed, "against": "eager", "batch": batch, "prompt": prompt, "decode_steps": decode}
            if keep is not None:  # the fused file failed: its session is not kept
                keep.clear()
            _, ref, ref_names = run(0)
            dec = _within(want, ref, ref_names, tdtype)
            if not dec["passed"]:
                return {**dec, "eager_failed": True, "reason": f"the decomposed file against eager, {dec['reason']}"}
            return {**failed, "reason": f"the fused file against eager (the decomposed file within tolerance, "
                                        f"max_abs_err {dec['max_abs_err']:.3g}), {failed['reason']}"}
        _, ref, ref_names = run(0)
    except Exception as e:  # noqa: BLE001
        return {"passed": False, "reason": _why(e)}
    if names != ref_names:
        return {"passed": False, "reason": f"outputs differ: {names} vs {ref_names}"}
    out = _within([[r.astype(np.float64) for r in step] for step in ref], got, names, tdtype)
    return {**out, "against": "decomposed", "batch": batch, "prompt": prompt, "decode_steps": decode} \
        if out["passed"] else out


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _within(want: list, got: list, names: Sequence[str], tdtype) -> dict:
    """Per step and output, `got` (onnxruntime's) within docs/design.md §7's tolerance of `want` (float64)."""
    from ..parity.tolerances import tolerance_for

    worst, compared = 0.0, 0
    for k, (w_step, g_step) in enumerate(zip(want, got, strict=True)):
        for name, w, g in zip(names, w_step, g_step, strict=True):
            if w.shape != g.shape:
                return {"passed": False, "reason": f"step {k} {name}: shape {list(g.shape)} != {list(w.shape)}"}
            err = float(np.abs(w - g.astype(np.float64)).max()) if w.size else 0.0
            tol = tolerance_for(tdtype, float(np.abs(w).max()) if w.size else 0.0)
            compared += 1
            worst = max(worst, err)
            if not err <= tol:  # NaN fails too
                return {"passed": False, "max_abs_err": err, "reason": f"step {k} ({'prefill' if k == 0 else 'decode'}) "
                        f"{name}: max_abs_err {err:.3g} > tolerance {tol:.3g}"}
    return {"passed": True, "outputs_compared": compared, "max_abs_err": worst}


def _eager_steps(lm, dims, steps, batch: int) -> list[list[np.ndarray]]:
    """Per step eager's outputs (logits, present.*; float64) of `lm` (a FlatCacheLM) on _run_steps'
    feeds, its cache fed back."""
    import torch

    past = [torch.zeros(batch, h, 0, d, dtype=lm.layout.dtype) for _, h, d in dims]
    outs, total = [], 0
    with torch.no_grad():
        for ids in steps:
            seq = ids.shape[1]
            res = lm(torch.from_numpy(ids), torch.ones(batch, total + seq, dtype=torch.long),
                     torch.arange(total, total + seq).expand(batch, seq).contiguous(), *past)
            outs.append([r.double().numpy() for r in res])
            past, total = list(res[1:]), total + seq
    return outs


def share_buffer_check(fused: ir.Model, *, batch: int = 1, prompt: int = 4, decode: int = 3,
                       max_length: int = 16, session=None, reference=None) -> tuple[bool, str | None]:
    """(True, None) where the fused file run with one buffer of `max_length` positions as past and
    present (io binding, as onnxruntime-genai's past_present_share_buffer; attention_mask of
    `max_length`, ones over the tokens so far) gives the concatenating run's logits and cache.
    `reference`: a concatenating run of this file made already (compare's `keep["run"]`: feeds
    and outputs per step), its first `batch` rows the reference here (no second run); else the
    concatenating run is made here on random feeds."""
    import onnxruntime as ort

    try:
        dims, dtype = _cache_dims(fused), _np_dtype(fused)
        sess = session if session is not None else _session(fused)  # `session`: the fused file's, made already
        names = [i.name for i in sess.get_inputs()]
        outs = [o.name for o in sess.get_outputs()]
        if reference is not None:
            steps = [ids[:batch] for ids in reference[0]]
            ref = [[o[:batch] for o in step] for step in reference[1]]
        else:
            steps = local_feeds(fused, batch, prompt, decode, seed=1)
            ref = _run_steps(sess, names, dims, dtype, steps, batch)
        max_length = max(max_length, sum(ids.shape[1] for ids in steps))
        buffers = {n: ort.OrtValue.ortvalue_from_numpy(np.zeros((batch, h, max_length, d), dtype)) for n, h, d in dims}
        total = 0
        for k, ids in enumerate(steps):
            seq = ids.shape[1]
            am = np.zeros((batch, max_length), np.int64)
            am[:, :total + seq] = 1
            feeds = {"input_ids": ids, "attention_mask": am,
                     "position_ids": np.tile(np.arange(total, total + seq, dtype=np.int64), (batch, 1))}
            io = sess.io_binding()
            for n in names:
                if n in buffers:
                    io.bind_ortvalue_input(n, buffers[n])
                else:
                    io.bind_cpu_input(n, feeds[n])
            io.bind_output(outs[0])
            for n in outs[1:]:
                io.bind_ortvalue_output(n, buffers[n.replace("present", "past_key_values")])
            sess.run_with_iobinding(io)
            logits = io.copy_outputs_to_cpu()[0]
            total += seq
            want = ref[k][0]
            if logits.shape != want.shape or float(np.abs(logits.astype(np.float64) - want).max()) > 1e-4 * max(1.0, float(np.abs(want).max())):
                return False, f"step {k}: the shared-buffer run's logits differ from the concatenating run's"
            for n, r in zip(outs[1:], ref[k][1:]):
                buf = buffers[n.replace("present", "past_key_values")].numpy()[:, :, :total]
                if buf.shape != r.shape or float(np.abs(buf.astype(np.float64) - r).max()) > 1e-4 * max(1.0, float(np.abs(r).max())):
                    return False, f"step {k}: {n} in the shared buffer differs from the concatenating run's"
        return True, None
    except Exception as e:  # noqa: BLE001
        return False, _why(e)


# ---- convert's hook ---------------------------------------------------------------------------------------

#: config keys holding the context length (the cos / sin caches' rows), as deploy reads them
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def context_length(lm) -> int | None:
    """The model's context length from its transformers config (None: a .pt2 program, no config)."""
    config = getattr(getattr(lm, "generates", None), "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def for_convert(model_ir: ir.Model, lm, workdir=None, sessions: dict | None = None) -> Fusion:
    """convert --target ort, KV-cache task: the fused copy of the exported file where it matches and
    passes the local check (`Fusion.model`), else why not (`Fusion.reason`). `workdir`
    (normexport.llm.files.Workdir): checked from files there, for a model of any size (`fuse`)."""
    positions = context_length(lm)
    if positions is None:
        layers = sum(1 for v in model_ir.graph.inputs if v.name.startswith("past_key_values.") and v.name.endswith(".key"))
        return Fusion(None, layers, nodes_before=_count(model_ir),
                      reason="no context length in the model's config (the cos / sin caches' size)")
    return fuse(model_ir, max_positions=positions, workdir=workdir, sessions=sessions, reference=lm)


def line(f: Fusion, generation: str | None = None) -> str:
    """convert's line on the fusion: done (node counts, how verified, share buffer) or why not."""
    if f.model is None:
        return f"  attention: decomposed (not fused as GroupQueryAttention: {f.reason})"
    share = "past/present can share one buffer" if f.share_buffer else \
        f"past/present share buffer not verified ({f.share_buffer_reason})"
    return (f"  attention: {f.fused} com.microsoft.GroupQueryAttention (one per layer, num_heads "
            f"{f.attributes['num_heads']}, kv_num_heads {f.attributes['kv_num_heads']}), {f.nodes_before} -> "
            f"{f.nodes_after} nodes; local check PASSED (the fused file in onnxruntime against "
            + ("eager" if f.local.get("against") == "eager" else "the decomposed file")
            + f", logits and cache, batch {f.local.get('batch')}, prefill + {f.local.get('decode_steps')} decode "
            f"steps, max_abs_err {f.local.get('max_abs_err', 0):.3g})"
            + (f"; {generation}" if generation else "") + f"; {share}; exact for unpadded batches only "
            "(seqlens_k = attention_mask.sum(-1) - 1; left padding differs: --no-fuse attention keeps it decomposed)")
