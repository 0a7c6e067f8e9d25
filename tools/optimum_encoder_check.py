#!/usr/bin/env python3
"""Does optimum's ORTModelForFeatureExtraction load and run a folder written by `normexport convert
ENCODER_DIR -o OUT/` as it is? Run it INSIDE the optimum environment (`make optimum-env`; it imports
nothing from normexport):

    .venv-optimum/bin/python tools/optimum_encoder_check.py OUT ENCODER_DIR

OUT is loaded with `ORTModelForFeatureExtraction.from_pretrained(OUT)` and its tokenizer with
`AutoTokenizer.from_pretrained(OUT)`, as a user would; ENCODER_DIR with `AutoModel` in float64 (the
reference). Three sentences of different lengths, padded into one batch; printed: the ONNX inputs,
the max abs difference of last_hidden_state at the unpadded tokens and of the mean-pooled,
L2-normalised embeddings. Exit 0 when the embeddings agree within --atol, else 1.
"""

from __future__ import annotations

import argparse
import sys

SENTENCES = ["A man is eating food.", "normexport exports normalization layers right", "Hi"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("source")
    ap.add_argument("--atol", type=float, default=1e-5)
    args = ap.parse_args(argv)
    import numpy as np
    import torch
    from optimum.onnxruntime import ORTModelForFeatureExtraction
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.out)
    model = ORTModelForFeatureExtraction.from_pretrained(args.out)
    ref = AutoModel.from_pretrained(args.source).eval().double()
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    got = model(**batch).last_hidden_state.detach().numpy().astype(np.float64)
    with torch.no_grad():
        want = ref(**batch).last_hidden_state.numpy()
    mask = batch["attention_mask"].numpy()[..., None].astype(np.float64)

    def embed(h):
        pooled = (h * mask).sum(1) / mask.sum(1)
        return pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)

    hidden_err = float(np.abs((got - want) * mask).max())
    embed_err = float(np.abs(embed(got) - embed(want)).max())
    print(f"optimum ORTModelForFeatureExtraction loaded {args.out}: inputs "
          f"{[i.name for i in model.model.get_inputs()]}, batch {tuple(batch['input_ids'].shape)} "
          f"(padded: {int(mask.size - mask.sum())} tokens)")
    print(f"last_hidden_state max abs diff vs float64 eager (unpadded tokens): {hidden_err:.3g}")
    print(f"embedding max abs diff vs float64 eager: {embed_err:.3g} -> {'PASS' if embed_err <= args.atol else 'FAIL'}")
    return 0 if embed_err <= args.atol else 1


if __name__ == "__main__":
    sys.exit(main())
