"""The RMSNorm family by attributes: a module with a 1-D `weight` (or weight None plus a
`dim` / `normalized_shape` / `hidden_size`) and a float `variance_epsilon` / `eps` (HF
LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm, T5LayerNorm, GemmaRMSNorm, diffusers RMSNorm with or
without affine / bias, ...). Two hypotheses: y = x / rms(x) * w and Gemma's y = x / rms(x) *
(1 + w) (the 1 folded into the scale); the one that reproduces the module wins. A LayerNorm or
anything else that merely has weight + eps fails both and is skipped."""

from __future__ import annotations

import torch
from torch import nn

from .. import nn as nenn
from ..numeric import rand
from ._common import Candidate, eps_of

FINAL = False


class RMSNormWithBias(nn.Module):
    """normexport RMSNorm followed by a bias add (diffusers RMSNorm(bias=True))."""

    def __init__(self, norm: nenn.RMSNorm, bias: torch.Tensor):
        super().__init__()
        self.norm = norm
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + self.bias


class UpcastRMSNorm(nn.Module):
    """normexport RMSNorm run in float32 on a float16/bfloat16 input, output cast back.

    Used for Gemma-style (1 + w) norms in half precision: the folded scale 1 + w is kept in
    float32 (rounding it to bf16 would double the error against an fp64 reference compared
    with Gemma's own (x * (1 + w.float())).type_as(x)). ONNX: Cast -> RMSNorm(f32) -> Cast."""

    def __init__(self, norm: nenn.RMSNorm):
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.float()).to(x.dtype)


def recognise(m: nn.Module) -> list[Candidate]:
    """Hypotheses for modules with weight (1-D or None) + variance_epsilon / eps."""
    eps = eps_of(m)
    if eps is None:
        return []
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor):
        if w.dim() != 1 or not w.is_floating_point():
            return []
        hidden = w.shape[0]
    elif w is None and hasattr(m, "weight"):
        size = next((getattr(m, a) for a in ("dim", "normalized_shape", "hidden_size") if hasattr(m, a)), None)
        if isinstance(size, int):
            size = (size,)
        if size is None or len(tuple(size)) != 1:
            return []
        hidden = int(tuple(size)[0])
        if hidden < 1:  # e.g. diffusers RMSNorm(0, eps, elementwise_affine=False) in Mochi's modulated norms
            def no_size():
                raise ValueError(f"no weight and size {hidden}: the normalized size is unknown until it runs; "
                                 "left decomposed for the ONNX rewriter, which sees the shapes")
            return [("RMSNorm", lambda dtype: no_size(), no_size, "RMSNorm by behaviour without a weight")]
    else:
        return []
    bias = getattr(m, "bias", None)
    if bias is not None and not (isinstance(bias, torch.Tensor) and bias.shape == (hidden,)):
        return []

    def inputs():
        return (rand((2, 5, hidden), 2, 0.3),)

    def builder(gemma: bool):
        def build(dtype):
            scale = w.detach().float() if isinstance(w, torch.Tensor) else torch.ones(hidden)
            if gemma:
                scale = 1.0 + scale
            if gemma and bias is None and dtype in (torch.float16, torch.bfloat16):
                return UpcastRMSNorm(nenn.RMSNorm(scale, eps, axis=-1))
            norm = nenn.RMSNorm(scale.to(dtype), eps, axis=-1)
            if bias is not None:
                return RMSNormWithBias(norm, bias.detach().to(dtype))
            return norm
        return build

    cands = [("RMSNorm", builder(False), inputs, "RMSNorm by behaviour: y = x / rms(x) * weight"
              + (" + bias" if bias is not None else ""))]
    if isinstance(w, torch.Tensor):
        cands.append(("RMSNorm", builder(True), inputs,
                      "Gemma-style RMSNorm by behaviour: y = x / rms(x) * (1 + weight), 1 folded into scale"))
    return cands
