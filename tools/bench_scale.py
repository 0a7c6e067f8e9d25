"""Real sizes (docs/design.md §8): peak RSS and wall time of normexport against the plain torch.onnx export
of the same save_pretrained folder, measured side by side in one run with /usr/bin/time -v.

    python tools/bench_scale.py --preset tinyllama-1.1b [--work DIR] [--out benchmarks/results]
    python tools/bench_scale.py --preset llama3-8b
    python tools/bench_scale.py --preset sd3.5-medium --check --build   (diffusers SD3Transformer2DModel)

For each preset it
1. writes a LLaMA-shaped transformers folder (or an SD3-shaped diffusers one) of random bfloat16 weights (config from the preset,
   tensors made one at a time from the meta model's shapes, written shard by shard as safetensors:
   never the whole model in RAM),
2. runs, each in its own process under /usr/bin/time -v:
   plain     torch.onnx.export(dynamo=True) of the folder's model on input_ids [1, 16], saved with
             external data (ONNXProgram.save(..., external_data=True));
   plain-past (LLaMA) torch.onnx.export of the same model with its KV cache (normexport.llm.CacheLM,
             dynamic batch / sequence / past): the anchor of convert's default KV-cache graph;
   convert   `normexport convert DIR --target trt` (whole-model parity is skipped above 2 GiB and says so);
   check     with --check: `normexport check conv.onnx --reference DIR` (LLaMA at batch 1, 16 tokens; DiT at the
             file's sizes);
   build     with --build: `normexport build conv.onnx` (with the plugin library when one is found);
   rewrite   `normexport rewrite plain.onnx --target trt` (every fusion verified locally);
3. prints a table (weights GiB, peak RSS GiB and x weights, wall s and x plain, RMSNorms fused of
   2 x layers + 1: normexport::RMSNorm + SkipRMSNorm nodes, the residual Add fused into all but the
   first for --target trt, SkipRMSNorm also shown apart) and writes it as JSON under --out with the
   date and the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

PRESETS = {
    # TinyLlama-1.1B: the shapes of the first measurement
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000),
    "llama3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                        num_key_value_heads=8, vocab_size=128256),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256),
    # small, for a quick run of the tool itself (weights ~0.1 GiB)
    "mini": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=32000),
}

#: diffusers SD3Transformer2DModel configs (SD3.5-medium: 24 joint blocks, hidden 1536, dual
#: attention in the first 13, RMSNorm q/k norms)
DIT_PRESETS = {
    "sd3.5-medium": dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                         num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                         pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                         dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
    "sd3-mini": dict(sample_size=32, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=32,
                     num_attention_heads=4, joint_attention_dim=256, caption_projection_dim=128,
                     pooled_projection_dim=64, out_channels=16, pos_embed_max_size=64,
                     dual_attention_layers=(0,), qk_norm="rms_norm"),
}

_PLAIN = r"""
import sys, warnings, logging, torch, transformers
warnings.simplefilter("ignore"); logging.disable(logging.WARNING)
folder, out = sys.argv[1], sys.argv[2]
m = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
m.config.use_cache = False
ids = torch.randint(0, m.config.vocab_size, (1, 16))
prog = torch.onnx.export(m, (ids,), dynamo=True, opset_version=22, verbose=False)
prog.save(out, external_data=True)
"""

#: the anchor of the KV-cache graph (convert's default task for a causal LM): the plain torch.onnx
#: export of the same CacheLM module (cache as flat inputs / outputs, dynamic batch, sequence and
#: past length), without normexport's swaps, rewrites or checks
_PLAIN_PAST = r"""
import sys, warnings, logging, torch, transformers
from normexport.llm import CacheLM
warnings.simplefilter("ignore"); logging.disable(logging.WARNING)
folder, out = sys.argv[1], sys.argv[2]
m = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
lm = CacheLM(m)
prog = torch.onnx.export(lm, lm.example_inputs(), dynamo=True, opset_version=22, verbose=False,
                         input_names=list(lm.input_names), output_names=list(lm.output_names),
                         dynamic_axes=lm.dynamic_axes())
prog.save(out, external_data=True)
"""


_PLAIN_DIT = r"""
import sys, warnings, logging, torch, diffusers
warnings.simplefilter("ignore"); logging.disable(logging.WARNING)
folder, out = sys.argv[1], sys.argv[2]
m = diffusers.SD3Transformer2DModel.from_pretrained(folder, local_files_only=True, torch_dtype=torch.bfloat16).eval()
c = m.config
dt = next(m.parameters()).dtype
args = (torch.randn(1, c.in_channels, 32, 32, dtype=dt), torch.randn(1, 16, c.joint_attention_dim, dtype=dt),
        torch.randn(1, c.pooled_projection_dim, dtype=dt), torch.tensor([500.0], dtype=dt))
prog = torch.onnx.export(m, args, dynamo=True, opset_version=22, verbose=False,
                         input_names=["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"])
prog.save(out, external_data=True)
"""


def _write_random(meta, folder: Path, dtype, index_name: str, weights_prefix: str) -> float:
    """Random tensors of the meta model's shapes, one at a time, in safetensors shards of ~2 GiB
    with their index; returns GiB written. Norm weights near 1, the rest small."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    shard, shard_bytes, index, total, n = {}, 0, {}, 0, 0
    limit = 2 << 30

    def flush():
        nonlocal shard, shard_bytes, n
        if shard:
            n += 1
            name = f"{weights_prefix}-{n:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard, shard_bytes = {}, 0

    for name, p in meta.state_dict().items():
        if "norm" in name and name.endswith("weight") and p.dim() == 1:
            t = (1.0 + 0.1 * torch.randn(p.shape, generator=gen)).to(dtype)
        else:
            t = (torch.randn(p.shape, generator=gen) * 0.02).to(dtype)
        shard[name] = t
        shard_bytes += t.numel() * t.element_size()
        total += t.numel() * t.element_size()
        if shard_bytes >= limit:
            flush()
    flush()
    (folder / index_name).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": index}))
    return total / 2**30


def _dit_meta(fields: dict):
    """The meta-device SD3 model of a preset and its norm counts (every nn.LayerNorm of SD3 is
    modulated -> AdaLNZero, every diffusers RMSNorm -> RMSNorm)."""
    import diffusers
    import torch

    with torch.device("meta"):
        meta = diffusers.SD3Transformer2DModel(**fields)
    return meta, {"AdaLNZero": sum(isinstance(m, torch.nn.LayerNorm) for m in meta.modules()),
                  "RMSNorm": sum(type(m).__name__ == "RMSNorm" for m in meta.modules())}


def make_dit_folder(preset: str | dict, folder: Path, dtype: str = "bfloat16") -> tuple[float, dict[str, int]]:
    """A diffusers SD3Transformer2DModel folder of random weights (tensor by tensor); returns
    (GiB, expected fused counts from the module structure: every nn.LayerNorm of SD3 is modulated
    -> AdaLNZero, every diffusers RMSNorm -> RMSNorm)."""
    import diffusers
    import torch

    fields = DIT_PRESETS[preset] if isinstance(preset, str) else preset
    folder.mkdir(parents=True, exist_ok=True)
    meta, counts = _dit_meta(fields)
    gib = _write_random(meta, folder, getattr(torch, dtype), "diffusion_pytorch_model.safetensors.index.json",
                        "diffusion_pytorch_model")
    meta.save_config(str(folder))
    return gib, counts


def make_folder(preset: str | dict, folder: Path, dtype: str = "bfloat16") -> float:
    """The random-weight folder (tensor by tensor) of a preset name or LlamaConfig fields; returns
    the weights in GiB."""
    import torch
    import transformers

    fields = PRESETS[preset] if isinstance(preset, str) else preset
    cfg = transformers.LlamaConfig(**fields, tie_word_embeddings=False, torch_dtype=dtype,
                                   architectures=["LlamaForCausalLM"])
    folder.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(cfg)
    total = _write_random(meta, folder, getattr(torch, dtype), "model.safetensors.index.json", "model")
    cfg.save_pretrained(str(folder))
    return total


def timed(cmd: list[str], log: Path) -> dict:
    """Run `cmd` under /usr/bin/time -v: exit code, wall seconds, peak RSS GiB, the output tail."""
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    (log).write_text(r.stdout + "\n" + r.stderr)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", r.stderr)
    secs = 0.0
    if wall:
        for part in wall.group(1).split(":"):
            secs = secs * 60 + float(part)
    return {"rc": r.returncode, "wall_s": round(secs, 1), "peak_rss_gib": round(int(rss.group(1)) / 2**20, 2) if rss else None,
            "tail": [ln for ln in (r.stdout + r.stderr).strip().splitlines()
                     if not ln.startswith(("\t", "Command exited", "Command being timed"))][-12:]}


def _remove_onnx(path: Path) -> None:
    for f in (path, path.with_name(path.name + ".data")):
        f.unlink(missing_ok=True)


def fused(onnx_path: Path) -> dict[str, int]:
    """Counts of the fused ops in a file, and of LayerNormalization / ReduceMean left. "RMSNorm" /
    "AdaLNZero": the norms fused, each a normexport::RMSNorm / AdaLNZero node or one with the residual
    Add fused in too (SkipRMSNorm / GatedAdaLNZero, --target trt), those also counted apart."""
    import onnx

    m = onnx.load(str(onnx_path), load_external_data=False)
    ops = [n.op_type for n in m.graph.node]
    n = {k: ops.count(k) for k in ("RMSNorm", "SkipRMSNorm", "AdaLNZero", "GatedAdaLNZero", "LayerNormalization", "ReduceMean")}
    return {**n, "RMSNorm": n["RMSNorm"] + n["SkipRMSNorm"], "AdaLNZero": n["AdaLNZero"] + n["GatedAdaLNZero"]}


def _plugin_lib() -> str | None:
    """libnormexport_plugins.so where `make plugins` or the tests build it."""
    here = Path(__file__).resolve().parents[1]
    for cand in [os.environ.get("NORMEXPORT_PLUGIN_LIB", ""), here / "build/plugins/libnormexport_plugins.so",
                 Path("/tmp/nx_plugins/libnormexport_plugins.so")]:
        if cand and Path(cand).is_file():
            return str(cand)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS) + sorted(DIT_PRESETS), default="tinyllama-1.1b")
    ap.add_argument("--work", default="/tmp/normexport-bench-scale")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "benchmarks" / "results"))
    ap.add_argument("--check", action="store_true", help="also `normexport check` the converted file against the folder")
    ap.add_argument("--build", action="store_true", help="also `normexport build` the converted file (TensorRT; "
                    "with the plugin library when one is found)")
    ap.add_argument("--keep", action="store_true", help="keep the folder and the ONNX files")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"the steps to run, of {','.join(STEPS)} (check and "
                    "build also need --check / --build); a step left out is not in the table")
    ap.add_argument("--reuse-folder", action="store_true", help="keep a folder an earlier --keep run left in --work "
                    "(same preset) instead of writing a new one")
    args = ap.parse_args(argv)
    steps = set(args.steps.split(","))
    if steps - set(STEPS):
        ap.error(f"--steps: unknown {', '.join(sorted(steps - set(STEPS)))}; use {','.join(STEPS)}")
    work = Path(args.work) / args.preset
    folder = work / "folder"
    reuse = args.reuse_folder and (folder / "config.json").exists()
    if reuse:
        for f in work.iterdir():
            if f != folder:
                shutil.rmtree(f) if f.is_dir() else f.unlink()
    else:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    if reuse:
        weights = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**30
        print(f"reusing {folder} ({weights:.2f} GiB)")
    if args.preset in DIT_PRESETS:
        if not reuse:
            weights, expected = make_dit_folder(args.preset, folder)
        else:
            expected = _dit_meta(DIT_PRESETS[args.preset])[1]
        plain_script = _PLAIN_DIT
        check_input = []  # the sizes the file was exported at (its latent and text dims are static)
        what = f"{expected['RMSNorm']} RMSNorms, every LayerNorm modulated"
    else:
        if not reuse:
            weights = make_folder(args.preset, folder)
        expected = {"RMSNorm": 2 * PRESETS[args.preset]["num_hidden_layers"] + 1}
        plain_script = _PLAIN
        check_input = ["--input", "input_ids:1x16:int64"]
        what = f"{expected['RMSNorm']} RMSNorms"
    exe = str(Path(sys.executable).with_name("normexport"))
    rows = {}
    if "plain" in steps:
        rows["plain"] = timed([sys.executable, "-c", plain_script, str(folder), str(work / "plain.onnx")], work / "plain.log")
    if args.preset not in DIT_PRESETS and "plain-past" in steps:  # convert's default for a causal LM is the KV-cache graph: its plain export too
        rows["plain-past"] = timed([sys.executable, "-c", _PLAIN_PAST, str(folder), str(work / "plain_past.onnx")],
                                   work / "plain_past.log")
        _remove_onnx(work / "plain_past.onnx")  # its size only mattered while it ran (disk: 3 copies of 8 B)
    if "convert" in steps:
        rows["convert"] = timed([exe, "convert", str(folder), "--target", "trt", "-o", str(work / "conv.onnx")],
                                work / "convert.log")
    if rows.get("convert", {}).get("rc") == 0:
        rows["convert"]["fused"] = fused(work / "conv.onnx")
        if args.check and "check" in steps:
            rows["check"] = timed([exe, "check", str(work / "conv.onnx"), "--reference", str(folder), *check_input],
                                  work / "check.log")
        if args.build and "build" in steps:
            lib = _plugin_lib()
            rows["build"] = timed([exe, "build", str(work / "conv.onnx"), "-o", str(work / "conv.engine"),
                                   *(["--plugin", lib] if lib else ["--no-plugin"])], work / "build.log")
    if rows.get("plain", {}).get("rc") == 0 and "rewrite" in steps:
        rows["rewrite"] = timed([exe, "rewrite", str(work / "plain.onnx"), "--target", "trt", "-o", str(work / "rw.onnx")],
                                work / "rewrite.log")
        if rows["rewrite"]["rc"] == 0:
            rows["rewrite"]["fused"] = fused(work / "rw.onnx")
    # the anchor of each step: the plain export of the same graph (convert and check of the KV-cache
    # graph against plain-past where it ran; the rest against the plain input -> output export)
    anchor = {k: ("plain-past" if k in ("convert", "check", "build") and rows.get("plain-past", {}).get("rc") == 0
                  else "plain") for k in rows}
    anchor = {k: a if a in rows else k for k, a in anchor.items()}  # a step left out: no ratio
    print(f"{args.preset}: {weights:.2f} GiB of bfloat16 weights, {what}; machine {platform.node()} "
          f"({os.cpu_count()} cores)")
    print(f"{'step':<10} {'rc':>3} {'peak RSS GiB':>13} {'x weights':>10} {'wall s':>8} {'x anchor':>9} {'anchor':<10}  fused (left)")
    for k, r in rows.items():
        x_w = r["peak_rss_gib"] / weights if r["peak_rss_gib"] else float("nan")
        base = rows[anchor[k]]
        x_p = r["wall_s"] / base["wall_s"] if base["wall_s"] and (anchor[k] != k or k == "plain") else float("nan")
        r["anchor"] = anchor[k]
        f = r.get("fused")
        shown = (f"RMSNorm {f['RMSNorm']}/{expected['RMSNorm']} ({f['SkipRMSNorm']} SkipRMSNorm), AdaLNZero "
                 f"{f['AdaLNZero']} ({f['GatedAdaLNZero']} GatedAdaLNZero) (LayerNormalization "
                 f"{f['LayerNormalization']}, ReduceMean {f['ReduceMean']})") if f else "-"
        print(f"{k:<10} {r['rc']:>3} {r['peak_rss_gib'] or 0:>13.2f} {x_w:>10.2f} {r['wall_s']:>8.1f} {x_p:>9.2f} "
              f"{anchor[k]:<10}  {shown}")
        if r["rc"] != 0 or k in ("check", "build"):
            print("   " + "\n   ".join(r["tail"]))
    day = datetime.date.today().isoformat()
    out = Path(args.out) / f"scale_{day}_{args.preset}_{platform.node() or 'host'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    config = DIT_PRESETS.get(args.preset) or PRESETS[args.preset]
    out.write_text(json.dumps({"date": day, "machine": {"node": platform.node(), "cores": os.cpu_count(),
                                                        "platform": platform.platform()},
                               "preset": args.preset, "config": config, "weights_gib": round(weights, 3),
                               "expected": expected, "rows": rows}, indent=2, default=list))
    print(f"wrote {out}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["rc"] == 0 for r in rows.values()) else 1


STEPS = ("plain", "plain-past", "convert", "check", "build", "rewrite")


if __name__ == "__main__":
    raise SystemExit(main())
