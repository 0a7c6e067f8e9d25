"""The GroupQueryAttention rewrite rule (onnxscript's pattern API) of the attention fusion
(normexport.llm.attention, docs/design.md §10): `rule_class()` matches per layer q / k / v
projections reshaped to heads (q and k optionally through an RMSNormalization over the head dim:
Qwen 3), rotated, the cache concatenated (`present.{i}.*`), k / v repeated over the head groups,
the SDPA, and back to [batch, sequence, hidden]; and writes one GroupQueryAttention: num_heads /
kv_num_heads / head size from the shapes, `scale` from the SDPA, `do_rotary=1` with cos / sin
caches [max positions, head_dim / 2] computed from the graph's own inverse frequencies
(normexport.llm.rotary), `seqlens_k` = attention_mask.sum(-1) - 1 and `total_sequence_length` =
attention_mask.shape[1] (int32), as onnxruntime-genai's builder feeds them. What it matched as
the mask is run before it is accepted (normexport.llm.masks).

onnxscript's own GQA rule (ort_fusions/gqa.py) is not used: it matches an older transformers
causal-mask spelling, q / k norms only as SimplifiedLayerNormalization, drops the SDPA's scale and
takes seqlens_k from position_ids.

`packed_qkv`: GroupQueryAttention nodes fed by one Split of a packed q / k / v projection take
the packed query.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from .masks import check_mask
from .rotary import inv_freq as _inv_freq

MS = "com.microsoft"
#: the domain of onnxscript's intermediate fusion ops (RotaryEmbedding, SDPA)
FUSION_DOMAIN = "ai.onnxruntime._fusion"
_FUSION = FUSION_DOMAIN


def rule_class():
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
            # rows whose keys are all masked set to 0 after it, as torch does (exporter/sdpa.py); GroupQueryAttention
            # is exact for unpadded batches only, where no row is (the module docstring's seqlens_k)
            safe = op.Where(pattern.ANY_VALUE, attn, pattern.ANY_VALUE)
            out = op.Reshape(op.Transpose(pattern.OrValue([attn, safe]), perm=[0, 2, 1, 3]), pattern.ANY_VALUE,
                             _outputs=["attention_BSD"])
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
            inv_freq, why = _inv_freq(cos, sin)
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
            self.presents += [(present_key, new_key), (present_value, new_value)]  # rewired by attention._take_presents
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

