"""diffusers modules that normalise and modulate inside themselves -> normexport AdaLNZero.

`AdaLayerNormZero` becomes `AdaLayerNormZeroNE`, which runs the original embedding / SiLU / Linear
path and calls normexport AdaLNZero for x; the extra outputs (gate_msa, shift_mlp, scale_mlp,
gate_mlp) are unchanged. Likewise `AdaLayerNormZeroSingle` (Flux single blocks),
`AdaLayerNormContinuous` with a LayerNorm (SD3's context stream in a context_pre_only block,
norm_out of SD3 / Flux; its LayerNorm affine, if any, goes into the op) and
`SD35AdaLayerNormZeroX` (two AdaLNZero on the same x). Recognised by class name and attributes
(linear, silu, norm: a 1-D LayerNorm); the check decides. AdaLayerNormContinuous(norm_type=
"rms_norm") is left to the others: its RMSNorm child is swapped instead."""

from __future__ import annotations

import copy

import torch
from torch import nn

from .. import nn as nenn
from ..numeric import gen, rand
from ._common import Candidate

#: a module recognised here is not offered to the recognisers after this one
FINAL = True


class AdaLayerNormZeroNE(nn.Module):
    """diffusers AdaLayerNormZero with its normalise-and-modulate step as normexport AdaLNZero.

    Same signature and outputs: (x_modulated, gate_msa, shift_mlp, scale_mlp, gate_mlp)."""

    def __init__(self, orig: nn.Module, adaln: nenn.AdaLNZero):
        super().__init__()
        self.emb = orig.emb
        self.silu = orig.silu
        self.linear = orig.linear
        self.norm = adaln

    def forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
        if self.emb is not None:
            emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        x = self.norm(x, shift_msa, scale_msa)
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class _SiluLinearAdaLN(nn.Module):
    """The children the modules below keep of the diffusers module they replace (its SiLU and Linear:
    emb -> linear(silu(emb))) and the normexport AdaLNZero that replaces its norm."""

    def __init__(self, orig: nn.Module, adaln: nenn.AdaLNZero):
        super().__init__()
        self.silu = orig.silu
        self.linear = orig.linear
        self.norm = adaln


class AdaLayerNormZeroSingleNE(_SiluLinearAdaLN):
    """diffusers AdaLayerNormZeroSingle (Flux single blocks) with normexport AdaLNZero: same
    signature and outputs (x_modulated, gate_msa)."""

    def forward(self, x, emb=None):
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
        return self.norm(x, shift_msa, scale_msa), gate_msa


class AdaLayerNormContinuousNE(_SiluLinearAdaLN):
    """diffusers AdaLayerNormContinuous with a LayerNorm (SD3 context stream of a
    context_pre_only block, norm_out of SD3 / Flux): norm(x) * (1 + scale)[:, None] +
    shift[:, None] as normexport AdaLNZero (with the LayerNorm's affine when it has one)."""

    def forward(self, x, conditioning_embedding):
        emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
        scale, shift = torch.chunk(emb, 2, dim=1)
        return self.norm(x, shift, scale)


class SD35AdaLayerNormZeroXNE(_SiluLinearAdaLN):
    """diffusers SD35AdaLayerNormZeroX (SD3.5 dual-attention blocks): its one LayerNorm output is
    modulated twice; here two normexport AdaLNZero (the LayerNorm computed in each). Same outputs."""

    def forward(self, hidden_states, emb=None):
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2, gate_msa2 = \
            emb.chunk(9, dim=1)
        x = self.norm(hidden_states, shift_msa, scale_msa)
        x2 = self.norm(hidden_states, shift_msa2, scale_msa2)
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp, x2, gate_msa2


#: diffusers modules whose LayerNorm output is modulated inside the module: class name ->
#: (replacement class, what the report says)
DIFFUSERS_ADALN = {
    "AdaLayerNormZero": (AdaLayerNormZeroNE, "diffusers AdaLayerNormZero: LayerNorm * (1 + scale_msa) + shift_msa fused"),
    "AdaLayerNormZeroSingle": (AdaLayerNormZeroSingleNE,
                               "diffusers AdaLayerNormZeroSingle: LayerNorm * (1 + scale_msa) + shift_msa fused"),
    "AdaLayerNormContinuous": (AdaLayerNormContinuousNE,
                               "diffusers AdaLayerNormContinuous: LayerNorm * (1 + scale)[:, None] + shift[:, None] fused"),
    "SD35AdaLayerNormZeroX": (SD35AdaLayerNormZeroXNE,
                              "diffusers SD35AdaLayerNormZeroX: both modulations of its LayerNorm fused (2 AdaLNZero)"),
}


def recognise(m: nn.Module) -> list[Candidate]:
    kind = DIFFUSERS_ADALN.get(type(m).__name__)
    if kind is None or not all(hasattr(m, a) for a in ("linear", "silu", "norm")):
        return []
    norm = m.norm
    if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1:
        return []  # e.g. AdaLayerNormContinuous(norm_type="rms_norm"): its RMSNorm is swapped instead
    hidden = norm.normalized_shape[0]
    cls, reason = kind

    def build(dtype):
        w = norm.weight.detach().to(dtype) if norm.weight is not None else None
        b = norm.bias.detach().to(dtype) if norm.bias is not None else None
        new = cls(copy.deepcopy(m), nenn.AdaLNZero(hidden, norm.eps, w, b))
        return new.to(dtype)

    def inputs():
        x = rand((2, 5, hidden), 3)
        if cls is not AdaLayerNormZeroNE:
            return (x, rand((2, m.linear.in_features), 4))
        if getattr(m, "emb", None) is None:
            return (x, None, None, None, rand((2, m.linear.in_features), 4))
        n_classes = getattr(getattr(m.emb, "class_embedder", None), "num_classes", 1)
        t = torch.tensor([3.0, 517.0])
        labels = torch.randint(0, max(int(n_classes), 1), (2,), generator=gen(5))
        return (x, t, labels, torch.float32, None)

    return [("AdaLNZero", build, inputs, reason)]
