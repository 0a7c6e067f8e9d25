"""`--quantize` (docs/design.md §15): quantized output of `convert`.

    int4   onnxruntime targets (ort, onnx): MatMul weights as MatMulNBits, made by onnxruntime's own
           quantizer (onnxruntime.quantization.matmul_nbits_quantizer); block size, symmetry,
           accuracy level and algorithm as flags; the fused norms stay as they are (int4.py)
    int8   --target trt: QuantizeLinear / DequantizeLinear around MatMul / Gemm / Conv weights and
    fp8    activations (symmetric, per-channel weights, per-tensor activations; float8e4m3fn for
           fp8), calibrated on convert's inputs with onnxruntime.quantization's QDQ tooling; the
           normexport nodes stay in the activation dtype, never wrapped (qdq.py)

A quantized file is judged as quantized (agreement with eager fp32; verdict.py), never by the
float verdict of §7. Bad input (a kind the target cannot serve, a model it cannot quantize) is
refused in one line before anything is written (`refuse_early`).
"""

from __future__ import annotations

import argparse

from ..errors import UsageError

KINDS = ("int4", "int8", "fp8")
#: the targets each kind serves
TARGETS_OF = {"int4": ("ort", "onnx"), "int8": ("trt",), "fp8": ("trt",)}
BLOCK_SIZES = (16, 32, 64, 128, 256)
#: MatMulNBitsQuantizer's algorithms offered: rtn (its default blockwise round to nearest, in C++: what
#: onnxruntime-genai's builder uses) and hqq (half-quadratic: scales and zero points fitted to each block).
#: Its neural-compressor k_quant / rtn paths are not offered: in onnxruntime 1.32 they ignore the block
#: size and stop on weights narrower than a block ("cannot reshape array of size 16 into shape (32,newaxis)"
#: on a 32 x 16 projection), and take 400x the time
ALGORITHMS = ("rtn", "hqq")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", choices=KINDS, default=None,
                   help="quantized output (docs/design.md §15): int4 (--target ort/onnx: MatMulNBits weights, by "
                        "onnxruntime's quantizer), int8 / fp8 (--target trt: Q/DQ on MatMul / Gemm / Conv, calibrated "
                        "on convert's inputs); judged by agreement with eager fp32, not by the float verdict")
    p.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=None, metavar="N",
                   help="int4: weights per scale (16, 32, 64, 128, 256; default 32, as onnxruntime-genai's builder)")
    p.add_argument("--asymmetric", action="store_true", help="int4: zero points per block (default: symmetric)")
    p.add_argument("--accuracy-level", type=int, choices=(0, 1, 2, 3, 4), default=None, metavar="L",
                   help="int4: MatMulNBits accuracy_level, the activations' type in the kernel (4: int8, the "
                        "fastest on CPU and onnxruntime-genai's builder's CPU default; 0: unset)")
    p.add_argument("--quant-algo", choices=ALGORITHMS, default=None,
                   help="int4: onnxruntime's algorithm (rtn: its blockwise round to nearest, the default, as onnxruntime-genai's "
                        "builder; hqq: half-quadratic, scales and zero points fitted per block)")
    p.add_argument("--float-lm-head", action="store_true",
                   help="int4: keep the LM head's MatMul in float (default: quantized too, as onnxruntime-genai's builder)")
    add_check_arguments(p)


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    """What convert and check share: --no-anchor."""
    p.add_argument("--no-anchor", action="store_true",
                   help="a quantized LLM: judge it by the thresholds of docs/design.md §15 without building "
                        "onnxruntime-genai's int4 file of the same folder beside it")


def options(args) -> dict | None:
    """The --quantize options as one dict (None without --quantize); int4-only flags without int4 refused."""
    kind = getattr(args, "quantize", None)
    int4_only = {"--block-size": getattr(args, "block_size", None), "--asymmetric": getattr(args, "asymmetric", False),
                 "--accuracy-level": getattr(args, "accuracy_level", None), "--quant-algo": getattr(args, "quant_algo", None),
                 "--float-lm-head": getattr(args, "float_lm_head", False)}
    given = [flag for flag, v in int4_only.items() if v not in (None, False)]
    if kind != "int4" and given:
        raise UsageError(f"{', '.join(given)}: int4 options; pass --quantize int4 (with --target ort) or leave them out")
    if kind is None:
        return None
    return {"kind": kind,
            "block_size": int4_only["--block-size"] or 32,
            "symmetric": not int4_only["--asymmetric"],
            "accuracy_level": 4 if int4_only["--accuracy-level"] is None else int4_only["--accuracy-level"],
            "algorithm": int4_only["--quant-algo"] or "rtn",
            "lm_head": not int4_only["--float-lm-head"]}


def refuse_early(args) -> dict | None:
    """The options, or a one-line UsageError (nothing loaded or written yet) where the kind does not
    fit the target."""
    opts = options(args)
    if opts is None:
        return None
    target = getattr(args, "target", "trt")
    if target not in TARGETS_OF[opts["kind"]]:
        served = "; ".join(f"{k} for --target {'/'.join(t)}" for k, t in TARGETS_OF.items())
        raise UsageError(f"--quantize {opts['kind']} does not serve --target {target}: supported are {served}")
    if getattr(args, "no_check", False):
        print("  quantize: --no-check: the quantized file is written without its agreement check")
    return opts


def run(rec):
    """The convert stage's work on the written file (rec.out): int4 (int4.py) or int8 / fp8 (qdq.py)."""
    kind = rec.quant["kind"]
    if kind == "int4":
        from . import int4

        return int4.run(rec)
    from . import qdq

    return qdq.run(rec)


def refuse_unquantizable(rec) -> None:
    """Before anything is written: one line (exit 2) where the exported graph has nothing the kind quantizes."""
    if rec.quant["kind"] == "int4":
        from . import int4

        int4.refuse_unquantizable(rec)
    else:
        from . import qdq

        if hasattr(qdq, "refuse_unquantizable"):
            qdq.refuse_unquantizable(rec)
