"""Swap recognised normalization modules for normexport modules (DESIGN §1, issue 3).

`prepare(module, report)` deep-copies `module` and replaces, wherever it can prove the swap
preserves behaviour, RMSNorm-like modules with `normexport.prepare.nn.RMSNorm` (gated RMSNorms
with `nn.GatedRMSNorm`: the RMSNorm part as the op, the gate outside) and adaLN-Zero
normalise-and-modulate steps with `normexport.prepare.nn.AdaLNZero`. Those call the
`torch.ops.normexport.*` custom ops, which `torch.onnx.export(..., custom_translation_table=
normexport.ops.TRANSLATION_TABLE)` turns into `normexport::RMSNorm` / `normexport::AdaLNZero`.

Recognition is by behaviour, not by class name alone. A class name or attributes only make a
module a *candidate*; the replacement is then built, both are run in float32 on random input
(float32 copies of the module, whatever its dtype) and the swap is kept only if
max|new - old| / max|old| <= 1e-5. Given the model's example inputs, one forward of the model runs
with hooks on every candidate first (`capture_calls`): per class (and parameter shapes) and call
form (how many positional inputs, which keywords, which are None) the inputs of its first call.
Then a replacement must also take every call form seen (its forward binds them: a module called
as norm(x, gate) is never swapped for a one-input RMSNorm) and match on those inputs; without
example inputs its forward must take as many positional inputs as the module's. Otherwise the
module is left alone (the ONNX rewriter sees its decomposition) and the report says why;
`summary_lines` puts one line per class on the terminal.

Recognisers, tried in order on every module (top-down; a swapped module's children are not
visited):

* ``torch.nn.RMSNorm``: normalized_shape of any rank (axis = -len(normalized_shape)); eps None
  means ``torch.finfo(dtype).eps`` like torch; no affine means a ones scale.
* diffusers ``AdaLayerNormZero``: replaced by `AdaLayerNormZeroNE`, which runs the original
  embedding / SiLU / Linear path and calls normexport AdaLNZero for x; the extra outputs
  (gate_msa, shift_mlp, scale_mlp, gate_mlp) are unchanged. Likewise ``AdaLayerNormZeroSingle``
  (Flux single blocks), ``AdaLayerNormContinuous`` with a LayerNorm (SD3's context stream in a
  context_pre_only block, norm_out of SD3 / Flux; its LayerNorm affine, if any, goes into the
  op) and ``SD35AdaLayerNormZeroX`` (two AdaLNZero on the same x).
* The modulations diffusers writes inline in a block's forward (the norm2 / norm2_context of
  SD3 and Flux blocks, norm3 of BasicTransformerBlock, PixArt's ``scale_shift_table`` norm1 /
  norm2, the norm_out of DiT / PixArt) have no module to swap: their nn.LayerNorm is exported
  as LayerNormalization and the ONNX rewriter (rules/adaln*.py) fuses it with the modulation.
* gated RMSNorm by behaviour (`_gated_rms`): a 1-D weight + eps and a forward of two inputs
  (hidden_states, gate): y = rmsnorm(x * silu(gate)) * w (Mamba2, Zamba2, Bamba, NemotronH) or
  rmsnorm(x) * w * silu(gate) (Qwen3-Next, FalconH1), over the whole last dim or the groups its
  attributes name (group_size / n_groups); the hypothesis that reproduces the module wins.
* the RMSNorm family by attributes: a module with a 1-D ``weight`` (or weight None plus a
  ``dim``/``normalized_shape``/``hidden_size``) and a float ``variance_epsilon`` or ``eps``
  (HF LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm, T5LayerNorm, diffusers RMSNorm with or
  without affine / bias, ...). Two hypotheses are checked: y = norm(x) * w and Gemma's
  y = norm(x) * (1 + w) (the 1 is folded into the scale); the one that reproduces the module
  wins. A LayerNorm or anything else that merely has weight + eps fails both and is skipped.
* DiT-style blocks (see `_dit_block`): a module whose forward calls a module-level function
  that behaves like ``modulate(x, shift, scale) = x * (1 + scale.unsqueeze(1)) +
  shift.unsqueeze(1)`` and which owns LayerNorms without affine used in that forward. Since
  `modulate` is a function and not a module there is no module to swap, and fx tracing is
  fragile around attention and would turn the block into a GraphModule (losing its class and
  attributes). Instead the block's class is swapped for a same-named subclass whose forward
  is the original forward's code object run with a globals mapping in which `modulate` is the
  fused op (`fused_class`; it pickles and deep-copies), and the LayerNorms are replaced by
  `DeferredLayerNorm` (identity; the normalisation happens inside the fused op):
  ``modulate(norm1(x), shift, scale)`` then computes ``AdaLNZero(x, shift, scale)``. This
  is only right if every output of those LayerNorms feeds `modulate` and `modulate` is only
  applied to their outputs; rather than trusting a static analysis, the whole block is run
  before and after on random inputs and the rewrite is reverted unless it matches. (The ONNX
  rewriter also fuses LayerNormalization -> Mul(1 + scale) -> Add(shift) after export, so
  blocks this pass leaves alone are still covered there.)

Anything else whose class name contains "Norm" is reported as skipped with the reason.
"""

from __future__ import annotations

import copy
import inspect
import math
import types
from typing import Any, Callable

import torch
from torch import nn

from . import nn as nenn

#: a swap is kept when max|new - old| / max|old| on random float32 input is at most this
REL_TOL = 1e-5

_STANDARD_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)


# ---- replacement modules -----------------------------------------------------------------------
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


class AdaLayerNormZeroSingleNE(nn.Module):
    """diffusers AdaLayerNormZeroSingle (Flux single blocks) with normexport AdaLNZero: same
    signature and outputs (x_modulated, gate_msa)."""

    def __init__(self, orig: nn.Module, adaln: nenn.AdaLNZero):
        super().__init__()
        self.silu = orig.silu
        self.linear = orig.linear
        self.norm = adaln

    def forward(self, x, emb=None):
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
        return self.norm(x, shift_msa, scale_msa), gate_msa


class AdaLayerNormContinuousNE(nn.Module):
    """diffusers AdaLayerNormContinuous with a LayerNorm (SD3 context stream of a
    context_pre_only block, norm_out of SD3 / Flux): norm(x) * (1 + scale)[:, None] +
    shift[:, None] as normexport AdaLNZero (with the LayerNorm's affine when it has one)."""

    def __init__(self, orig: nn.Module, adaln: nenn.AdaLNZero):
        super().__init__()
        self.silu = orig.silu
        self.linear = orig.linear
        self.norm = adaln

    def forward(self, x, conditioning_embedding):
        emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
        scale, shift = torch.chunk(emb, 2, dim=1)
        return self.norm(x, shift, scale)


class SD35AdaLayerNormZeroXNE(nn.Module):
    """diffusers SD35AdaLayerNormZeroX (SD3.5 dual-attention blocks): its one LayerNorm output is
    modulated twice; here two normexport AdaLNZero (the LayerNorm computed in each). Same outputs."""

    def __init__(self, orig: nn.Module, adaln: nenn.AdaLNZero):
        super().__init__()
        self.silu = orig.silu
        self.linear = orig.linear
        self.norm = adaln

    def forward(self, hidden_states, emb=None):
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2, gate_msa2 = \
            emb.chunk(9, dim=1)
        x = self.norm(hidden_states, shift_msa, scale_msa)
        x2 = self.norm(hidden_states, shift_msa2, scale_msa2)
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp, x2, gate_msa2


class DeferredLayerNorm(nn.Module):
    """Stands in for a LayerNorm (no affine) whose only consumer is a fused `modulate`: returns
    x unchanged; the normalisation runs inside normexport AdaLNZero, called by `modulate`."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.hidden, self.eps = int(hidden), float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, fused into modulate -> normexport AdaLNZero"


_FUSED_CLASSES: dict[tuple, type] = {}


def _fused_forward(fwd: types.FunctionType, names: tuple[str, ...], eps: float) -> types.FunctionType:
    """`fwd`'s code run with globals in which `names` are the fused normexport AdaLNZero op."""

    def fused(x, shift, scale):
        return torch.ops.normexport.adaln_zero(x, shift, scale, None, None, eps)

    glb = dict(fwd.__globals__)
    for g in names:
        glb[g] = fused
    fn = types.FunctionType(fwd.__code__, glb, fwd.__name__, fwd.__defaults__, fwd.__closure__)
    fn.__kwdefaults__ = fwd.__kwdefaults__
    fn.__qualname__ = fwd.__qualname__
    fn.__doc__ = fwd.__doc__
    return fn


def fused_class(base: type, names: tuple[str, ...], eps: float) -> type:
    """A subclass of `base` (same name) whose forward calls normexport AdaLNZero wherever
    `base.forward` calls one of the module-level functions `names`. Instances pickle and
    deep-copy as (base instance, names, eps) and get this class back when loaded."""
    key = (base, tuple(names), float(eps))
    if key not in _FUSED_CLASSES:
        def __reduce_ex__(self, protocol):
            plain = base.__new__(base)
            plain.__dict__ = self.__dict__  # pickled as a plain `base` instance
            return _restore_fused, (plain, tuple(names), float(eps))

        _FUSED_CLASSES[key] = type(base.__name__, (base,), {
            "forward": _fused_forward(base.forward, tuple(names), float(eps)),
            "__reduce_ex__": __reduce_ex__,
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "_normexport_fused": (tuple(names), float(eps)),
        })
    return _FUSED_CLASSES[key]


def _restore_fused(plain: nn.Module, names: tuple[str, ...], eps: float) -> nn.Module:
    plain.__class__ = fused_class(type(plain), names, eps)
    return plain


# ---- numeric check ---------------------------------------------------------------------------
def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(shape, seed: int, offset: float = 0.0) -> torch.Tensor:
    # non-zero mean on purpose: tells mean-subtracting norms from RMS norms apart
    return torch.randn(shape, generator=_gen(seed)) * 1.5 + offset


def _flatten(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flatten(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _flatten(o)]
    return []


def rel_err(new, ref) -> float:
    """max |new - ref| / max |ref| over all tensor outputs (inf on a structure mismatch)."""
    a, b = [t.detach() for t in _flatten(new)], [t.detach() for t in _flatten(ref)]
    if len(a) != len(b) or not b or any(x.shape != y.shape for x, y in zip(a, b)):
        return math.inf
    diff = max(float((x.double() - y.double()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))
    scale = max(float(y.double().abs().max()) if y.numel() else 0.0 for y in b)
    if not math.isfinite(diff):
        return math.inf
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def _compare(new: Callable, old: Callable, inputs: tuple) -> float:
    with torch.no_grad():
        return rel_err(new(*inputs), old(*inputs))


def _eval(module: nn.Module) -> nn.Module:
    try:
        return module.eval()
    except NotImplementedError:  # e.g. ExportedProgram.module() refuses eval()
        return module


def _float32(module: nn.Module) -> nn.Module:
    return _eval(copy.deepcopy(module).float())


def _param_dtype(module: nn.Module) -> torch.dtype:
    for t in list(module.parameters()) + list(module.buffers()):
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def _device(module: nn.Module) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")


# ---- recognisers ------------------------------------------------------------------------------
# A recogniser returns None (not a candidate) or (op, builder, inputs_fn, reason): builder(dtype)
# makes the replacement with parameters in `dtype`; inputs_fn() makes float32 check inputs.
Candidate = tuple[str, Callable[[torch.dtype], nn.Module], Callable[[], tuple], str]


def _torch_rmsnorm(m: nn.Module) -> Candidate | None:
    if not isinstance(m, nn.RMSNorm):
        return None
    shape = tuple(m.normalized_shape)

    def build(dtype):
        eps = m.eps if m.eps is not None else torch.finfo(dtype).eps
        w = m.weight.detach() if m.weight is not None else torch.ones(shape)
        return nenn.RMSNorm(w.to(dtype), eps, axis=-len(shape))

    return "RMSNorm", build, lambda: (_rand((2, 5) + shape, 1, 0.3),), \
        f"torch.nn.RMSNorm over {len(shape)} dim(s)"


def _eps_of(m: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(m, name, None)
        if isinstance(v, (float, int)) and not isinstance(v, bool):
            return float(v)
    return None


def _rms_family(m: nn.Module) -> list[Candidate]:
    """Hypotheses for modules with weight (1-D or None) + variance_epsilon / eps."""
    eps = _eps_of(m)
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
        return (_rand((2, 5, hidden), 2, 0.3),)

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



def _positional_params(fn) -> list[str] | None:
    """Names of fn's positional parameters (None: unreadable, or *args: any number)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _gated_rms(m: nn.Module) -> list[Candidate]:
    """Gated RMSNorm hypotheses for a module with a 1-D weight + eps whose forward takes two
    inputs (hidden_states, gate): the gate before the norm (Mamba2) or after it (norm before
    gate), statistics over the whole last dim or over the groups its attributes name
    (group_size / n_groups / ngroups / num_groups). The replacement computes the gate outside
    and the RMSNorm part with the normexport op (nn.GatedRMSNorm)."""
    eps, w = _eps_of(m), getattr(m, "weight", None)
    params = _positional_params(m.forward)
    if eps is None or not isinstance(w, torch.Tensor) or w.dim() != 1 or not w.is_floating_point() \
            or params is None or len(params) != 2:
        return []
    hidden = w.shape[0]
    groups = [1]
    size = getattr(m, "group_size", None)
    if isinstance(size, int) and size > 0 and hidden % size == 0:
        groups.append(hidden // size)
    for a in ("n_groups", "ngroups", "num_groups"):
        g = getattr(m, a, None)
        if isinstance(g, int) and g > 0 and hidden % g == 0:
            groups.append(g)
    groups = sorted(set(groups), key=groups.index)
    order = [bool(getattr(m, "norm_before_gate", False))]
    order.append(not order[0])

    def inputs():
        return (_rand((2, 5, hidden), 11, 0.3), _rand((2, 5, hidden), 12))

    cands = []
    for before in order:
        for g in groups:
            def build(dtype, g=g, before=before):
                return nenn.GatedRMSNorm(w.detach(), eps, groups=g, norm_before_gate=before)
            form = "RMSNorm(x) * w * silu(gate)" if before else "RMSNorm(x * silu(gate)) * w"
            cands.append(("RMSNorm", build, inputs, f"gated RMSNorm by behaviour: y = {form}"
                          + (f" over {g} groups" if g > 1 else "") + "; RMSNorm fused, the gate outside"))
    return cands


#: diffusers modules whose LayerNorm output is modulated inside the module: class name ->
#: (replacement class, what the report says)
_DIFFUSERS_ADALN = {
    "AdaLayerNormZero": (AdaLayerNormZeroNE, "diffusers AdaLayerNormZero: LayerNorm * (1 + scale_msa) + shift_msa fused"),
    "AdaLayerNormZeroSingle": (AdaLayerNormZeroSingleNE,
                               "diffusers AdaLayerNormZeroSingle: LayerNorm * (1 + scale_msa) + shift_msa fused"),
    "AdaLayerNormContinuous": (AdaLayerNormContinuousNE,
                               "diffusers AdaLayerNormContinuous: LayerNorm * (1 + scale)[:, None] + shift[:, None] fused"),
    "SD35AdaLayerNormZeroX": (SD35AdaLayerNormZeroXNE,
                              "diffusers SD35AdaLayerNormZeroX: both modulations of its LayerNorm fused (2 AdaLNZero)"),
}


def _diffusers_adaln_zero(m: nn.Module) -> Candidate | None:
    kind = _DIFFUSERS_ADALN.get(type(m).__name__)
    if kind is None or not all(hasattr(m, a) for a in ("linear", "silu", "norm")):
        return None
    norm = m.norm
    if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1:
        return None  # e.g. AdaLayerNormContinuous(norm_type="rms_norm"): its RMSNorm is swapped instead
    hidden = norm.normalized_shape[0]
    cls, reason = kind

    def build(dtype):
        w = norm.weight.detach().to(dtype) if norm.weight is not None else None
        b = norm.bias.detach().to(dtype) if norm.bias is not None else None
        new = cls(copy.deepcopy(m), nenn.AdaLNZero(hidden, norm.eps, w, b))
        return new.to(dtype)

    def inputs():
        x = _rand((2, 5, hidden), 3)
        if cls is not AdaLayerNormZeroNE:
            return (x, _rand((2, m.linear.in_features), 4))
        if getattr(m, "emb", None) is None:
            return (x, None, None, None, _rand((2, m.linear.in_features), 4))
        n_classes = getattr(getattr(m.emb, "class_embedder", None), "num_classes", 1)
        t = torch.tensor([3.0, 517.0])
        labels = torch.randint(0, max(int(n_classes), 1), (2,), generator=_gen(5))
        return (x, t, labels, torch.float32, None)

    return "AdaLNZero", build, inputs, reason


def _is_modulate(fn: Any, hidden: int) -> bool:
    """Does `fn(x, shift, scale)` compute x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)?"""
    if not isinstance(fn, types.FunctionType):
        return False
    try:
        if len(inspect.signature(fn).parameters) != 3:
            return False
        x, shift, scale = _rand((2, 3, hidden), 6), _rand((2, hidden), 7), _rand((2, hidden), 8)
        with torch.no_grad():
            got = fn(x, shift, scale)
        want = x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
        return rel_err(got, want) <= REL_TOL
    except Exception:
        return False


def _block_inputs(block: nn.Module, hidden: int) -> tuple | None:
    """float32 inputs for a DiT-style block: its own example_inputs, or (x [B,S,H], c [B,H])."""
    if hasattr(block, "example_inputs"):
        try:
            return tuple(t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                         for t in block.example_inputs())
        except Exception:
            pass
    params = [p for p in inspect.signature(block.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    if len(params) != 2:
        return None
    return (_rand((2, 5, hidden), 9), _rand((2, hidden), 10))


def _dit_block(block: nn.Module, name: str, report: list) -> set[str]:
    """Fuse modulate(normN(x), shift, scale) in a DiT-style block in place; returns the names of
    the children that were deferred (empty when the block was left alone)."""
    fwd = getattr(type(block), "forward", None)
    if not isinstance(fwd, types.FunctionType) or hasattr(type(block), "_normexport_fused"):
        return set()
    code = fwd.__code__
    lns = {n: c for n, c in block.named_children()
           if isinstance(c, nn.LayerNorm) and n in code.co_names}
    if not lns:
        return set()
    plain = {n: c for n, c in lns.items()
             if c.weight is None and c.bias is None and len(c.normalized_shape) == 1}
    hidden = {c.normalized_shape[0] for c in plain.values()}
    mods = [g for g in code.co_names if len(hidden) == 1 and _is_modulate(fwd.__globals__.get(g), next(iter(hidden)))]
    if not mods:
        return set()

    def skip(reason, err=math.nan):
        for n, c in lns.items():
            report.append(_entry(f"{name}.{n}" if name else n, c, "skipped", None, reason, err))
        return set(lns)  # reported; the caller leaves these children alone

    if plain.keys() != lns.keys():
        return skip(f"DiT-style block {type(block).__name__}: its LayerNorms feeding "
                    f"{mods[0]}() must have no affine")
    epss = {c.eps for c in plain.values()}
    if len(epss) != 1:
        return skip(f"DiT-style block {type(block).__name__}: LayerNorms with different eps {sorted(epss)}")
    (hidden,), (eps,) = hidden, epss
    inputs = _block_inputs(block, hidden)
    if inputs is None:
        return skip(f"DiT-style block {type(block).__name__}: cannot make check inputs for its forward")

    ref_block = _float32(block)
    test_block = _float32(block)
    for n in lns:
        setattr(test_block, n, DeferredLayerNorm(hidden, eps))
    test_block.__class__ = fused_class(type(block), tuple(mods), eps)
    try:
        err = _compare(test_block, ref_block, inputs)
    except Exception as e:  # noqa: BLE001
        return skip(f"DiT-style block {type(block).__name__}: fused forward failed: {type(e).__name__}: {e}")
    if not err <= REL_TOL:
        return skip(f"DiT-style block {type(block).__name__}: fusing {mods[0]}(norm(x), ...) changes the "
                    f"output (rel err {err:.3g}); a LayerNorm output is used elsewhere?", err)
    for n, c in lns.items():
        setattr(block, n, DeferredLayerNorm(hidden, eps))
        report.append(_entry(f"{name}.{n}" if name else n, c, "swapped", "AdaLNZero",
                             f"DiT-style block {type(block).__name__}: {mods[0]}({n}(x), shift, scale) fused "
                             f"into normexport AdaLNZero (block class rebound)", err))
    block.__class__ = fused_class(type(block), tuple(mods), eps)
    return set(lns)


# ---- calls seen in a forward of the model (hooks) -----------------------------------------------
#: per module class and parameter shapes: per call pattern (number of positional inputs, keyword
#: names, which are None), the inputs of its first call in the example forward
Calls = dict[tuple, dict[tuple, tuple[tuple, dict]]]


def _capture_key(m: nn.Module) -> tuple:
    return (type(m), tuple(tuple(p.shape) for p in m.parameters()))


def _pattern(args: tuple, kwargs: dict) -> tuple:
    keys = tuple(sorted(kwargs))
    return (len(args), keys, tuple(a is None for a in args), tuple(kwargs[k] is None for k in keys))


def _detached(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_detached(v) for v in x) if not hasattr(x, "_fields") else type(x)(*(_detached(v) for v in x))
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    return x


def _candidates(m: nn.Module) -> list[Candidate]:
    cands: list[Candidate] = [c for c in (_torch_rmsnorm(m), _diffusers_adaln_zero(m)) if c is not None]
    if not cands:
        cands = _gated_rms(m) + _rms_family(m)
    return cands


def capture_calls(module: nn.Module, example_inputs: tuple, report: list | None = None) -> Calls:
    """Run `module(*example_inputs)` once with forward pre-hooks on every swap candidate and keep,
    per class (and parameter shapes) and call pattern, the inputs of the first call."""
    calls: Calls = {}

    def hook(mod, args, kwargs):
        per = calls.setdefault(_capture_key(mod), {})
        pat = _pattern(args, kwargs)
        if pat not in per:
            per[pat] = (_detached(tuple(args)), _detached(dict(kwargs)))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in module.modules()
               if not isinstance(m, _STANDARD_NORMS) or isinstance(m, nn.RMSNorm)
               if _candidates(m)]
    try:
        with torch.no_grad():
            module(*example_inputs)
    except Exception as e:  # noqa: BLE001 - swaps are then checked on random inputs and signatures only
        if report is not None:
            report.append({"name": "", "kind": type(module).__name__, "action": "note", "op": None,
                           "reason": f"the model did not run on the example inputs ({type(e).__name__}: "
                                     f"{str(e).splitlines()[0][:160] if str(e) else ''}): swaps checked on random "
                                     "inputs and forward signatures only", "max_rel_err": math.nan})
        return {}
    finally:
        for h in handles:
            h.remove()
    return calls


def _float32_inputs(x):
    if isinstance(x, torch.Tensor):
        return x.float() if x.is_floating_point() else x
    if isinstance(x, (list, tuple)):
        return type(x)(_float32_inputs(v) for v in x) if not hasattr(x, "_fields") else type(x)(*(_float32_inputs(v) for v in x))
    if isinstance(x, dict):
        return {k: _float32_inputs(v) for k, v in x.items()}
    return x


def _signature_text(fn) -> str:
    try:
        return f"({', '.join(inspect.signature(fn).parameters)})"
    except (TypeError, ValueError):
        return "(...)"


def _call_text(args: tuple, kwargs: dict) -> str:
    parts = ["None" if a is None else ("x".join(map(str, a.shape)) if isinstance(a, torch.Tensor) else type(a).__name__)
             for a in args] + [f"{k}=" + ("None" if v is None else "tensor" if isinstance(v, torch.Tensor) else type(v).__name__)
                               for k, v in kwargs.items()]
    return f"({', '.join(parts)})"


def _signature_problem(m: nn.Module, new: nn.Module, calls: dict | None) -> str | None:
    """Why `new` cannot stand in for `m` at its call sites, or None. With the calls seen in the
    example forward: each must bind to new's forward. Without (the module did not run, or no
    example inputs): new's forward must take as many positional inputs as m's."""
    try:
        sig = inspect.signature(new.forward)
    except (TypeError, ValueError):
        return None
    if calls:
        for args, kwargs in calls.values():
            try:
                sig.bind(*args, **kwargs)
            except TypeError:
                return (f"called as forward{_call_text(args, kwargs)} in the example forward; "
                        f"{type(new).__name__}.forward{_signature_text(new.forward)} cannot take that call")
        return None
    old, cur = _positional_params(m.forward), _positional_params(new.forward)
    if old is not None and cur is not None and len(old) > len(cur):
        return (f"forward{_signature_text(m.forward)} takes {len(old)} inputs, {type(new).__name__}.forward"
                f"{_signature_text(new.forward)} {len(cur)} (not called in an example forward to show which are used)")
    return None


def _check_calls(new: nn.Module, ref: nn.Module, calls: dict) -> tuple[float, str | None]:
    """max rel err of new vs ref over the inputs m received in the example forward (float32)."""
    worst = 0.0
    for args, kwargs in calls.values():
        a, k = _float32_inputs(args), _float32_inputs(kwargs)
        with torch.no_grad():
            err = rel_err(new(*a, **k), ref(*a, **k))
        if not err <= REL_TOL:
            return err, _call_text(args, kwargs)
        worst = max(worst, err)
    return worst, None


# ---- driver ------------------------------------------------------------------------------------
def _entry(name, module, action, op, reason, err) -> dict:
    return {"name": name, "kind": type(module).__name__, "action": action, "op": op,
            "reason": reason, "max_rel_err": float(err)}


def _try_swap(name: str, m: nn.Module, report: list, seen: Calls | None = None) -> nn.Module | None:
    """The replacement for `m` (verified), or None; appends a report entry for candidates and
    for modules named like norms. `seen`: the calls of the example forward (capture_calls)."""
    looks_like_norm = "Norm" in type(m).__name__
    if isinstance(m, _STANDARD_NORMS) and not isinstance(m, nn.RMSNorm):
        if isinstance(m, nn.LayerNorm):
            why = ("nn.LayerNorm is exported as ONNX LayerNormalization (a following "
                   "* (1 + scale) + shift is fused into AdaLNZero by the ONNX rewriter)")
        elif isinstance(m, nn.modules.batchnorm._NormBase):
            why = f"{type(m).__name__} is folded into the preceding conv/linear (fold_bn) or exported as a standard op"
        else:
            why = f"{type(m).__name__} is exported as a standard ONNX op"
        report.append(_entry(name, m, "skipped", None, "standard torch norm, not swapped: " + why, math.nan))
        return None
    cands = _candidates(m)
    if not cands:
        if looks_like_norm and (name or not any(True for _ in m.children())):
            report.append(_entry(name, m, "skipped", None,
                                 "named like a norm but not a recognised RMSNorm / AdaLN-Zero form "
                                 "(no 1-D weight with eps/variance_epsilon)", math.nan))
        return None
    calls = (seen or {}).get(_capture_key(m))
    dtype, device = _param_dtype(m), _device(m)
    ref = _float32(m)
    best, fails = (math.inf, None), []
    for op, build, inputs_fn, reason in cands:
        try:
            new32 = _eval(build(torch.float32))
            problem = _signature_problem(m, new32, calls)
            if problem is not None:
                fails.append(f"{reason}: signature: {problem}")
                continue
            err = _compare(new32, ref, inputs_fn())
            where = "random input"
            if err <= REL_TOL and calls:
                err, bad_call = _check_calls(new32, ref, calls)
                where = f"the inputs it receives in the example forward {bad_call}"
        except Exception as e:  # noqa: BLE001
            fails.append(f"{reason}: check failed ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})")
            continue
        if err <= REL_TOL:
            new = build(dtype).to(device).train(m.training)
            checked = (f"; checked on random input and on its {len(calls)} call form(s) in the example forward"
                       if calls else "")
            report.append(_entry(name, m, "swapped", op, reason + checked, err))
            return new
        fails.append(f"{reason}: rel err {err:.3g} > {REL_TOL:g} on {where}")
        best = min(best, (err, op), key=lambda t: t[0])
    report.append(_entry(name, m, "skipped", None, "behaviour differs from every hypothesis: " + "; ".join(fails),
                         best[0]))
    return None


def _walk(module: nn.Module, prefix: str, report: list, seen: Calls | None = None) -> None:
    skip = _dit_block(module, prefix, report)
    for cname, child in list(module.named_children()):
        if cname in skip:
            continue
        full = f"{prefix}.{cname}" if prefix else cname
        new = _try_swap(full, child, report, seen)
        if new is not None:
            setattr(module, cname, new)
        else:
            _walk(child, full, report, seen)


def structure_copy(module: nn.Module) -> nn.Module:
    """A deep copy of `module`'s module tree that shares its parameters and buffers (DESIGN §8:
    the weights are held once; swaps replace modules in the copy, they never write into tensors)."""
    memo = {id(t): t for t in list(module.parameters()) + list(module.buffers())}
    return copy.deepcopy(module, memo)


def prepare(module: nn.Module, report: list | None = None, example_inputs: tuple | None = None) -> nn.Module:
    """A copy of `module` (its module tree; the weights shared) with recognised norm modules
    swapped for normexport modules.

    A swap is kept only when (1) the replacement's forward takes every call the module gets: with
    `example_inputs`, each call form seen in one forward of the model (forward hooks), else the
    same number of positional inputs; (2) its outputs match (float32, rel err <= 1e-5) on random
    input and, with `example_inputs`, on the inputs the module's class received in that forward.
    Otherwise the module is left to the ONNX rewriter. `report`, when given, receives one dict per
    candidate or norm-named module: {"name", "kind", "action": "swapped"|"skipped", "op":
    "RMSNorm"|"AdaLNZero"|None, "reason", "max_rel_err"} (max_rel_err is NaN where no numeric
    check ran, e.g. for standard torch norms); `summary_lines(report)` is what the terminal shows.
    The input module is not modified."""
    if report is None:
        report = []
    new = structure_copy(module)
    seen = capture_calls(new, tuple(example_inputs), report) if example_inputs is not None else None
    root = _try_swap("", new, report, seen)
    if root is not None:
        new = root
    else:
        _walk(new, "", report, seen)
    return new


def summary_lines(report: list[dict]) -> list[str]:
    """Terminal lines for a prepare report: the swaps per class and op, then one line per class of
    candidates left to the rewriter, with the count and the first reason (standard torch norms,
    exported as standard ops by design, are not listed)."""
    entries = [r for r in report if r.get("action") in ("swapped", "skipped", "note") and "kind" in r and "op" in r
               and "lowering" not in r]  # complex lowering entries: said by prepare.complex
    swapped: dict[tuple, int] = {}
    for r in entries:
        if r["action"] == "swapped":
            swapped[(r["kind"], r["op"])] = swapped.get((r["kind"], r["op"]), 0) + 1
    lines = []
    if swapped:
        lines.append("  swapped: " + ", ".join(f"{n} {k} -> {op}" for (k, op), n in swapped.items()))
    skipped: dict[str, list[dict]] = {}
    for r in entries:
        if r["action"] == "skipped" and not r["reason"].startswith("standard torch norm"):
            skipped.setdefault(r["kind"], []).append(r)
    for kind, rs in skipped.items():
        lines.append(f"  not swapped, left to the rewriter: {len(rs)} {kind}: {rs[0]['reason']}")
    lines += [f"  note: {r['reason']}" for r in entries if r["action"] == "note"]
    return lines


__all__ = ["prepare", "capture_calls", "summary_lines", "structure_copy", "rel_err", "REL_TOL", "AdaLayerNormZeroNE",
           "AdaLayerNormZeroSingleNE", "AdaLayerNormContinuousNE", "SD35AdaLayerNormZeroXNE", "DeferredLayerNorm",
           "fused_class", "RMSNormWithBias", "UpcastRMSNorm"]
