"""Decomposed RMSNorm -> normexport::RMSNorm (target trt) / RMSNormalization (targets ort, onnx).

Matched forms (an upcast Cast(x) in front, the HF Llama form, is absorbed when nothing else reads it):
    ms = ReduceMean(Pow(x, 2) | Mul(x, x), trailing axes, keepdims=1)
    v  = Add(ms, eps) (either order), eps a constant scalar
    n  = x / sqrt(v) spelled Div(x, Sqrt(v)) | Mul(x, Reciprocal(Sqrt(v))) | Mul(x, Div(1, Sqrt(v)))
         | Mul(x, Pow(v, -0.5))  (Mul operands in either order)
    y  = n | Cast(n) | Mul(Cast?(n), scale) | Mul(scale, Cast?(n))

Per target (required_opset): trt -> normexport::RMSNorm with its function body (the driver raises
the opset to 18); ort -> RMSNormalization, the driver first raises the opset to 23 (an upgrade it
verifies numerically like every rewrite); onnx -> RMSNormalization only when the model already has
opset >= 23, else the decomposed form stays (the check fails with that reason).

Why ort raises the opset (tools/bench_ort.py, onnxruntime 1.32.0 CPU, 2 threads, this 2-core VM;
benchmarks/results/ort_2026-11-22_amd-epyc-2c.{txt,json}): on the norm-heavy graph (4096x2048
fp32) the torch.onnx default export, whose two RMSNorms stay decomposed at opset 20 (onnxruntime's
optimiser does not fuse that Reciprocal(Sqrt) form: 7 nodes each), takes 31.3 ms median and the
ort export with two RMSNormalization 23.9 ms (paired ratio 0.76), as fast as the torch.onnx
opset-23 export (paired 1.00); LLaMA block 0.98x the default export. One norm alone in the Div
form, which onnxruntime fuses itself (into SimplifiedLayerNormalization), showed no gain from any
form (tools/bench_rewrite.py --ort-forms, benchmarks/results/rewrite_2026-11-22.json). For target
ort, rules/skip_rms_norm.py then fuses a residual Add into the RMSNormalization where the hidden
size is large enough for that to be faster (measured there).
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from . import _common as c

TARGETS = frozenset({"trt", "ort", "onnx"})
_RMSNORMALIZATION_OPSET = 23


def required_opset(target: str) -> int:
    # trt: normexport function bodies need 18; ort: RMSNormalization (23), measured faster than the
    # decomposed form by tools/bench_ort.py; onnx: keep the opset the user chose
    return {"trt": 18, "ort": 23}.get(target, 0)


class RMSNormFusion(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, root: str, form: str | None = None, scale_left: bool = False, target: str = "trt"):
        super().__init__(name)
        self._root, self._form, self._scale_left, self._target = root, form, scale_left, target

    def pattern(self, op, x, eps, scale):
        xc = x  # an upcast Cast(x) feeding this is absorbed in check when nothing else reads it
        ms = op.ReduceMean(c.square(op, xc), _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["ms"])
        v = c.plus(op, ms, eps)
        if self._root == "bare":
            return c.inv_sqrt(op, xc, v, self._form)
        n = c.inv_sqrt_any(op, xc, v)
        if self._root == "cast":
            return op.Cast(n, to=pattern.AttrVar("out_dtype"))
        n = pattern.OrValue([op.Cast(c.inv_sqrt(op, xc, v, f), to=pattern.AttrVar("out_dtype")) for f in c.INV_FORMS]
                            + [c.inv_sqrt(op, xc, v, f) for f in c.INV_FORMS])
        return op.Mul(scale, n) if self._scale_left else op.Mul(n, scale)

    def check(self, context, x, eps, ms, scale=None, **_):
        r = pattern.MatchResult()
        self._out = context.output_values[0] if context.output_values else None
        self._src = c.absorb_cast(context, x)
        # target ort: the driver raises the opset to 23 first (required_opset); onnx keeps it
        if self._target == "onnx" and c.opset(context) < _RMSNORMALIZATION_OPSET:
            return r.fail(f"RMSNormalization needs opset >= {_RMSNORMALIZATION_OPSET} (model has "
                          f"{c.opset(context)}); decomposed form kept for target {self._target}")
        if x.dtype is not None and x.dtype not in c.FLOAT_TYPES:
            return r.fail(f"input dtype {x.dtype} is not a float type", x)
        if self._target == "trt" and x.dtype is not None and x.dtype not in c.CUSTOM_OP_TYPES:
            return r.fail(f"normexport::RMSNorm takes float32/float16/bfloat16, not {x.dtype}", x)
        src = x.producer()
        if (src is not None and src.op_type == "Sub" and len(src.inputs) == 2 and src.inputs[1] is not None
                and src.inputs[1].producer() is not None and src.inputs[1].producer().op_type == "ReduceMean"):
            return r.fail("input is Sub(a, ReduceMean(..)): a LayerNorm-like form the layer_norm rules did not take", x)
        self._eps = c.const_scalar(eps)
        if self._eps is None:
            return r.fail("epsilon is not a constant scalar", eps)
        axes, why = c.reduce_axes(ms.producer())
        if axes is None:
            return r.fail(why, ms)
        self._k = c.trailing_count(axes, c.rank_of(x))
        if self._k is None:
            return r.fail(f"mean over axes {axes} which are not the trailing dims", ms)
        self._reshape_scale = False
        if self._root == "scale":
            ok, why, self._reshape_scale = c.param_fits(scale, x, self._k)
            if not ok:
                return r.fail(why, scale)
        else:
            self._unit = c.trailing_dims(x, self._k)
            if self._unit is None:
                return r.fail("normalized dims not static; cannot make a unit scale", x)
        return r

    def rewrite(self, op, x, scale=None, **_):
        out = self._out
        x = self._src
        xin, dt, cast_out = c.fused_io(op, x, out) if out is not None else (x, x.dtype, None)
        if scale is None:
            name = f"{(out.name if out is not None else 'rms')}__unit_scale"
            scale = op.initializer(c.unit_tensor(name, self._unit, dt or ir.DataType.FLOAT, 1.0), name)
        else:
            if self._reshape_scale:
                scale = op.Reshape(scale, op.Constant(value_ints=c.trailing_dims(scale, self._k)))
            scale = c.as_dtype(op, scale, dt)
        if self._target == "trt":
            y = op.RMSNorm(xin, scale, _domain="normexport", _version=1, epsilon=self._eps, axis=-self._k)
        else:
            y = op.RMSNormalization(xin, scale, epsilon=self._eps, axis=-self._k, stash_type=1)
        return op.Cast(y, to=cast_out.value) if cast_out is not None else y


def _make(target: str) -> list[pattern.RewriteRule]:
    suffix = "" if target == "trt" else f"_{target}"
    rules = [
        RMSNormFusion.rule(f"rms_norm{suffix}_scale_right", root="scale", target=target),
        RMSNormFusion.rule(f"rms_norm{suffix}_scale_left", root="scale", scale_left=True, target=target),
        RMSNormFusion.rule(f"rms_norm{suffix}_cast", root="cast", target=target),
    ]
    rules += [RMSNormFusion.rule(f"rms_norm{suffix}_{f}", root="bare", form=f, target=target) for f in c.INV_FORMS]
    return rules


RULES = _make("trt")
_BY_TARGET = {"trt": RULES, "onnx": _make("onnx"), "ort": _make("ort")}


def rules_for(target: str) -> list[pattern.RewriteRule]:
    return _BY_TARGET[target]


__all__ = ["RULES", "TARGETS", "rules_for", "required_opset"]
