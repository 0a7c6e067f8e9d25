"""The int4 file's weights against the float file's (docs/design.md §15): every MatMulNBits block
unpacked by the format's reference rule (onnxruntime's contrib op MatMulNBits: 4-bit values, low
nibble first, blocks of `block_size` along K; zero point 8 where none is stored, else packed two a
byte) and each element compared with the float weight it stands for. Round to nearest keeps every
element within one quantization step (|scale|) of its float weight (half a step, one at the clipped
extreme of a symmetric block); a scale that is wrong (halved, another block's) or a zero point off
by one breaks that bound at once, whatever the logits then show. The quantizer is onnxruntime's; this only reads what it wrote.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import numpy_helper

#: the largest error allowed, in quantization steps (|scale|), per algorithm: round to nearest is
#: within half a step inside the range, and symmetric int4 (-8..7, the scale set by the block's
#: largest magnitude as -8) clips the other sign's extreme by up to one step; hqq fits scale and
#: zero point to the block's total error, single elements may sit further (measured: 0.78)
STEPS = {"rtn": 1.0, "hqq": 1.5,
         # a pre-quantized folder (prequantized.py): the float file holds the packed weights' exact
         # dequantization and the MatMulNBits are repacked from the same packed tensors: 0 steps
         "gptq": 0.0, "awq": 0.0, "compressed-tensors": 0.0}
#: float rounding, in steps: the distance is computed as |float / scale - (q - zero point)|, whose float32
#: rounding is ~1e-7 steps even where the float weight is the exact dequantization (a pre-quantized
#: folder's 0-step limit); a wrong nibble, scale or zero point is off by a large fraction of a step
SLACK = 1e-3


def count(model: onnx.ModelProto) -> dict:
    nodes = list(model.graph.node)
    return {"MatMulNBits": sum(n.op_type == "MatMulNBits" for n in nodes),
            "MatMul": sum(n.op_type == "MatMul" for n in nodes),
            "normexport": sum(n.domain == "normexport" for n in nodes),
            "norms": sum(n.op_type in ("RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization",
                                       "SkipSimplifiedLayerNormalization", "SkipLayerNormalization")
                         or n.domain == "normexport" for n in nodes)}


@dataclasses.dataclass
class WeightCheck:
    algorithm: str
    matrices: int = 0
    blocks: int = 0
    worst_steps: float = 0.0  # the largest |float - dequantized| / |scale| over every element
    worst_node: str | None = None
    limit: float = 0.5
    missing: list = dataclasses.field(default_factory=list)  # MatMulNBits whose float weight was not found

    @property
    def passed(self) -> bool:
        return self.matrices > 0 and self.worst_steps <= self.limit + SLACK and not self.missing

    def line(self) -> str:
        head = "weights PASSED" if self.passed else "weights FAILED"
        text = (f"  {head}: {self.matrices} int4 matrices ({self.blocks} blocks) unpacked against the float weights: "
                f"worst element {self.worst_steps:.3f} steps from its float weight (limit {self.limit} for "
                f"{self.algorithm}){f' at {self.worst_node}' if self.worst_steps > self.limit + SLACK else ''}")
        if self.missing:
            text += f"; no float weight found for {', '.join(self.missing[:3])}"
        if not self.matrices:
            text += "; no MatMulNBits node"
        return text

    def to_dict(self) -> dict:
        return {"passed": self.passed, "matrices": self.matrices, "blocks": self.blocks,
                "worst_steps": self.worst_steps, "limit_steps": self.limit, "worst_node": self.worst_node,
                "missing": self.missing}


#: rows of a matrix unpacked and compared at a time (a few MiB of buffers, not the whole matrix's)
ROWS = 512
#: columns of a transposed weight copied at a time (a [K, N] weight read as [N, K] rows: a tile of 64
#: columns keeps the rows it reads in cache; numpy's copy of the whole transposed slab is 1.7x slower)
TILE = 64
#: columns of the packed bytes transposed at a time (`_worst_steps_kn`)
TILE_BYTES = 256


def _blocks(b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, n: int, blocks: int,
            block: int) -> tuple[np.ndarray, np.ndarray]:
    """The format's reference rule on `n` rows: B [n, blocks, block/2] uint8 -> (W [n, blocks, block] float32,
    the scale of each block [n, blocks] float32)."""
    b = b.reshape(n, blocks, block // 2)
    q = np.empty((n, blocks, block), dtype=np.uint8)
    q[..., 0::2] = b & 0x0F
    q[..., 1::2] = b >> 4
    s = scales.astype(np.float32).reshape(n, blocks)
    return (q.astype(np.float32) - _zero_points(zero_points, n, blocks)) * s[..., None], s


def _zero_points(zero_points: np.ndarray | None, n: int, blocks: int):
    """The value that stands for 0, per block [n, blocks, 1] (8 where none is stored; uint8: two 4-bit
    values a byte, low nibble first; float (hqq): as stored)."""
    if zero_points is None:
        return np.float32(8)
    if zero_points.dtype == np.uint8:
        packed = zero_points.reshape(n, -1)
        zp = np.empty((n, packed.shape[1] * 2), dtype=np.uint8)
        zp[:, 0::2] = packed & 0x0F
        zp[:, 1::2] = packed >> 4
        return zp[:, :blocks].astype(np.float32).reshape(n, blocks, 1)
    return zero_points.astype(np.float32).reshape(n, blocks, 1)


def dequantize(b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, n: int,
               block: int) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' (4 bits) B [N, blocks, block/2] uint8, scales, zero points -> (W [N, K] float32,
    the step of each element [N, K])."""
    blocks = (k + block - 1) // block
    w, s = _blocks(b, scales, zero_points, n, blocks, block)
    step = np.broadcast_to(np.abs(s)[..., None], w.shape)
    return w.reshape(n, blocks * block)[:, :k], step.reshape(n, blocks * block)[:, :k]


def worst_steps(want: np.ndarray, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, n: int,
                block: int) -> float:
    """The largest |want - dequantized| / |scale| over every element of one matrix: `want` [N, K] (a
    transposed view is fine), compared ROWS rows at a time. The same quantity as the reference rule's
    (`dequantize`), computed in steps: |want / scale - (q - zero point)|, which takes a third of the
    passes over memory. A block whose scale is 0 dequantizes to 0: 0 steps where its float weights are
    all 0, else infinitely many."""
    if want.strides[-1] != want.itemsize and want.T.flags.c_contiguous:
        return _worst_steps_kn(want.T, b, scales, zero_points, k, n, block)
    blocks = (k + block - 1) // block
    width = blocks * block
    b = b.reshape(n, blocks * (block // 2))
    scales = scales.astype(np.float32).reshape(n, blocks)
    zero_points = None if zero_points is None else zero_points.reshape(n, -1)
    rows = min(ROWS, n)
    x = np.zeros((rows, width), dtype=np.float32)  # the float weights, then their distance in steps
    y = np.zeros((rows, width), dtype=np.float32)  # q - zero point
    contiguous = want.strides[-1] == want.itemsize
    worst = 0.0
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        m = r1 - r0
        xm, ym = x[:m], y[:m]
        if contiguous:
            xm[:, :k] = want[r0:r1]
        else:
            for c0 in range(0, k, TILE):
                c1 = min(k, c0 + TILE)
                xm[:, c0:c1] = want[r0:r1, c0:c1]
        s = scales[r0:r1]
        zero = s == 0
        empty = 0.0
        if zero.any():  # (its float weights' largest magnitude, before they are scaled; the block left out below)
            empty = float(np.abs(xm.reshape(m, blocks, block)[zero]).max())
        inverse = np.divide(np.float32(1), s, out=np.zeros_like(s), where=~zero)
        xm.reshape(m, blocks, block)[...] *= inverse[..., None]
        packed = b[r0:r1]
        ym[:, 0::2] = packed & 0x0F
        ym[:, 1::2] = packed >> 4
        ym.reshape(m, blocks, block)[...] -= _zero_points(None if zero_points is None else zero_points[r0:r1], m,
                                                          blocks)
        if width != k:
            ym[:, k:] = 0  # the padding of a last short block stands for nothing (x is 0 there)
        xm -= ym
        if empty:
            worst = np.inf
        if zero.any():
            xm.reshape(m, blocks, block)[zero] = 0  # a block of scale 0 dequantizes to 0: judged by `empty`
        # the largest |x| from the largest and the smallest (one contiguous reduction each, no temporary)
        top = max(float(xm.max()), -float(xm.min())) if xm.size else 0.0
        worst = max(worst, np.inf if np.isnan(top) else top)  # a NaN (scale or weight) is no match
    return worst


def _float_source(floats, quantized: str):
    """(the float initializer the MatMulNBits weight `quantized` replaced, whether it is a tied head's
    embedding table: int4.transposed_weights); (None, False) where the float file has neither."""
    base = quantized[:-3] if quantized.endswith("_Q4") else quantized
    if base in floats:
        return floats[base], False
    head, tied, _ = base.partition(".transposed_for_")
    return (floats[head], True) if tied and head in floats else (None, False)


def _unmap(tensor) -> None:
    """A float weight read from the file (onnx-ir maps the whole data file for each tensor it reads, and
    keeps the map): unmapped once compared, so that the check does not hold every weight's pages
    resident at its end (the process's RSS grew by the whole float file, docs/design.md §8)."""
    release = getattr(tensor, "release", None)
    if callable(release) and getattr(tensor, "raw", None) is not None:
        try:
            release()
        except BufferError:  # (a view of it still alive elsewhere: left mapped)
            pass


def check(model: onnx.ModelProto, float_ir, opts: dict) -> WeightCheck:
    """Every MatMulNBits of `model` against the float weight (in `float_ir`, the file before it was
    quantized) it replaced; the matrices compared on every core (numpy releases the GIL), the worst
    reported in the graph's order."""
    import concurrent.futures
    import os

    inits = {t.name: t for t in model.graph.initializer}
    floats = float_ir.graph.initializers
    result = WeightCheck(algorithm=opts["algorithm"], limit=STEPS.get(opts["algorithm"], 1.0))

    def compare(node) -> tuple[float, int]:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
        name = node.input[1]
        source, tied = _float_source(floats, name)
        array = source.const_value.numpy()
        # [N, K], a view: read ROWS rows at a time (a tied head's embedding table may be [N, K] already)
        want = array if tied and array.shape == (n, k) else array.reshape(k, n).T
        b = numpy_helper.to_array(inits[name])
        scales = numpy_helper.to_array(inits[node.input[2]])
        zp = numpy_helper.to_array(inits[node.input[3]]) if len(node.input) > 3 and node.input[3] else None
        worst = worst_steps(want, b, scales, zp, k, n, block)
        del want, array
        _unmap(source.const_value)
        return worst, n * ((k + block - 1) // block)

    nodes = []
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        source, _ = _float_source(floats, node.input[1])
        if source is None or source.const_value is None:
            result.missing.append(node.name)
        else:
            nodes.append(node)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        worst_of = list(pool.map(compare, nodes))
    for node, (worst, blocks) in zip(nodes, worst_of):
        result.matrices += 1
        result.blocks += blocks
        if worst > result.worst_steps or result.worst_node is None:
            result.worst_steps, result.worst_node = max(worst, result.worst_steps), node.name
    return result


def _worst_steps_kn(a: np.ndarray, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int,
                    n: int, block: int) -> float:
    """`worst_steps` of the weight a.T, read as it is stored: `a` [K, N] C-contiguous (a MatMul's
    weight), compared ROWS of its rows (whole blocks) at a time. The same arithmetic element by
    element, in the other order: the scales, zero points and the packed bytes are transposed (a
    half-byte per weight, a thirty-second of a float for the scales) instead of the float weights
    (4 bytes each). The same worst value, bit for bit; on one 2048 x 5632 matrix 0.041 -> 0.029 s, on
    5632 x 2048 0.054 -> 0.015 s; TinyLlama's whole check (154 matrices, beside the int4 file's write)
    3.55 s / 6.4 CPU s -> 2.67 s / 4.4 CPU s, 2-vCPU VM. Whole blocks are scaled as they are read
    (no copy first) and q - zero point is formed in int8 where the zero points are integers (a byte
    per weight, not four): the check alone on that file 1.44-1.82 s / 2.5-3.0 CPU s -> 1.01-1.09 s /
    1.8-1.9 CPU s, again bit for bit."""
    blocks = (k + block - 1) // block
    half = block // 2
    b = b.reshape(n, blocks * half)
    s = scales.astype(np.float32).reshape(n, blocks)
    zero = s == 0
    inverse = np.ascontiguousarray(np.divide(np.float32(1), s, out=np.zeros_like(s), where=~zero).T)  # [blocks, N]
    zp = _zero_points(zero_points, n, blocks)
    # q - zero point is an integer in [-15, 15]: formed in int8 (a byte per weight), exact, as in float
    zp = zp if np.ndim(zp) == 0 else np.ascontiguousarray(zp.reshape(n, blocks).T)  # [blocks, N]
    integral = bool(np.all(zp == np.round(zp)) and np.all((zp >= 0) & (zp <= 15)))  # (not HQQ's float ones)
    if integral:
        zp = zp.astype(np.int8)
    zero = np.ascontiguousarray(zero.T)  # [blocks, N]
    step = max(1, min(blocks, ROWS // block))  # blocks of rows at a time
    x = np.empty((step * block, n), dtype=np.float32)  # the float weights in steps, then their distance
    y = np.empty((step * block, n), dtype=np.int8 if integral else np.float32)  # q - zero point
    t = np.empty((step * half, n), dtype=np.uint8)  # the packed bytes, transposed
    worst = 0.0
    for b0 in range(0, blocks, step):
        b1 = min(blocks, b0 + step)
        nb, k0, k1 = b1 - b0, b0 * block, min(k, b1 * block)
        m, real = nb * block, k1 - k0  # rows with the padding of a last short block, rows of the weight
        xm, ym, tm = x[:m], y[:m], t[:nb * half]
        zb = zero[b0:b1]
        empty = 0.0
        if real == m and not zb.any():  # whole blocks: scaled as read (one pass, no copy first)
            np.multiply(a[k0:k1].reshape(nb, block, n), inverse[b0:b1, None, :], out=xm.reshape(nb, block, n))
        else:
            xm[:real] = a[k0:k1]
            xm[real:] = 0  # the padding of a last short block stands for nothing
            if zb.any():  # (the largest magnitude of the float weights in blocks of scale 0, before they are scaled)
                empty = float(np.where(zb[:, None, :], np.abs(xm.reshape(nb, block, n)), 0).max())
            xm.reshape(nb, block, n)[...] *= inverse[b0:b1, None, :]
        for c0 in range(0, n, TILE_BYTES):  # tiles of columns: the rows read stay in cache
            c1 = min(n, c0 + TILE_BYTES)
            tm[:, c0:c1] = b[c0:c1, b0 * half:b1 * half].T
        np.bitwise_and(tm, 0x0F, out=ym[0::2], casting="unsafe")
        np.right_shift(tm, 4, out=ym[1::2], casting="unsafe")
        if np.ndim(zp) == 0:
            ym -= zp
        else:
            ym.reshape(nb, block, n)[...] -= zp[b0:b1, None, :]
        ym[real:] = 0
        xm -= ym
        if empty:
            worst = np.inf
        if zb.any():
            xm.reshape(nb, block, n)[np.broadcast_to(zb[:, None, :], (nb, block, n))] = 0  # judged by `empty`
        top = max(float(xm.max()), -float(xm.min())) if xm.size else 0.0
        worst = max(worst, np.inf if np.isnan(top) else top)  # a NaN (scale or weight) is no match
    return worst
