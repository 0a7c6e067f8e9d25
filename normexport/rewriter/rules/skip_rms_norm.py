"""Residual Add -> RMSNormalization  ==>  com.microsoft SkipSimplifiedLayerNormalization (target ort).

Matched (the rms_norm rule's output for target ort, or a hand-written opset-23 graph):
    s = Add(a, b)                                   the residual sum
    y = RMSNormalization(s, gamma)                  last axis only, stash_type 1
==> y, _, _, s' = com.microsoft.SkipSimplifiedLayerNormalization(input, skip, gamma, epsilon=eps)
where s' (input_skip_bias_sum) replaces s for its other consumers (the residual stream); when
nothing else reads s the node has only its first output (rule skip_rms_norm, the sum is then not
written at all), else four (rule skip_rms_norm_residual; mean / inv_std_var unused).

onnxruntime's op contract (its schema and CPU kernel, contrib_ops/cpu/skip_layer_norm*.{h,cc}):
input [B, S, H] or [T, H]; skip the same shape, or for a 3-D input also [1, S, H] / [S, H];
gamma 1-D [H]; T float / float16 (bfloat16 is in the schema but has no CPU kernel; float64 is
not in the schema). The check therefore rejects: the norm over a non-last axis or stash_type != 1;
ranks other than 2 / 3; a skip shape that does not fit (incl. unknown or anonymous dims); neither
Add operand of the sum's full shape; gamma not [H] (a [1.., H] gamma is reshaped); dtypes
other than float32 / float16 or differing between the operands and gamma; and a sum that is a
graph output (kept as the Add it is).

Enabled for target ort, gated by size. Measured with tools/bench_ort.py (onnxruntime 1.32.0 CPU,
2 threads, this 2-core AMD EPYC VM, quiet: other processes < 2 % CPU), the op alone against
Add + RMSNormalization (paired per-round median ratios, 150 rounds, -contrib-ops results):
    1x1x4096 1.25 | 1x256x512 1.39 (1.47 with the sum read) | 1x1024x1024 1.00 (1.09)
    2048x2048 0.86 (0.95) | 4096x2048 0.93 (0.98)
i.e. faster where the tensors are large and memory-bound, slower where they fit in cache (its
CPU kernel is a scalar per-row loop). Hence the gate: hidden size H >= MIN_HIDDEN (2048) and, when
every dim is static, at least MIN_ELEMENTS (2^22) elements; H is static in every real model, the
row count often is not, so a dynamic-sequence model with H >= 2048 is fused (a decode step of one
token then pays about 3 microseconds per norm). End to end, (c+) rule on / (c-) rule off, paired
median [95 % CI], 300 rounds:
    norm-heavy 4096x2048 (2 fusions)   0.971 [0.959-0.983]   earlier run 0.964 [0.953-0.975]
    LLaMA block h512 s256              (H < 2048: not fused; ungated it measured 1.001 [0.997-1.007],
                                        earlier run 1.010 [1.005-1.017])
    DiT block (0 sites: A/A)           0.999 [0.995-1.003]
    A/A control on norm-heavy (the same graph twice): 1.016 [1.003-1.030]
benchmarks/results/ort_2026-11-22_amd-epyc-2c{,-earlier-run,-contrib-ops}.{txt,json}.

Add -> LayerNormalization -> SkipLayerNormalization (with beta) is not offered: that op alone is
2.8-3.3x slower than Add + LayerNormalization at 4096x2048 (2-D, where onnxruntime leaves the pair
alone); for 3-D inputs onnxruntime's own optimiser already fuses the pair into it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from . import _common as c

TARGETS = frozenset({"ort"})
#: the size gate (see the docstring): below it the contrib op measured slower than Add + RMSNormalization
MIN_HIDDEN = 2048
MIN_ELEMENTS = 1 << 22

#: the types onnxruntime's SkipSimplifiedLayerNormalization has in its schema *and* a CPU kernel for
_SKIP_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16})


def _skip_fits(input_shape, skip_shape) -> bool:
    """onnxruntime's rule: skip has the shape of input, or (3-D input) [1, S, H] or [S, H]."""
    if c.same_shape(input_shape, skip_shape):
        return True
    if len(input_shape) != 3:
        return False
    tail = list(input_shape)[1:]
    if len(skip_shape) == 3:
        return skip_shape[0] == 1 and c.same_shape(tail, list(skip_shape)[1:])
    return len(skip_shape) == 2 and c.same_shape(tail, list(skip_shape))


class SkipRMSNormFusion(c.AddNormFusion):
    """residual=False: the sum feeds only the norm (one output, the sum is not written);
    residual=True: the sum also feeds other nodes, which then read input_skip_bias_sum.
    `scale`: the RMSNormalization's gamma."""

    def norm(self, op, s, scale):
        return op.RMSNormalization(s, scale, _allow_other_attributes=True, _outputs=["norm"])

    def check(self, context, a, b, scale, sum, norm, **_):  # noqa: A002 - the pattern's name
        r = pattern.MatchResult()
        node = norm.producer()
        if sum.is_graph_output():
            return r.fail("the residual sum is a graph output (kept as the Add)", sum)
        stash = node.attributes.get("stash_type")
        if stash is not None and stash.as_int() != 1:
            return r.fail(f"RMSNormalization stash_type {stash.as_int()} (the contrib op computes in float32)", norm)
        shapes = {v.name: v.shape for v in (a, b, sum)}
        if any(s is None for s in shapes.values()):
            return r.fail("shape of the Add operands or sum unknown", sum)
        rank = len(sum.shape)
        if rank not in (2, 3):
            return r.fail(f"sum has rank {rank}; SkipSimplifiedLayerNormalization takes [B, S, H] or [T, H]", sum)
        axis = c.norm_axis(node)
        if axis % rank != rank - 1:
            return r.fail(f"RMSNormalization axis {axis} does not normalize the last dim only", norm)
        # the contrib op's input is the operand of the sum's full shape, skip the (maybe broadcast) other
        if c.same_shape(a.shape, sum.shape):
            inp, skip = a, b
        elif c.same_shape(b.shape, sum.shape):
            inp, skip = b, a
        else:
            return r.fail(f"neither Add operand {list(a.shape)} / {list(b.shape)} has the sum's shape "
                          f"{list(sum.shape)}", sum)
        if not _skip_fits(inp.shape, skip.shape):
            return r.fail(f"skip shape {list(skip.shape)} does not fit input {list(inp.shape)} "
                          f"(same shape, or [1, S, H] / [S, H] for a 3-D input)", skip)
        dt = inp.dtype
        if dt not in _SKIP_TYPES:
            return r.fail(f"dtype {dt} is not float32/float16 (onnxruntime CPU kernels)", inp)
        if not c.check_residual_norm_tail(self, r, inp, (skip,), scale, node, 1e-5):
            return r
        if self._hidden is None or self._hidden[0] < MIN_HIDDEN:
            return r.fail(f"hidden size {self._hidden} < {MIN_HIDDEN}: the fused op measured slower than "
                          "Add + RMSNormalization on tensors that fit in cache", inp)
        dims = list(inp.shape)
        if all(isinstance(d, int) for d in dims) and int(np.prod(dims)) < MIN_ELEMENTS:
            return r.fail(f"{int(np.prod(dims))} elements < {MIN_ELEMENTS}: the fused op measured slower than "
                          "Add + RMSNormalization on tensors that fit in cache", inp)
        self._inp, self._skip = inp, skip
        return r

    def rewrite(self, op, scale, **_):
        gamma = c.as_hidden_vector(self, op, scale)
        if not self._residual:
            return op.SkipSimplifiedLayerNormalization(self._inp, self._skip, gamma, _domain="com.microsoft",
                                                       _version=1, epsilon=self._eps)
        # mean / inv_std_var: unused, never written by onnxruntime's kernels (they only produce outputs
        # 0 and 3); the rewriter's NameFixPass gives them names, as it does every value
        y, _mean, _inv_std, s = op.SkipSimplifiedLayerNormalization(
            self._inp, self._skip, gamma, _domain="com.microsoft", _version=1, epsilon=self._eps, _outputs=4)
        return y, s


# the one-output form first: a sum nothing else reads is then not written at all
RULES = [SkipRMSNormFusion.rule("skip_rms_norm", residual=False),
         SkipRMSNormFusion.rule("skip_rms_norm_residual", residual=True)]

__all__ = ["RULES", "TARGETS"]
