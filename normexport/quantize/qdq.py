"""`--quantize int8|fp8` (--target trt; docs/design.md §15): QuantizeLinear / DequantizeLinear pairs on
MatMul / Gemm / Conv, made by onnxruntime's static quantizer (onnxruntime.quantization.quantize_static,
QuantFormat.QDQ) calibrated on convert's inputs: symmetric, per-channel weights (stored quantized, one
DequantizeLinear feeding the op, as TensorRT's explicit quantization reads them), per-tensor
activations; int8 or float8e4m3fn. Only MatMul / Gemm / Conv are quantized: the normexport nodes stay
in the activation dtype, no Q/DQ on their inputs or outputs (checked on the quantized graph:
`wrapped_normexport`). The quantized file is judged against eager fp32 (verdict.judge_outputs) and
replaces the float file only when it passes."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from ..errors import UsageError

OPS = ("MatMul", "Gemm", "Conv")


def eligible(model: onnx.ModelProto) -> list[str]:
    """Names (or indices) of the default-domain MatMul / Gemm / Conv nodes of `model`'s main graph."""
    return [n.name or f"#{i}" for i, n in enumerate(model.graph.node) if n.op_type in OPS and n.domain in ("", "ai.onnx")]


def refuse_unquantizable(rec) -> None:
    """Before anything is written: a graph with no MatMul / Gemm / Conv is one line, exit 2."""
    if rec.model_ir is None:
        return
    import onnx_ir as ir

    names = [n.name for n in rec.model_ir.graph if n.op_type in OPS and n.domain in ("", "ai.onnx")]
    del ir
    if not names:
        raise UsageError(f"--quantize {rec.quant['kind']}: '{rec.args.model}' exports no MatMul / Gemm / Conv "
                         "(int8 / fp8 put Q/DQ on those): leave --quantize out")


class _Reader:
    """onnxruntime.quantization.CalibrationDataReader over convert's inputs (one sample)."""

    def __init__(self, feeds: list[dict]):
        self._it = iter(feeds)

    def get_next(self):
        return next(self._it, None)

    def rewind(self):  # pragma: no cover - onnxruntime calls it in some calibrators
        pass


def feeds_of(model: onnx.ModelProto, inputs) -> list[dict]:
    import torch

    names = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    arrays = [t.detach().cpu().numpy() if torch.is_tensor(t) else np.asarray(t) for t in inputs]
    return [dict(zip(names, arrays))]


def quantize(src: Path, dst: Path, kind: str, inputs) -> onnx.ModelProto:
    """onnxruntime's QDQ quantizer on the float file `src` -> `dst` (a ModelProto returned)."""
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static

    model = onnx.load(str(src))
    reader = type("Reader", (_Reader, CalibrationDataReader), {})(feeds_of(model, inputs))
    qtype = QuantType.QInt8 if kind == "int8" else QuantType.QFLOAT8E4M3FN
    quantize_static(str(src), str(dst), reader, quant_format=QuantFormat.QDQ, op_types_to_quantize=list(OPS),
                    per_channel=True, activation_type=qtype, weight_type=qtype,
                    calibrate_method=CalibrationMethod.MinMax if kind == "int8" else CalibrationMethod.Distribution,
                    extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "QDQKeepRemovableActivations": False},
                    use_external_data_format=False)
    return onnx.load(str(dst))


def structure(model: onnx.ModelProto) -> dict:
    """What the quantized graph holds: quantized ops (both inputs from a DequantizeLinear), ops left in
    float, the normexport nodes, and those of them wrapped (an input from a DequantizeLinear: the node would
    compute on a quantized tensor). A QuantizeLinear reading a normexport output is the activation
    quantization of the MatMul / Gemm / Conv after it (its own Q -> DQ pair, the norm's output stays float),
    counted in `normexport_outputs_quantized`."""
    prod = {o: n for n in model.graph.node for o in n.output}
    readers: dict = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    quantized, floating, wrapped, nx = [], [], [], []
    for n in model.graph.node:
        if n.domain == "normexport":
            nx.append(n.name)
            fed = any(i in prod and prod[i].op_type == "DequantizeLinear" for i in n.input)
            if fed:
                wrapped.append(n.name)
        elif n.op_type in OPS and n.domain in ("", "ai.onnx"):
            ins = list(n.input[:2])
            ok = all(i in prod and prod[i].op_type == "DequantizeLinear" for i in ins)
            (quantized if ok else floating).append(n.name)
    outq = sum(r.op_type == "QuantizeLinear" for n in model.graph.node if n.domain == "normexport"
               for o in n.output for r in readers.get(o, []))
    return {"quantized": quantized, "normexport_outputs_quantized": outq, "float": floating, "normexport": nx, "wrapped_normexport": wrapped,
            "QuantizeLinear": sum(n.op_type == "QuantizeLinear" for n in model.graph.node),
            "DequantizeLinear": sum(n.op_type == "DequantizeLinear" for n in model.graph.node)}


def unwrap_normexport(model: onnx.ModelProto) -> int:
    """Q -> DQ pairs onnxruntime's quantizer put on a tensor a normexport node reads or writes are moved
    off it: the normexport node reads the float tensor, the quantized op keeps its own pair. Returns the
    normexport inputs rewired."""
    prod = {o: n for n in model.graph.node for o in n.output}
    moved = 0
    for n in model.graph.node:
        if n.domain != "normexport":
            continue
        for k, name in enumerate(n.input):
            dq = prod.get(name)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            q = prod.get(dq.input[0])
            if q is None or q.op_type != "QuantizeLinear":
                continue
            n.input[k] = q.input[0]
            moved += 1
    return moved


def run(rec):
    """The stage's int8 / fp8 work on the written float file rec.out."""
    from .. import io
    from . import verdict
    from .int4 import _drop, _report

    kind, out = rec.quant["kind"], rec.out
    check = not getattr(rec.args, "no_check", False)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".qdq-") as work:
        t0 = time.perf_counter()
        try:
            proto = quantize(out, Path(work) / "q.onnx", kind, rec.inputs)
        except Exception as e:  # onnxruntime's quantizer refused the graph: said in one line, exit 1
            _drop(out)
            print(f"quantize {kind}: onnxruntime's quantizer failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
                  f"{out} not written")
            rec.quantized = {"kind": kind, "passed": False, "error": str(e)}
            rec.exit_code = 1
            return rec
        seconds = time.perf_counter() - t0
        moved = unwrap_normexport(proto)
        found = structure(proto)
        print(f"quantize {kind}: {len(found['quantized'])} MatMul/Gemm/Conv with Q/DQ on weights (per channel) and "
              f"activations (per tensor), symmetric, by onnxruntime's quantize_static (QDQ), calibrated on convert's "
              f"inputs; {len(found['float'])} left in float; {len(found['normexport'])} normexport node(s) kept float "
              f"({moved} input(s) rewired off the quantizer's Q/DQ); "
              f"{seconds:.1f} s")
        judged: dict = {}
        float_copy = Path(work) / "float.onnx"
        import shutil

        shutil.copyfile(out, float_copy)
        if out.with_name(out.name + ".data").exists():
            shutil.copyfile(out.with_name(out.name + ".data"), Path(work) / (out.name + ".data"))
            float_copy = Path(work) / out.name
            shutil.move(str(Path(work) / "float.onnx"), float_copy)

        def judge(tmp: Path) -> None:
            if found["wrapped_normexport"]:
                raise _Failed(f"normexport node(s) wrapped in Q/DQ: {', '.join(found['wrapped_normexport'])}")
            if not found["quantized"]:
                raise _Failed("no MatMul / Gemm / Conv took Q/DQ")
            if not check:
                return
            v = verdict.judge_outputs(tmp, rec.module, rec.inputs, rec.names, kind=kind, float_path=float_copy)
            judged["verdict"] = v
            print(v.table())
            if not v.passed:
                raise _Failed("the quantized file FAILED its agreement check (table above)")

        try:
            import onnx_ir as ir

            io.save_ir(ir.serde.deserialize_model(proto), out, validate=judge)
        except _Failed as e:
            _drop(out)
            print(f"quantize {kind}: {e}; {out} not written (--no-check writes it without the agreement check)")
            v = judged.get("verdict")
            rec.quantized = {"kind": kind, "passed": False, "graph": found, "verdict": v.to_dict() if v else None}
            rec.exit_code = 1
            _report(rec)
            return rec
    v = judged.get("verdict")
    rec.quantized = {"kind": kind, "passed": True, "graph": found, "verdict": v.to_dict() if v else None,
                     "seconds": round(seconds, 2)}
    _report(rec)
    print(f"wrote {getattr(rec.args, 'shown_output', None) or out} ({kind} Q/DQ)")
    return rec


class _Failed(Exception):
    pass
