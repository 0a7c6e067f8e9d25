"""The attention mask the GroupQueryAttention rule matched (normexport.llm.gqa_rule), checked by
running it: each distinct mask subgraph is cut out and run in onnxruntime on small feeds (prefill,
decode, a padded attention_mask); it must be the plain causal + attention_mask mask (query i at
past p attends key j iff j <= p + i and attention_mask[b, j]), 0 where attended, the dtype's
minimum elsewhere. A sliding window (Mistral, Gemma 3), or any other mask, is not that: not
fused."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..ortrun import inference_session


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
    try:
        proto, names = _mask_model(value, opsets)
        sess = inference_session(proto.SerializeToString(), log_level=None)
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

