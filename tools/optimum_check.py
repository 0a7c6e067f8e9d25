#!/usr/bin/env python3
"""Does optimum's ONNX Runtime pipeline load and run a folder written by `normexport convert
PIPELINE_DIR -o OUT/`? Run it INSIDE the optimum environment (`make optimum-env`: optimum-onnx,
which pins transformers<4.58, so it cannot share .venv); it imports nothing from normexport.

    .venv-optimum/bin/python tools/optimum_check.py OUT PIPELINE_DIR [--steps 4]

OUT is loaded with `optimum.onnxruntime.ORTDiffusionPipeline.from_pretrained(OUT)` exactly as a
user would (no help from this script), PIPELINE_DIR with diffusers' `DiffusionPipeline` (the eager
reference; where transformers 5 saved it, its tokenizers are loaded with a fast class and its text
encoders' weights under transformers 4's names, see `_eager`). Both generate
one prompt, N steps, at the size the folder was exported for (normexport_pipeline.json "side",
else 64), from the same seed; the script prints the max abs difference and the PSNR of the images
(values in [0, 1]) and of the final latents (output_type "latent").

Exit status: 0 the images agree (max abs diff <= --atol and PSNR >= --min-psnr), 1 they differ,
or optimum failed to load or to run OUT (the error's last frame and message printed), 3 optimum's
release has no ORT pipeline for the folder's class (PixArt, DiT, ...): nothing to check.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from pathlib import Path

PROMPT = "a photo of cat"
UNSUPPORTED = 3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder written by `normexport convert PIPELINE_DIR -o OUT/`")
    ap.add_argument("pipeline", type=Path, help="the diffusers pipeline folder OUT was converted from")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", type=int, default=None, help="height = width (default: the folder's exported side)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--io-binding", action="store_true",
                    help="use_io_binding=True (optimum's default on CUDAExecutionProvider; it then infers each "
                         "output's shape from the files' dim names)")
    ap.add_argument("--atol", type=float, default=1e-2, help="largest allowed |image diff| (images in [0, 1])")
    ap.add_argument("--min-psnr", type=float, default=40.0, help="smallest allowed image PSNR, dB")
    args = ap.parse_args(argv)

    import warnings

    import numpy as np
    import torch
    import diffusers
    import transformers
    import optimum.onnxruntime.modeling_diffusion as md
    from importlib.metadata import version

    warnings.filterwarnings("ignore", category=FutureWarning)  # ConfigMixin's "direct config name access"
    diffusers.utils.logging.set_verbosity_error()  # the safety checker notice, accelerate's absence
    transformers.logging.set_verbosity_error()

    print("versions: " + ", ".join(f"{p} {_version(version, p)}" for p in
                                   ("optimum", "optimum-onnx", "diffusers", "transformers", "onnxruntime", "torch")))
    index = json.loads((args.out / "model_index.json").read_text())
    cls_name = index.get("_class_name")
    if md._get_ort_class(cls_name, throw_error_if_not_exist=False) is None:
        names = sorted({c.auto_model_class.__name__ for c in md.SUPPORTED_ORT_PIPELINES})
        print(f"unsupported: optimum-onnx {_version(version, 'optimum-onnx')} has no ORT pipeline for {cls_name} "
              f"(it has {', '.join(names)})")
        return UNSUPPORTED
    manifest = args.out / "normexport_pipeline.json"
    side = args.size or (json.loads(manifest.read_text()).get("side") if manifest.is_file() else None) or 64

    try:
        ort = md.ORTDiffusionPipeline.from_pretrained(str(args.out), use_io_binding=args.io_binding or None)
    except Exception as e:  # noqa: BLE001 - every failure is the finding
        return _failed("optimum could not load OUT", e)
    print(f"optimum loaded {args.out} as {type(ort).__name__}" + (" (io binding)" if args.io_binding else ""))
    eager = _eager(diffusers, args.pipeline)
    for pipe in (ort, eager):
        pipe.set_progress_bar_config(disable=True)

    results = {}
    for output_type in ("latent", "np"):
        got = {}
        for name, pipe in (("optimum", ort), ("eager", eager)):
            kwargs = dict(prompt=PROMPT, num_inference_steps=args.steps, height=side, width=side,
                          generator=torch.Generator().manual_seed(args.seed), output_type=output_type)
            try:
                with torch.no_grad():
                    out = pipe(**kwargs)
            except Exception as e:  # noqa: BLE001
                if name == "optimum":
                    return _failed(f"optimum's pipeline failed to generate (output_type={output_type})", e)
                raise
            images = out.images if hasattr(out, "images") else out[0]
            got[name] = np.asarray(images.float().numpy() if isinstance(images, torch.Tensor) else images,
                                   dtype=np.float64)
        a, b = got["optimum"], got["eager"]
        if a.shape != b.shape:
            print(f"{output_type}: shapes differ, optimum {a.shape} vs eager {b.shape}")
            return 1
        diff = float(np.abs(a - b).max())
        peak = 1.0 if output_type == "np" else float(np.abs(b).max()) or 1.0
        mse = float(np.mean((a - b) ** 2))
        psnr = math.inf if mse == 0 else 10.0 * math.log10(peak * peak / mse)
        results[output_type] = (diff, psnr)
        what = "image" if output_type == "np" else "latents"
        print(f"{what:<8} {'x'.join(map(str, a.shape)):<14} max abs diff {diff:.3e}  PSNR {psnr:.1f} dB"
              + ("" if output_type == "np" else f" (peak {peak:.3g})"))

    diff, psnr = results["np"]
    ok = diff <= args.atol and psnr >= args.min_psnr
    print(f"{'PASS' if ok else 'FAIL'}: {cls_name} through optimum vs eager, {args.steps} steps {side}x{side}: "
          f"image max abs diff {diff:.3e} (limit {args.atol:g}), PSNR {psnr:.1f} dB (limit {args.min_psnr:g})")
    return 0 if ok else 1


def _eager(diffusers, folder: Path):
    """The eager reference. A tokenizer folder saved by transformers 5 holds only tokenizer.json, which
    transformers 4's slow classes (CLIPTokenizer, T5Tokenizer) cannot read and whose class name
    (TokenizersBackend) transformers 4 lacks: those tokenizers are loaded with a fast class instead."""
    import transformers

    index = json.loads((folder / "model_index.json").read_text())
    extra = {}
    for name, spec in index.items():
        if not (name.startswith("tokenizer") and isinstance(spec, list) and spec[0] == "transformers"):
            continue
        cls = getattr(transformers, spec[1], None)
        try:
            if cls is None:
                raise AttributeError(spec[1])
            cls.from_pretrained(folder / name)
        except Exception:  # noqa: BLE001
            fast = getattr(transformers, spec[1] + "Fast", None) or transformers.PreTrainedTokenizerFast
            extra[name] = fast.from_pretrained(folder / name)
            print(f"eager: {name} ({spec[1]}) loaded as {type(extra[name]).__name__}")
    # diffusers checks a passed component's class against model_index.json: load without the
    # tokenizers, then build the pipeline again with them (its __init__ reads their max lengths)
    pipe = diffusers.DiffusionPipeline.from_pretrained(str(folder), **{name: None for name in extra})
    if extra:
        modules, optional = pipe._get_signature_keys(pipe)
        kwargs = {k: getattr(pipe, k, None) for k in modules}
        kwargs.update({k: pipe.config[k] for k in optional if k in pipe.config})
        pipe = type(pipe)(**{**kwargs, **extra})
    for name, component in pipe.components.items():
        if isinstance(component, transformers.PreTrainedModel):
            _reload_v5_weights(name, component, folder / name)
    return pipe


def _reload_v5_weights(name: str, model, folder: Path) -> None:
    """transformers 5 saves some models' weights without the wrapper's prefix (CLIPTextModel:
    `embeddings.*`, not `text_model.embeddings.*`): transformers 4 then leaves them at their random
    init, with a warning. Load them again under the prefix that names every saved tensor."""
    import torch
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return
    saved = {}
    for f in files:
        saved.update(load_file(f))
    own = model.state_dict()
    if set(saved) <= set(own):
        return
    names = [getattr(model, "base_model_prefix", "")] + [n for n, _ in model.named_children()]
    prefixes = [p + "." for p in names if p]
    for prefix in prefixes:
        mapped = {prefix + k: v for k, v in saved.items()}
        if set(mapped) <= set(own):
            with torch.no_grad():
                model.load_state_dict(mapped, strict=False)
            print(f"eager: {name} weights saved by transformers 5 reloaded under '{prefix}'")
            return
    raise SystemExit(f"eager: {name}: its saved weights do not name this transformers' {type(model).__name__} "
                     f"(e.g. {sorted(set(saved) - set(own))[:3]})")


def _failed(what: str, e: BaseException) -> int:
    frames = traceback.extract_tb(e.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    print(f"FAIL: {what}: {type(e).__name__}: {e}{where}")
    return 1


def _version(version, package: str) -> str:
    try:
        return version(package)
    except Exception:  # noqa: BLE001
        return "-"


if __name__ == "__main__":
    sys.exit(main())
