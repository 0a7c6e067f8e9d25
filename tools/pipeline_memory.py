"""Peak memory of `normexport convert PIPELINE_DIR -o OUT/` at a real size (issue 40, by hand, not
in CI): a PixArt-α pipeline whose T5 text encoder is T5-XXL-shaped (d_model 4096, d_ff 10240, 64
heads, gated-GELU, 5 layers, vocabulary 32128; random weights) in bfloat16 — 2.2 GB, past the 2 GiB
protobuf limit — beside a tiny transformer and VAE. Peak RSS is read with /usr/bin/time -v and
compared with the largest component's weight bytes.

    .venv/bin/python tools/pipeline_memory.py WORKDIR [--layers 5]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def build(work: Path, layers: int) -> Path:
    import diffusers
    import torch
    import transformers

    from _pipelines import vae, word_tokenizer

    folder = work / "pixart_t5xxl"
    if (folder / "model_index.json").is_file():
        return folder
    torch.manual_seed(0)
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=layers, num_heads=64,
        feed_forward_proj="gated-gelu", is_gated_act=True)).to(torch.bfloat16).eval()
    transformer = diffusers.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
        patch_size=2, cross_attention_dim=16, caption_channels=4096).to(torch.bfloat16)
    pipe = diffusers.PixArtAlphaPipeline(tokenizer=word_tokenizer(), text_encoder=t5, vae=vae().to(torch.bfloat16),
                                         transformer=transformer, scheduler=diffusers.DDIMScheduler())
    pipe.save_pretrained(folder)
    return folder


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("work", type=Path)
    p.add_argument("--layers", type=int, default=5)
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    folder = build(a.work, a.layers)
    sizes = {c.name: weight_bytes(c) for c in folder.iterdir() if c.is_dir() and weight_bytes(c)}
    out = a.work / "out"
    cmd = ["/usr/bin/time", "-v", str(ROOT / ".venv" / "bin" / "normexport"), "convert", str(folder), "-o", f"{out}/"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) * 1024
    largest = max(sizes.values())
    result = {"components_bytes": sizes, "largest_bytes": largest, "peak_rss_bytes": peak,
              "peak_over_largest": round(peak / largest, 2), "seconds": round(seconds, 1), "exit": proc.returncode,
              "files": {str(f.relative_to(out)): f.stat().st_size for f in out.rglob("*") if f.is_file()}
              if out.is_dir() else {}}
    print(proc.stdout[-4000:])
    print(proc.stderr[-1500:] if proc.returncode else "")
    print(json.dumps(result, indent=1))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
