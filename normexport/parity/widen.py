"""A bfloat16 model in onnxruntime's CPU provider, which has no bfloat16 kernels for many ops: run
widened to float32 piece by piece (`_Chunked`) where widened whole it would not fit
(docs/design.md §8); what the onnxruntime runner (runners.OrtRunner) decides with `_has_bf16`."""

from __future__ import annotations

import numpy as np
import onnx
import torch

from ..ortrun import inference_session

#: float32 bytes of weights per piece: a tenth of the model's (the check's peak stays near the
#: weights' size: docs/design.md §8), at least CHUNK_MIN_BYTES (fewer sessions), at most CHUNK_BYTES
CHUNK_BYTES = 1536 << 20
CHUNK_MIN_BYTES = 128 << 20
#: constants up to this size go into a piece as initializers; larger ones are fed as inputs
_EMBED_BYTES = 1 << 20


class _Chunked:
    """A bfloat16 model run in onnxruntime's CPU provider widened to float32 one piece at a time:
    the nodes in graph order cut into pieces of about CHUNK_BYTES of float32 weights; each piece a
    model of its own (weights fed as inputs, widened from the memory-mapped file as it runs), its
    outputs the values later pieces read. Holds one piece's weights in float32 at a time (an 8 B
    model's check does not need 30 GiB)."""

    def __init__(self, path: str):
        import onnx_ir as ir

        self.model = ir.load(path)
        g = self.model.graph
        self.input_names = [v.name for v in g.inputs if v.name not in g.initializers]
        nodes = list(g)
        limit = min(CHUNK_BYTES, max(CHUNK_MIN_BYTES, sum(_f32_bytes(v) for v in g.initializers.values()) // 10))
        chunks: list[list] = [[]]
        size, counted = 0, set()
        for n in nodes:
            new = [v for v in n.inputs if v is not None and v.const_value is not None and v.producer() is None
                   and id(v) not in counted]
            b = sum(_f32_bytes(v) for v in new)
            if chunks[-1] and size + b > limit:
                chunks.append([])
                size, counted = 0, set()
            chunks[-1].append(n)
            size += b
            counted.update(id(v) for v in new)
        self.chunks = chunks
        index = {id(n): i for i, c in enumerate(chunks) for n in c}
        #: the last piece that reads each value (len(chunks): a graph output)
        self.last_use: dict[int, int] = {}
        for n in nodes:
            for v in n.inputs:
                if v is not None:
                    self.last_use[id(v)] = max(self.last_use.get(id(v), -1), index[id(n)])
        for v in g.outputs:
            self.last_use[id(v)] = len(chunks)
        self.values = {o.name: o for n in nodes for o in n.outputs if o.name}
        self.values.update({v.name: v for v in g.inputs})

    def run(self, feeds: dict) -> list[np.ndarray]:
        import onnx_ir as ir
        import onnxruntime as ort

        from ..rewriter.local import _retype

        env: dict[str, np.ndarray] = {}
        for name, t in feeds.items():
            t = t.detach().cpu()
            env[name] = (t.float() if t.dtype in (torch.bfloat16,) else t).numpy()
        g = self.model.graph
        for i, chunk in enumerate(self.chunks):
            made = {id(o) for n in chunk for o in n.outputs}
            ins, inits, fed, mapped, arr = [], [], {}, [], None
            seen = set()
            for n in chunk:
                for v in n.inputs:
                    if v is None or id(v) in made or id(v) in seen:
                        continue
                    seen.add(id(v))
                    elem = int(v.dtype.value) if v.dtype is not None else onnx.TensorProto.FLOAT
                    elem = onnx.TensorProto.FLOAT if elem == onnx.TensorProto.BFLOAT16 else elem
                    if v.const_value is not None and v.producer() is None:
                        mapped.append(v.const_value)
                        arr = _widened(v.const_value.numpy())
                        if arr.nbytes <= _EMBED_BYTES:
                            inits.append(onnx.numpy_helper.from_array(arr, v.name))
                            continue
                        fed[v.name] = arr
                    else:
                        fed[v.name] = env[v.name]
                    ins.append(onnx.helper.make_tensor_value_info(v.name, elem, None))
            outs = [onnx.helper.make_tensor_value_info(o.name, _elem_f32(o), None) for n in chunk for o in n.outputs
                    if o.name and self.last_use.get(id(o), -1) > i]
            graph = onnx.helper.make_graph([ir.serde.serialize_node(n) for n in chunk], f"piece{i}", ins, outs)
            proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v)
                                                                 for d, v in self.model.opset_imports.items()],
                                           ir_version=min(self.model.ir_version or 10, 10))
            proto.functions.extend(ir.serde.serialize_function(f) for f in self.model.functions.values())
            proto = _retype(proto, {onnx.TensorProto.BFLOAT16}, onnx.TensorProto.FLOAT)
            proto.graph.initializer.extend(inits)
            sess = inference_session(proto.SerializeToString(), log_level=4)
            ro = ort.RunOptions()
            ro.log_severity_level = 4
            got = sess.run([o.name for o in outs], fed, ro)
            del sess, fed, arr
            _unmap(mapped)  # the piece's weights leave the process (its RSS stays one piece, not the file)
            env.update(zip([o.name for o in outs], got))
            for name in list(env):  # activations no later piece reads
                v = self.values.get(name)
                if v is not None and self.last_use.get(id(v), len(self.chunks)) <= i:
                    del env[name]
        return [env[v.name] for v in g.outputs]


def _unmap(tensors) -> None:
    """Close the memory maps of external tensors a piece read (onnx-ir maps the data file per
    tensor and keeps the pages until released): a later read maps them again."""
    for t in tensors:
        release = getattr(t, "release", None)
        if release is not None:
            try:
                release()
            except BufferError:  # a view is still alive somewhere: leave this one mapped
                pass


def _f32_bytes(v) -> int:
    try:
        n = int(np.prod(v.const_value.shape.numpy())) if v.const_value.shape is not None else 0
        return n * max(4, v.const_value.dtype.itemsize) if v.const_value.dtype.is_floating_point() else v.const_value.nbytes
    except Exception:  # noqa: BLE001
        return 0


def _widened(arr: np.ndarray) -> np.ndarray:
    return arr.astype(np.float32) if arr.dtype.name == "bfloat16" else arr


def _elem_f32(v) -> int:
    elem = int(v.dtype.value) if v.dtype is not None else onnx.TensorProto.FLOAT
    return onnx.TensorProto.FLOAT if elem == onnx.TensorProto.BFLOAT16 else elem


def _has_bf16(model: onnx.ModelProto) -> bool:
    g = model.graph
    return any(vi.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16 for vi in list(g.input) + list(g.output)) or \
        any(t.data_type == onnx.TensorProto.BFLOAT16 for t in g.initializer) or \
        any(a.name == "to" and a.i == onnx.TensorProto.BFLOAT16 for n in g.node for a in n.attribute)
