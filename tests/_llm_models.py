"""Tiny causal-LM folders of real transformers classes (random weights, save_pretrained) for the
KV-cache tests: grouped-query attention everywhere (fewer KV heads than query heads), Qwen 3's
q/k norms, Gemma 3's sliding window + sandwich norms, Mistral's sliding window, a MoE, Phi-3's packed
projections, OLMo 2's norms after each sublayer."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def config(family: str):
    import transformers as t

    if family == "llama":
        return t.LlamaForCausalLM, t.LlamaConfig(**COMMON)
    if family == "qwen3":
        return t.Qwen3ForCausalLM, t.Qwen3Config(**COMMON, head_dim=8)
    if family == "gemma3":  # layer 0 sliding (window 4 < prompt + 16 tokens), layer 1 global
        return t.Gemma3ForCausalLM, t.Gemma3TextConfig(**COMMON, head_dim=8, sliding_window=4,
                                                       layer_types=["sliding_attention", "full_attention"])
    if family == "mistral":
        return t.MistralForCausalLM, t.MistralConfig(**COMMON, sliding_window=4)
    if family == "phi3":  # q/k/v in one qkv_proj, gate and up in one gate_up_proj, sliced in the forward
        return t.Phi3ForCausalLM, t.Phi3Config(**COMMON, pad_token_id=0)
    if family == "olmo2":  # norms after attention / MLP (before the residual Add), q/k norms over all heads
        return t.Olmo2ForCausalLM, t.Olmo2Config(**COMMON, pad_token_id=0)
    if family == "qwen3_moe":
        return t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(**COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                       moe_intermediate_size=32, decoder_sparse_step=1)
    raise KeyError(family)


def make_folder(family: str, root: Path, seed: int = 0) -> Path:
    """save_pretrained folder of a tiny `family` model with random weights (norm scales random too:
    a Gemma (1 + w) scale of zeros would hide the fold)."""
    cls, cfg = config(family)
    return save_random(cls, cfg, root / family, gemma=family == "gemma3", seed=seed)


def save_random(cls, cfg, out: Path, gemma: bool = False, seed: int = 0) -> Path:
    """`cls(cfg)` with random weights, its norm scales random too (around 1, or around 0 for a Gemma
    (1 + w) scale), saved with save_pretrained at `out`."""
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if gemma else 1.0))
    model.save_pretrained(out)
    return out


def shared_dir(tmp_path_factory, key: str, build) -> Path:
    """A folder made once per test run by `build(folder)` and shared by every test module and both
    pytest-xdist workers (docs/design.md §16: an export several files need is made once per run):
    under the run's common temp folder (the workers' basetemp parent; basetemp itself without
    xdist, so that no run sees another run's folder), under a file lock; a folder left half made
    by a failed build is made again. `build` must write only inside the folder it is given."""
    import fcntl
    import os
    import shutil

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    root = base / "shared"
    root.mkdir(parents=True, exist_ok=True)
    folder, done = root / key, root / f"{key}.done"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                build(folder)
                done.write_text("")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


def genai_generate(folder: Path, ids: list[int], tokens: int) -> list[int]:
    """onnxruntime-genai's greedy generator on the folder as it is (only the length asked for)."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + tokens)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([ids], dtype=np.int32))
    out = []
    while not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out


def own_greedy(model_file: Path, ids: list[int], tokens: int, past: list[torch.Tensor]) -> list[int]:
    """The file's own greedy tokens in onnxruntime, by the quantized verdict's loop (empty caches `past`)."""
    import numpy as np

    from normexport.parity import runners
    from normexport.quantize import verdict

    source = runners._ModelSource(str(model_file))
    runner = runners.runner_for("ort", source)
    try:
        steps = verdict._steps(runner, source.proto, torch.tensor([ids]), tokens, past,
                               lambda k, logits: torch.tensor([[int(np.argmax(logits[0]))]]))
    finally:
        runner.deactivate()
    return [int(np.argmax(l[0])) for l in steps]
