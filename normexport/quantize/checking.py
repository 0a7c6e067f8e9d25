"""`normexport check` of a quantized file (docs/design.md §15): judged as quantized, never by the
float verdict of §7. A causal LM with its KV cache and int4 weights (MatMulNBits): the verdict of
verdict.py against the `--reference` model in fp32, beside onnxruntime-genai's int4 file of the
same folder (anchor.py) where its builder runs here. Any other file goes to the float check."""

from __future__ import annotations

import onnx

from ..errors import UsageError

QDQ = ("QuantizeLinear", "DequantizeLinear")


def kind_of(proto: onnx.ModelProto) -> str | None:
    """'int4' (MatMulNBits), 'qdq' (Q/DQ pairs), or None for a float file."""
    ops = {n.op_type for n in proto.graph.node}
    if "MatMulNBits" in ops:
        return "int4"
    if ops & set(QDQ):
        return "qdq"
    return None


def options_of(proto: onnx.ModelProto) -> dict:
    """The int4 options a file was made with, read from its MatMulNBits nodes (for the anchor)."""
    from .int4 import lm_head

    nodes = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    inits = {t.name: t for t in proto.graph.initializer}
    zp = nodes[0].input[3] if len(nodes[0].input) > 3 and nodes[0].input[3] else None
    float_zp = zp is not None and zp in inits and inits[zp].data_type != onnx.TensorProto.UINT8
    head = lm_head(proto)
    head_op = next((n.op_type for n in proto.graph.node if n.name == head), None)
    return {"kind": "int4", "block_size": int(attrs.get("block_size", 32)), "symmetric": zp is None,
            "accuracy_level": int(attrs.get("accuracy_level", 0)), "algorithm": "hqq" if float_zp else "rtn",
            "lm_head": head_op != "MatMul"}  # the logits come from a MatMulNBits, not a float MatMul


def run(args, single) -> int:
    from ..parity.generate import is_with_past
    from ..parity.runners import _ModelSource

    source = _ModelSource(args.onnx_model)  # missing / corrupt / damaged: one line, exit 2
    kind = kind_of(source.proto)
    if kind is None:
        source.close()
        return single(args)
    try:
        if kind != "int4" or not is_with_past(source.proto):
            raise UsageError(f"'{args.onnx_model}' is quantized ({'MatMulNBits' if kind == 'int4' else 'Q/DQ'}) and "
                             "takes no KV cache: its quantized verdict runs in `normexport convert --quantize` (against "
                             "eager and the float file); the float check does not judge quantized files")
        opts = options_of(source.proto)
    finally:
        source.close()
    from ..llm.checking import reference_lm
    from . import prequantized, verdict
    from .int4 import judge_llm_with_anchor

    if prequantized.quantization_config(args.reference) is not None:
        # a pre-quantized --reference (GPTQ / AWQ / compressed-tensors): eager on its exact dequantization
        import argparse

        with prequantized.dequantized(args.reference) as source:
            lm = reference_lm(argparse.Namespace(**{**vars(args), "reference": str(source.tmp / "float")}))
            lm = verdict.eager_reference(lm)
    else:
        lm = reference_lm(args)
    v = judge_llm_with_anchor(args.onnx_model, lm, args.reference, opts, anchor=not getattr(args, "no_anchor", False))
    print(v.table())
    if args.json:
        from ..io import write_json

        write_json({"command": "check", "onnx_model": str(args.onnx_model), "reference": str(args.reference),
                    "quantized": {"kind": "int4", "options": opts, "verdict": v.to_dict()}}, args.json, "--json")
        print(f"wrote {args.json}")
    return 0 if v.passed else 1
