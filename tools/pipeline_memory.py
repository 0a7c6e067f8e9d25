"""Peak memory of `normexport convert PIPELINE_DIR -o OUT/` at a real size (issue 40, by hand, not
in CI), beside optimum's export of the same folder where optimum supports the pipeline class.

Two pipelines whose T5 text encoder is T5-XXL-shaped (d_model 4096, d_ff 10240, 64 heads,
gated-GELU, vocabulary 32128, random weights) in bfloat16, 5 layers by default: 2.2 GB, past the
2 GiB protobuf limit; the other components are tiny:
- `--kind pixart`: PixArtAlphaPipeline (optimum-onnx 0.1.0 has no PixArt pipeline: normexport only);
- `--kind sd3`: StableDiffusion3Pipeline with the T5 as text_encoder_3 (optimum exports it with
  `optimum-cli export onnx --task text-to-image --dtype bf16`, run from .venv-optimum: `make
  optimum-env`; with --optimum the folder is saved from that venv, whose transformers 4.57 cannot
  read the tokenizer classes transformers 5 writes, and normexport reads it as any hub folder).
Peak RSS is read with /usr/bin/time -v and compared with the largest component's weight bytes.

    .venv/bin/python tools/pipeline_memory.py WORKDIR [--kind sd3] [--layers 5] [--optimum]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def t5_xxl(layers: int):
    import torch
    import transformers

    return transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=layers, num_heads=64,
        feed_forward_proj="gated-gelu", is_gated_act=True)).to(torch.bfloat16).eval()


def build(work: Path, kind: str, layers: int) -> Path:
    import diffusers
    import torch
    import transformers

    from _pipelines import clip_text, clip_tokenizer, vae, word_tokenizer

    folder = work / f"{kind}_t5xxl"
    if (folder / "model_index.json").is_file():
        return folder
    torch.manual_seed(0)
    if kind == "pixart":
        transformer = diffusers.PixArtTransformer2DModel(
            num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
            patch_size=2, cross_attention_dim=16, caption_channels=4096)
        pipe = diffusers.PixArtAlphaPipeline(tokenizer=word_tokenizer(), text_encoder=t5_xxl(layers), vae=vae(),
                                             transformer=transformer, scheduler=diffusers.DDIMScheduler())
    else:
        transformer = diffusers.SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
            joint_attention_dim=4096, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
            pos_embed_max_size=16)
        clip = transformers.CLIPTextModelWithProjection
        pipe = diffusers.StableDiffusion3Pipeline(
            transformer=transformer, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
            vae=vae(shift_factor=0.1, scaling_factor=0.5),
            text_encoder=clip_text(clip, 16, 8), tokenizer=clip_tokenizer(work / "tok1"),
            text_encoder_2=clip_text(clip, 16, 8), tokenizer_2=clip_tokenizer(work / "tok2"),
            text_encoder_3=t5_xxl(layers), tokenizer_3=word_tokenizer())
    pipe.to(torch.bfloat16).save_pretrained(folder)
    return folder


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def timed(cmd: list[str]) -> dict:
    """Run `cmd` under /usr/bin/time -v: exit status, seconds, peak RSS bytes, output tails."""
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    return {"exit": proc.returncode, "seconds": round(seconds, 1), "peak_rss_bytes": int(m.group(1)) * 1024 if m else None,
            "stdout": proc.stdout[-3000:], "stderr": proc.stderr[-1500:]}


def files(out: Path) -> dict:
    return {str(f.relative_to(out)): f.stat().st_size for f in sorted(out.rglob("*")) if f.is_file()} \
        if out.is_dir() else {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work", type=Path)
    p.add_argument("--kind", choices=["pixart", "sd3"], default="pixart")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--optimum", action="store_true", help="also optimum-cli export onnx of the same folder")
    p.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    opt_python = ROOT / ".venv-optimum" / "bin" / "python"
    if a.optimum and not a.build_only and opt_python.exists():
        subprocess.run([str(opt_python), __file__, str(a.work), "--kind", a.kind, "--layers", str(a.layers),
                        "--build-only"], check=True)
    folder = build(a.work, a.kind, a.layers)
    if a.build_only:
        return 0
    sizes = {c.name: weight_bytes(c) for c in folder.iterdir() if c.is_dir() and weight_bytes(c)}
    largest = max(sizes.values())
    runs = {}
    out = a.work / f"out_{a.kind}"
    shutil.rmtree(out, ignore_errors=True)
    runs["normexport"] = timed([str(ROOT / ".venv" / "bin" / "normexport"), "convert", str(folder), "-o", f"{out}/"])
    runs["normexport"]["files"] = files(out)
    if a.optimum:
        opt = a.work / f"optimum_{a.kind}"
        shutil.rmtree(opt, ignore_errors=True)
        cli = ROOT / ".venv-optimum" / "bin" / "optimum-cli"
        if not cli.exists():
            runs["optimum"] = {"skipped": f"{cli} missing: make optimum-env"}
        else:
            runs["optimum"] = timed([str(cli), "export", "onnx", "--model", str(folder), "--task", "text-to-image",
                                     "--dtype", "bf16", f"{opt}/"])
            runs["optimum"]["files"] = files(opt)
    for name, r in runs.items():
        if r.get("peak_rss_bytes"):
            r["peak_over_largest"] = round(r["peak_rss_bytes"] / largest, 2)
        print(f"== {name}: exit {r.get('exit')}, {r.get('seconds')} s, peak RSS "
              f"{(r.get('peak_rss_bytes') or 0) / 2**30:.2f} GiB = {r.get('peak_over_largest')}x the largest component")
        print(r.get("stdout", "")[-2000:])
        if r.get("exit"):
            print(r.get("stderr", ""))
    result = {"kind": a.kind, "layers": a.layers, "components_bytes": sizes, "largest_bytes": largest,
              "runs": {k: {kk: vv for kk, vv in v.items() if kk not in ("stdout", "stderr")} for k, v in runs.items()}}
    print(json.dumps(result, indent=1))
    return max(r.get("exit", 0) or 0 for r in runs.values())


if __name__ == "__main__":
    sys.exit(main())
