"""Try `normexport convert FOLDER -o x.onnx` on a denoiser folder alone (issue 46 item 7): every
transformer / unet class of diffusers that a pipeline class takes in its `transformer` / `unet`
slot (the pipeline's `__init__` annotation), made tiny — its `__init__` defaults shrunk by the
parameter's name (layers 1, heads 2, head dims 8, widths 32, RoPE axes rescaled to the head
dim) — random weights, `save_pretrained` to its own folder (no model_index.json beside it), then
`normexport convert FOLDER -o x.onnx` in its own process.

One line per class: the class, the convert's exit code and seconds, and the first line of its
refusal (or PASS / the verdict line).

    python tools/try_denoiser_folders.py --work /tmp/dn [--timeout 180] [CLASS ...]
    python tools/try_denoiser_folders.py --list      # the classes and the pipelines that take them
    python tools/try_denoiser_folders.py --work /tmp/dn --inputs-only --compare --slot transformer --limit 16

First run (diffusers 0.42.1, the 2-vCPU VM; benchmarks/results/denoiser_folders_2026-11-28_vm.txt): of the first 16
never-named transformer classes, 6 resolve their inputs with the stand-ins off, 11 with them on (load/standin.py).
"""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
import time
import typing
import warnings
from pathlib import Path

#: classes the test suite names (tests/_pipelines.py, tests/test_dit_family.py ...): left out unless asked for
NAMED = {"UNet2DConditionModel", "SD3Transformer2DModel", "FluxTransformer2DModel", "PixArtTransformer2DModel",
         "DiTTransformer2DModel", "WanTransformer3DModel", "SanaTransformer2DModel", "AuraFlowTransformer2DModel",
         "Lumina2Transformer2DModel", "HunyuanDiT2DModel", "CogView4Transformer2DModel", "LatteTransformer3DModel",
         "LTXVideoTransformer3DModel", "ZImageTransformer2DModel"}


def denoiser_classes() -> dict[str, list[str]]:
    """{denoiser class name: [pipeline class names taking it in their transformer / unet slot]}."""
    import diffusers

    out: dict[str, list[str]] = {}
    for name in dir(diffusers):
        if not name.endswith("Pipeline"):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cls = getattr(diffusers, name)
            params = inspect.signature(cls.__init__).parameters
        except Exception:  # noqa: BLE001 - a pipeline whose optional backend is missing
            continue
        for slot in ("transformer", "unet"):
            p = params.get(slot)
            if p is None:
                continue
            ann = p.annotation
            for c in ([ann] if isinstance(ann, type) else [a for a in typing.get_args(ann) if isinstance(a, type)]):
                if hasattr(c, "config_name") and hasattr(c, "from_config"):
                    out.setdefault(c.__name__, []).append(name)
                    if slot not in out[c.__name__]:
                        out[c.__name__].append(slot)
    return out


def _shrink_int(name: str, value: int, head_dim: int | None) -> int:
    n = name.lower()
    if value <= 1 or isinstance(value, bool):
        return value
    if "refiner" in n and "layer" in n:
        return 1
    if any(k in n for k in ("num_layers", "depth", "num_blocks", "layers_per_block", "num_single", "num_mmdit",
                            "num_dual", "num_refiner", "num_hidden_layers", "n_layers", "num_transformer")):
        return 1
    if "kv_heads" in n or ("head" in n and ("num" in n or n.endswith("heads"))):
        return 2
    if "head_dim" in n or n == "attention_head_dim" or n.endswith("_head_dim"):
        return head_dim or 8
    if any(k in n for k in ("channels", "patch", "sample_size", "frames", "max", "len", "size_t", "vocab",
                            "num_train", "timestep", "embeds_ada", "class", "scale", "bins", "base", "theta",
                            "freq", "positions", "group", "num_")):
        return value if "sample_size" not in n else min(value, 8)
    if any(k in n for k in ("dim", "hidden", "inner", "width", "features", "size", "embed")) and value >= 64:
        return 32
    return value


def tiny_config(cls) -> dict:
    """The class's __init__ defaults with widths / depths shrunk (tuples of layer counts / widths too)."""
    params = inspect.signature(cls.__init__).parameters
    defaults = {n: p.default for n, p in params.items() if p.default is not p.empty and n != "self"}
    old_head = defaults.get("attention_head_dim")
    head_dim = old_head if isinstance(old_head, int) and not isinstance(old_head, bool) and old_head > 0 else 8
    while head_dim % 2 == 0 and head_dim // 2 >= 8:  # halved: what the head is split into (RoPE axes) still divides
        head_dim //= 2
    heads = defaults.get("num_attention_heads")
    rope_head = head_dim
    if not isinstance(old_head, int) and isinstance(defaults.get("hidden_size"), int) and isinstance(heads, int):
        old_head = defaults["hidden_size"] // heads  # no head-dim parameter: the hidden size's share
    old_inner = old_head * heads if isinstance(old_head, int) and isinstance(heads, int) else None
    cfg = {}
    for n, v in defaults.items():
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, int):  # a width equal to the inner dim (heads x head dim) stays equal to it
            new = 2 * head_dim if v == old_inner and "head" not in n else _shrink_int(n, v, head_dim)
            if new != v:
                cfg[n] = new
        elif isinstance(v, (tuple, list)) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            if "rope" in n.lower() or "axes_dim" in n.lower():
                if isinstance(old_head, int) and sum(v) == old_head:  # axes dims summing to the head dim
                    scaled = [max(2, 2 * round(x * rope_head / old_head / 2)) for x in v]
                    scaled[-1] = rope_head - sum(scaled[:-1])
                    if scaled[-1] > 0:
                        cfg[n] = type(v)(scaled)
                continue
            if "block_out_channels" in n or "out_channels" in n and len(v) > 1:
                cfg[n] = type(v)([8 * (i + 1) for i in range(len(v))])
            elif "layers_per_block" in n or "transformer_layers" in n:
                cfg[n] = type(v)([1] * len(v))
            elif "head" in n and "dim" not in n:
                cfg[n] = type(v)([2] * len(v))
            elif "head_dim" in n:
                cfg[n] = type(v)([8] * len(v))
    if "norm_num_groups" in defaults and isinstance(defaults["norm_num_groups"], int):
        cfg["norm_num_groups"] = 4
    return cfg


#: tiny configs written by hand where the shrinking cannot build the class (2026-11-29: a layer list past
#: the shrunk depth, RoPE splits of an odd width, widths that must agree)
BY_HAND = {
    "CosmosTransformer3DModel": dict(num_attention_heads=2, attention_head_dim=16, num_layers=1, text_embed_dim=32,
                                     adaln_lora_dim=8, max_size=(8, 16, 16), crossattn_proj_in_channels=32,
                                     encoder_hidden_states_channels=32),
    "HiDreamImageTransformer2DModel": dict(patch_size=2, in_channels=16, out_channels=16, num_layers=1,
                                           num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                                           caption_channels=[32, 24], text_emb_dim=32, num_routed_experts=2,
                                           num_activated_experts=1, axes_dims_rope=(8, 8), max_resolution=(16, 16),
                                           llama_layers=[0, 1]),
    "WanVACETransformer3DModel": dict(num_attention_heads=2, attention_head_dim=8, text_dim=32, freq_dim=16, ffn_dim=32,
                                      num_layers=2, vace_layers=[0], vace_in_channels=32),
    "Kandinsky5Transformer3DModel": dict(in_visual_dim=4, in_text_dim=32, in_text_dim2=24, time_dim=32, out_visual_dim=4,
                                         model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=1,
                                         axes_dims=(4, 6, 6)),
    # 2026-11-30: the other classes the shrinking could not build
    "Kandinsky6Transformer3DModel": dict(in_visual_dim=4, out_visual_dim=4, in_text_dim=32, in_text_dim2=24, time_dim=32,
                                         model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=1,
                                         axes_dims=(4, 6, 6), in_audio_dim=4, out_audio_dim=4),
    "Kandinsky6SRTransformer3DModel": dict(in_visual_dim=4, out_visual_dim=4, time_dim=32, model_dim=32, ff_dim=64,
                                           num_visual_blocks=1, axes_dims=(4, 6, 6)),
    "LuminaNextDiT2DModel": dict(sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=1,
                                 num_attention_heads=2, num_kv_heads=2, multiple_of=16, cross_attention_dim=24),
    "OmniGenTransformer2DModel": dict(in_channels=4, patch_size=2, hidden_size=32, num_attention_heads=2,
                                      num_key_value_heads=2, intermediate_size=64, num_layers=1, pad_token_id=0,
                                      vocab_size=96, max_position_embeddings=256, original_max_position_embeddings=64,
                                      pos_embed_max_size=16, time_step_dim=32,
                                      rope_scaling={"short_factor": [1.0] * 8, "long_factor": [1.0] * 8}),
    "PRXTransformer2DModel": dict(in_channels=4, patch_size=2, context_in_dim=24, hidden_size=32, mlp_ratio=2.0,
                                  num_heads=2, depth=1, axes_dim=[8, 8]),
    # (the shrinking builds these two, but with widths that disagree: RoPE sections, caption vs cross-attention)
    "Ideogram4Transformer2DModel": dict(in_channels=16, num_layers=1, attention_head_dim=16, num_attention_heads=2,
                                        intermediate_size=64, adaln_dim=32, llm_features_dim=48, mrope_section=(4, 2, 2)),
    "LTX2VideoTransformer3DModel": dict(in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=8,
                                        cross_attention_dim=16, audio_in_channels=16, audio_out_channels=16,
                                        audio_num_attention_heads=2, audio_attention_head_dim=8,
                                        audio_cross_attention_dim=16, num_layers=1, caption_channels=32),
    "EasyAnimateTransformer3DModel": dict(num_attention_heads=2, attention_head_dim=32, in_channels=16,
                                          out_channels=16, patch_size=2, num_layers=1, mmdit_layers=1, time_embed_dim=32,
                                          text_embed_dim=32, sample_width=8, sample_height=8),
}


def build(cls_name: str, folder: Path) -> str:
    """The tiny class saved to folder; returns a one-line description of the config changed."""
    import diffusers
    import torch

    cls = getattr(diffusers, cls_name)
    cfg = BY_HAND.get(cls_name) or tiny_config(cls)
    torch.manual_seed(0)
    model = cls(**cfg).eval()
    with torch.no_grad():  # norm weights off their init, so a lost scale shows in parity
        for m in model.modules():
            w = getattr(m, "weight", None)
            if isinstance(w, torch.nn.Parameter) and w.dim() == 1:
                w.add_(0.1 * torch.randn_like(w))
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    return f"{n / 1e6:.2f} M params"


#: the call convert would export, resolved in its own process; argv: FOLDER on|off
INPUTS_ONLY = r"""
import sys, warnings
warnings.simplefilter("ignore")
from normexport import load
from normexport.errors import UsageError
from normexport.load import standin
if sys.argv[2] == "off":
    def record(*a, **k):
        raise standin.StandInError("switched off")
    standin.record = record
try:
    call = load.call_for(load.load(sys.argv[1]), sys.argv[1])
except UsageError as e:
    print("normexport: error:", e)
    sys.exit(2)
head = getattr(call.loaded, "headline", "") or "derived from the config"
print("PASS inputs", ", ".join(call.names[:8]), "|", head)
"""


def _tail(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    keep = [ln for ln in lines if ln.startswith(("error", "normexport:", "PASS", "FAIL")) or "refused" in ln
            or "cannot make" in ln]
    return (keep[-1] if keep else (lines[-1] if lines else ""))[:300]


def classify(rc: int, text: str) -> str:
    if rc == 0:
        return "PASS"
    if "forward refused the example inputs" in text:
        return "inputs refused"
    if "cannot make example inputs" in text:
        return "no inputs"
    if rc == 124:
        return "timeout"
    return "other"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/denoiser_folders"))
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--all", action="store_true", help="also the classes the tests name")
    ap.add_argument("--no-check", action="store_true", help="pass --no-check to convert")
    ap.add_argument("--inputs-only", action="store_true",
                    help="stop after the call is resolved (load + call_for: the example inputs and their eager forward)")
    ap.add_argument("--off", action="store_true", help="with --inputs-only: the pipeline stand-ins switched off "
                    "(normexport.load.standin.record refuses), i.e. the derived inputs alone as before issue 46 item 7")
    ap.add_argument("--compare", action="store_true", help="each class switched off, then (where that fails) on")
    ap.add_argument("--slot", choices=("transformer", "unet"), help="only the classes a pipeline takes in this slot")
    ap.add_argument("--limit", type=int, help="the first N classes (alphabetical) that build")
    ap.add_argument("classes", nargs="*")
    args = ap.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = denoiser_classes()
    if args.list:
        for k in sorted(found):
            print(k, ", ".join(found[k][:4]))
        return 0
    wanted = args.classes or sorted(k for k in found if (args.all or k not in NAMED)
                                    and (args.slot is None or args.slot in found[k]))
    args.work.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    for name in wanted:
        folder = args.work / name
        try:
            about = build(name, folder)
        except Exception as e:  # noqa: BLE001 - a class the shrinker cannot build is a row
            print(f"{name}: NOT BUILT ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})", flush=True)
            counts["not built"] = counts.get("not built", 0) + 1
            continue
        built = counts.get("built", 0) + 1
        counts["built"] = built
        if args.limit and built > args.limit:
            break
        cmd = [sys.executable, "-m", "normexport", "convert", str(folder), "-o", str(args.work / f"{name}.onnx")]
        if args.no_check:
            cmd.append("--no-check")
        modes = ["off", "on"] if args.compare else ["off" if args.off else "on"]
        row = []
        for mode in modes:
            if args.inputs_only:  # load + call_for, as convert resolves its call (the eager forward included)
                cmd = [sys.executable, "-c", INPUTS_ONLY, str(folder), mode]
            t0 = time.monotonic()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                rc, text = p.returncode, p.stdout + p.stderr
            except subprocess.TimeoutExpired:
                rc, text = 124, f"timed out after {args.timeout:.0f} s"
            (args.work / f"{name}.{mode}.log").write_text(text)
            kind = classify(rc, text)
            counts[f"{mode}: {kind}"] = counts.get(f"{mode}: {kind}", 0) + 1
            row.append(f"{mode + ' ' if args.compare else ''}{kind}, exit {rc}, {time.monotonic() - t0:.0f} s | "
                       f"{_tail(text)}")
            if args.compare and mode == "off" and kind == "PASS":  # the stand-ins are only tried where the derived inputs fail
                counts["on: PASS"] = counts.get("on: PASS", 0) + 1
                row.append("on: the same (derived inputs accepted)")
                break
        print(f"{name} ({about}): " + " || ".join(row), flush=True)
    print("; ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
