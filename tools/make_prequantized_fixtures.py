"""Writes tests/fixtures/prequantized/: tiny LLaMA folders quantized by real libraries on the CPU,
for normexport.quantize.prequantized (docs/design.md §15), each with the writing library's own
dequantization of every packed Linear (reference.npz, float32: exact, checked here against float64).

    gptq_sym, gptq_asym   auto-round 0.16.1, format auto_gptq (GPTQ v1 packing: qzeros = zero - 1);
                          reference: auto_round_extension.torch.qlinear_torch_zp.QuantLinear.forward
    awq                   auto-round 0.16.1, format auto_awq (AutoAWQ gemm packing, interleaved);
                          reference: auto_round.export.export_to_awq.utils.dequantize_gemm
    ct                    auto-round 0.16.1, format llm_compressor (compressed-tensors 0.20.0
                          pack-quantized); reference: compressed_tensors PackedQuantizationCompressor.decompress

The writers are not normexport dependencies; run this in a scratch venv that has them, e.g.

    python -m venv /tmp/qv && echo $PWD/.venv/lib/python3.11/site-packages > /tmp/qv/lib/python3.11/site-packages/main.pth
    /tmp/qv/bin/pip install auto-round==0.16.1 compressed-tensors==0.20.0 datasets py-cpuinfo loguru psutil accelerate
    /tmp/qv/bin/python tools/make_prequantized_fixtures.py

RTN (iters=0, disable_opt_rtn): no calibration data is read (a few stand-in sentences are given).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "prequantized"
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
KINDS = {"gptq_sym": ("auto_gptq", True), "gptq_asym": ("auto_gptq", False), "awq": ("auto_awq", False),
         "ct": ("llm_compressor", False)}


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, CONFIG["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def write(kind: str, dest: Path) -> None:
    import transformers as t
    from auto_round import AutoRound

    fmt, sym = KINDS[kind]
    torch.manual_seed({"gptq_sym": 0, "gptq_asym": 1, "awq": 2, "ct": 3}[kind])
    cfg = t.LlamaConfig(**CONFIG)
    cfg.architectures = ["LlamaForCausalLM"]
    model = t.LlamaForCausalLM(cfg).eval()
    text = [" ".join(f"w{i}" for i in range(3 + j, 40 + j)) for j in range(4)]
    with tempfile.TemporaryDirectory() as tmp:
        ar = AutoRound(model, tokenizer(), bits=4, group_size=32, sym=sym, iters=0, disable_opt_rtn=True,
                       device_map="cpu", nsamples=2, seqlen=8, dataset=text)
        ar.quantize_and_save(tmp, format=fmt)
        src = next(p.parent for p in Path(tmp).rglob("config.json"))
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(src, dest)


def reference(kind: str, folder: Path) -> dict:
    """The library's own dequantization of every packed Linear, float64 -> W [N, K]."""
    from safetensors.torch import load_file

    sd = load_file(str(folder / "model.safetensors"))
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    out = {}
    if kind.startswith("gptq"):
        from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

        for name in [k[: -len(".qweight")] for k in sd if k.endswith(".qweight")]:
            k, n = sd[name + ".g_idx"].shape[0], sd[name + ".qweight"].shape[1]
            # without g_idx (its g_idx path slices the output columns by K, wrong where N > K); the
            # writer's g_idx is k // group_size (checked), which the plain path applies
            assert torch.equal(sd[name + ".g_idx"].long(), torch.arange(k) // qc["group_size"])
            lin = QuantLinear(4, qc["group_size"], k, n, False, g_idx=False)
            lin.qweight, lin.qzeros = sd[name + ".qweight"], sd[name + ".qzeros"]
            lin.scales = sd[name + ".scales"].double()
            out[name] = lin(torch.eye(k, dtype=torch.float64)).T.numpy()
    elif kind == "awq":
        from auto_round.export.export_to_awq.utils import dequantize_gemm

        for name in [k[: -len(".qweight")] for k in sd if k.endswith(".qweight")]:
            w = dequantize_gemm(sd[name + ".qweight"], sd[name + ".qzeros"], sd[name + ".scales"].double(), 4,
                                qc["group_size"])
            out[name] = w.T.numpy()
    else:
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationScheme

        group = next(iter(qc["config_groups"].values()))
        scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
        for name in [k[: -len(".weight_packed")] for k in sd if k.endswith(".weight_packed")]:
            local = {k[len(name) + 1:]: v for k, v in sd.items() if k.startswith(name + ".")}
            local["weight_scale"] = local["weight_scale"].double()
            out[name] = PackedQuantizationCompressor.decompress(local, scheme)["weight"].double().numpy()
    return out


def main() -> int:
    ROOT.mkdir(parents=True, exist_ok=True)
    for kind in sys.argv[1:] or KINDS:
        dest = ROOT / kind
        write(kind, dest)
        ref = reference(kind, dest)
        f32 = {k: v.astype(np.float32) for k, v in ref.items()}
        assert all(np.array_equal(f32[k].astype(np.float64), v) for k, v in ref.items()), "not exact in float32"
        np.savez_compressed(dest / "reference.npz", **f32)
        print(kind, sorted(p.name for p in dest.iterdir()), sum(p.stat().st_size for p in dest.iterdir()), "bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
