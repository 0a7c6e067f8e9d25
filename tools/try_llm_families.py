"""Try `normexport convert` with the KV cache on causal-LM families beyond the test suite's.

For each family, a tiny config of the real transformers class (random weights; RMSNorm / LayerNorm
weights random too) is saved with save_pretrained, then `normexport convert DIR` runs in its own
process with the defaults (task text-generation-with-past, target trt, the 16-token generation
check). One line per family: exit code, seconds, the export line and the check's verdict.

    python tools/try_llm_families.py --work /tmp/families [FAMILY ...]
    python tools/try_llm_families.py --auto --work /tmp/auto [FAMILY ...]   # every other *ForCausalLM class

--auto shrinks each class's default config generically (TINY; per-layer type lists cut to where every kind
occurs); a config that stays large, or whose own eager forward fails, is a SETUP FAILED row.
Records: benchmarks/results/llm_families_2026-11-29_vm.txt (the table),
benchmarks/results/llm_families_auto_2026-11-30_vm.txt (--auto: 109 classes converted, 103 PASSED).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def families() -> dict:
    import transformers as t

    return {
        "qwen2": lambda: (t.Qwen2ForCausalLM, t.Qwen2Config(**COMMON)),
        "phi3": lambda: (t.Phi3ForCausalLM, t.Phi3Config(**COMMON, pad_token_id=0)),
        "granite": lambda: (t.GraniteForCausalLM, t.GraniteConfig(**COMMON)),
        "olmo": lambda: (t.OlmoForCausalLM, t.OlmoConfig(**COMMON, pad_token_id=0)),
        "olmo2": lambda: (t.Olmo2ForCausalLM, t.Olmo2Config(**COMMON, pad_token_id=0)),
        "stablelm": lambda: (t.StableLmForCausalLM, t.StableLmConfig(**COMMON)),
        "cohere": lambda: (t.CohereForCausalLM, t.CohereConfig(**COMMON, pad_token_id=0)),
        "gemma2": lambda: (t.Gemma2ForCausalLM, t.Gemma2Config(**COMMON, head_dim=8, sliding_window=4)),
        "glm": lambda: (t.GlmForCausalLM, t.GlmConfig(**COMMON, head_dim=8, pad_token_id=0)),
        "smollm3": lambda: (t.SmolLM3ForCausalLM, t.SmolLM3Config(**COMMON, pad_token_id=0)),
        "starcoder2": lambda: (t.Starcoder2ForCausalLM, t.Starcoder2Config(**COMMON)),
        "phi": lambda: (t.PhiForCausalLM, t.PhiConfig(**COMMON)),
        "gptneox": lambda: (t.GPTNeoXForCausalLM, t.GPTNeoXConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128)),
        "gpt2": lambda: (t.GPT2LMHeadModel, t.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4,
                                                         n_positions=128)),
        "falcon": lambda: (t.FalconForCausalLM, t.FalconConfig(
            vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            new_decoder_architecture=True, num_kv_heads=2)),
        # 2026-11-29 (benchmarks/results/llm_families_2026-11-29_vm.txt)
        "ernie4_5": lambda: (t.Ernie4_5ForCausalLM, t.Ernie4_5Config(**COMMON, head_dim=8, pad_token_id=0)),
        "exaone4": lambda: (t.Exaone4ForCausalLM, t.Exaone4Config(**COMMON, head_dim=8, sliding_window=4,
                                                                   pad_token_id=0)),
        "hunyuan_dense": lambda: (t.HunYuanDenseV1ForCausalLM, t.HunYuanDenseV1Config(**COMMON, head_dim=8,
                                                                                      pad_token_id=0)),
        "seed_oss": lambda: (t.SeedOssForCausalLM, t.SeedOssConfig(**COMMON, head_dim=8, pad_token_id=0)),
        "apertus": lambda: (t.ApertusForCausalLM, t.ApertusConfig(**COMMON, head_dim=8, pad_token_id=0)),
        "arcee": lambda: (t.ArceeForCausalLM, t.ArceeConfig(**COMMON, head_dim=8, pad_token_id=0)),
        "glm4": lambda: (t.Glm4ForCausalLM, t.Glm4Config(**COMMON, head_dim=8, pad_token_id=0)),
        "cohere2": lambda: (t.Cohere2ForCausalLM, t.Cohere2Config(**COMMON, sliding_window=4, pad_token_id=0)),
        "olmo3": lambda: (t.Olmo3ForCausalLM, t.Olmo3Config(**COMMON, sliding_window=4, pad_token_id=0)),
        "helium": lambda: (t.HeliumForCausalLM, t.HeliumConfig(**COMMON, head_dim=8, pad_token_id=0)),
        "nemotron": lambda: (t.NemotronForCausalLM, t.NemotronConfig(**COMMON, head_dim=8, pad_token_id=0)),
        "bitnet": lambda: (t.BitNetForCausalLM, t.BitNetConfig(**COMMON, pad_token_id=0)),
        "gpt_oss": lambda: (t.GptOssForCausalLM, t.GptOssConfig(**COMMON, head_dim=8, num_local_experts=4,
                                                               num_experts_per_tok=2, sliding_window=4, pad_token_id=0)),
        # (takes only its own cache class: refused with --task text-generation named, which converts it)
        "minimax": lambda: (t.MiniMaxForCausalLM, t.MiniMaxConfig(**COMMON, head_dim=8, num_local_experts=4,
                                                                 num_experts_per_tok=2, pad_token_id=0)),
        "deepseek_v3": lambda: (t.DeepseekV3ForCausalLM, t.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4}, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            first_k_dense_replace=1, n_group=1, topk_group=1, pad_token_id=0)),
        "granitemoe": lambda: (t.GraniteMoeForCausalLM, t.GraniteMoeConfig(**COMMON, num_local_experts=4,
                                                                          num_experts_per_tok=2)),
        "qwen2_moe": lambda: (t.Qwen2MoeForCausalLM, t.Qwen2MoeConfig(
            **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
        "mixtral": lambda: (t.MixtralForCausalLM, t.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)),
        "vaultgemma": lambda: (t.VaultGemmaForCausalLM, t.VaultGemmaConfig(**COMMON, head_dim=8, sliding_window=4)),
        "opt": lambda: (t.OPTForCausalLM, t.OPTConfig(
            vocab_size=96, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
            word_embed_proj_dim=32, max_position_embeddings=128)),
    }


#: config keys a tiny model sets, whatever the family calls them (those a config has are set; the rest kept)
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
            num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            n_group=1, topk_group=1, sliding_window=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, n_embd=32, n_layer=2, n_head=4, n_positions=128, d_model=32,
            n_layers=2, n_heads=4, ffn_hidden_size=64, num_layers=2, ffn_dim=64, n_inner=64, max_seq_len=128,
            word_embed_proj_dim=32, num_kv_heads=2, rotary_dim=4, partial_rotary_factor=0.5)


#: parameters a tiny folder may have
MAX_PARAMS = 20_000_000


def auto_families(named: dict) -> dict:
    """Every transformers *ForCausalLM class the table does not name, with its default config shrunk by
    TINY (only the keys the config has; layer-type lists cut to the layer count). Encoder-decoders and
    classes whose config will not shrink are SETUP FAILED rows, not errors."""
    import transformers as t

    seen = set()
    for make in named.values():
        try:
            seen.add(make()[0].__name__)
        except Exception:  # noqa: BLE001
            pass
    out = {}
    for cls_name in sorted(n for n in dir(t) if n.endswith("ForCausalLM") and n not in seen):
        config_class = getattr(getattr(t, cls_name), "config_class", None)  # Gemma3ForCausalLM: Gemma3TextConfig
        if isinstance(config_class, type):
            out[cls_name[:-len("ForCausalLM")].lower()] = \
                (lambda c=cls_name, k=config_class: (getattr(t, c), shrink(k)))
    return out


def shrink(config_cls):
    base = config_cls().to_dict()
    kw = {k: v for k, v in TINY.items() if k in base}
    if "kv_lora_rank" in base and "num_key_value_heads" in kw:  # latent attention: one key / value per head
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
    layers = kw.get("num_hidden_layers", kw.get("num_layers", kw.get("n_layer", 2)))
    lists = {k: v for k, v in base.items() if isinstance(v, list) and len(v) > layers and ("layer" in k or "block" in k)
             and k != "mlp_layer_types" and all(isinstance(x, (str, int)) for x in v)}
    # per-layer lists (layer_types, block types) keep their first layers, as many as it takes for every kind
    # to occur once (a hybrid's first full-attention layer: Qwen3-Next's fourth), at most 8
    for v in lists.values():
        kinds = set(map(str, v))
        layers = max(layers, min(8, next(i + 1 for i in range(len(v)) if set(map(str, v[:i + 1])) == kinds)))
    for k, v in lists.items():
        kw[k] = v[:layers]
    for k in ("num_hidden_layers", "num_layers", "n_layer"):
        if k in kw:
            kw[k] = layers
    return config_cls(**kw)


def make_folder(make, out: Path) -> Path:
    import torch

    cls, cfg = make()
    with torch.device("meta"):  # a config the shrinking left large (BLT's byte patcher) is a row, not an OOM kill
        count = sum(p.numel() for p in cls(cfg).parameters())
    if count > MAX_PARAMS:
        raise ValueError(f"the shrunk config still has {count / 1e6:.0f} M parameters")
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # a config whose own forward fails is not a row about normexport
        model(torch.randint(3, 90, (1, 6)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--auto", action="store_true",
                    help="every other *ForCausalLM class of transformers, its default config shrunk generically")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one convert may take")
    ap.add_argument("families", nargs="*")
    args = ap.parse_args(argv)
    known = families()
    if args.auto:
        known = auto_families(known)
    wanted = args.families or list(known)
    unknown = [f for f in wanted if f not in known]
    if unknown:
        ap.error(f"unknown families {unknown}: choose from {', '.join(known)}")
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in wanted:
        try:
            folder = make_folder(known[name], args.work / name)
        except Exception as e:  # noqa: BLE001 - a config this transformers cannot build is a row, not a crash
            print(f"{name}: SETUP FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            failed += 1
            continue
        t0 = time.monotonic()
        try:
            p = subprocess.run([sys.executable, "-m", "normexport", "convert", str(folder), "-o",
                                str(args.work / f"{name}.onnx")], capture_output=True, text=True, cwd=args.work,
                               timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{name}: TIMEOUT after {args.timeout} s", flush=True)
            failed += 1
            continue
        (args.work / f"{name}.log").write_text(p.stdout + p.stderr)
        lines = (p.stdout + p.stderr).splitlines()
        export = next((ln for ln in lines if ln.startswith("exported ")), "")
        verdict = next((ln for ln in reversed(lines) if ln.startswith(("PASSED", "FAILED", "normexport: "))), "")
        failed += p.returncode != 0
        print(f"{name}: exit {p.returncode}, {time.monotonic() - t0:.0f} s | {export[:150]} | {verdict[:200]}",
              flush=True)
    print(f"{len(wanted) - failed}/{len(wanted)} families converted and passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
