"""Diffusion transformers as diffusers writes them (issue 12): every modulated LayerNorm becomes
normexport::AdaLNZero, with normexport's torch-level swaps and by the ONNX rewriter alone.

Tiny SD3Transformer2DModel (two blocks, the second context_pre_only), FluxTransformer2DModel (one
double + one single block), DiTTransformer2DModel and PixArtTransformer2DModel, random weights,
nothing downloaded. The number of modulated LayerNorms comes from the model's structure
(`modulated_layernorms`); the file's output is compared with the model run in float64 (docs/design.md §7
fp32 tolerance).
"""

from __future__ import annotations

import copy
import io
import logging
import os
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import normexport
from normexport import ops
from normexport.export import op_counts
from normexport.rewriter import RewriteReport, rewrite

from _norm_counts import fold

diffusers = pytest.importorskip("diffusers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ADALN = f"{ops.DOMAIN}::AdaLNZero"
#: diffusers modules that modulate their own LayerNorm (`.norm`): swapped in torch by normexport
MODULE_FORMS = ("AdaLayerNormZero", "AdaLayerNormZeroSingle", "AdaLayerNormContinuous")


def modulated_layernorms(model: nn.Module) -> tuple[list[str], list[str]]:
    """(LayerNorms modulated inside a diffusers AdaLayerNorm* module, LayerNorms modulated inline
    in a block's or the model's forward), by name, read from the model's structure (diffusers
    0.4x: attention.py, transformer_sd3.py, transformer_flux.py, dit / pixart transformers)."""
    in_module, inline = [], []
    for name, m in model.named_modules():
        cls = type(m).__name__
        if cls in MODULE_FORMS and isinstance(m.norm, nn.LayerNorm):
            in_module.append(f"{name}.norm")
        elif cls in ("JointTransformerBlock", "FluxTransformerBlock"):
            # norm2(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None], same for the context stream
            inline += [f"{name}.{n}" for n in ("norm2", "norm2_context") if getattr(m, n, None) is not None]
        elif cls == "BasicTransformerBlock" and m.norm_type == "ada_norm_zero":
            inline.append(f"{name}.norm3")  # norm3(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        elif cls == "BasicTransformerBlock" and m.norm_type == "ada_norm_single":
            inline += [f"{name}.norm1", f"{name}.norm2"]  # * (1 + scale) + shift from scale_shift_table
        elif cls in ("DiTTransformer2DModel", "PixArtTransformer2DModel") and isinstance(m.norm_out, nn.LayerNorm):
            inline.append(f"{name}.norm_out" if name else "norm_out")
    return in_module, inline


class Positional(nn.Module):
    """The transformer called with positional tensors (export), returning its sample."""

    def __init__(self, model: nn.Module, keys: list[str]):
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *args):
        return self.model(**dict(zip(self.keys, args)), return_dict=False)[0]


def _randomize(model: nn.Module, seed: int) -> nn.Module:
    """LayerNorm affines (where any) ~ 1 + N(0, 0.3²) / N(0, 0.2²), linear biases N(0, 0.1²),
    scale_shift_table N(0, 0.3²): nothing that hides a dropped `1 +` or a lost affine."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("scale_shift_table"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        for m in model.modules():
            if isinstance(m, nn.LayerNorm) and m.weight is not None:
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                if m.bias is not None:
                    m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
            elif isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()


def _build(which: str):
    g = torch.Generator().manual_seed(7)

    def rn(*shape):
        return torch.randn(shape, generator=g) + 0.1

    torch.manual_seed(0)
    if which == "sd3":
        m = diffusers.SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
            joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
            pos_embed_max_size=16)
        args = (rn(2, 4, 8, 8), rn(2, 6, 32), rn(2, 16), torch.tensor([3.0, 500.0]))
        keys = ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"]
    elif which == "flux":
        m = diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=12, axes_dims_rope=(2, 2, 4))
        args = (rn(2, 8, 8), rn(2, 4, 16), rn(2, 12), torch.tensor([0.3, 0.7]), rn(8, 3), rn(4, 3))
        keys = ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids"]
    elif which == "dit":
        m = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2,
                                            sample_size=8, patch_size=2, num_embeds_ada_norm=10)
        args = (rn(2, 4, 8, 8), torch.tensor([3, 500]), torch.tensor([1, 7]))
        keys = ["hidden_states", "timestep", "class_labels"]
    else:
        m = diffusers.PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                               out_channels=8, num_layers=2, sample_size=8, patch_size=2,
                                               cross_attention_dim=16, caption_channels=12)
        args = (rn(2, 4, 8, 8), rn(2, 5, 12), torch.tensor([3, 500]))
        keys = ["hidden_states", "encoder_hidden_states", "timestep"]
    return Positional(_randomize(m, seed=3), keys), args


#: what each tiny model implies, from its config (checked against modulated_layernorms below)
EXPECTED_BLOCKS = {
    "sd3": ("JointTransformerBlock", 2),
    "flux": ("FluxTransformerBlock", 1),
    "dit": ("BasicTransformerBlock", 2),
    "pixart": ("BasicTransformerBlock", 2),
}


def _convert(module, args, swap: bool):
    report: dict = {}
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = normexport.convert_module(module, args, target="trt", report=report, swap_norms=swap)
    finally:
        logging.disable(logging.NOTSET)
    return model, report


def _applied(report: dict) -> int:
    """AdaLNZero fusions the rewriter applied (rules/adaln*.py)."""
    return sum(r["applied"] for r in report["rewrite"]["rules"] if r["module"].startswith("adaln"))


def _ort(model: onnx.ModelProto, args) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)}
    return sess.run(None, feeds)[0]


def _errors(module, args, got) -> tuple[float, float, float]:
    """(file's max abs err, eager fp32's, docs/design.md §7 fp32 tolerance) against the model in float64."""
    ref64 = copy.deepcopy(module).double()
    with torch.no_grad():
        ref = ref64(*[a.double() if a.is_floating_point() else a for a in args]).numpy()
        eager = module(*args).double().numpy()
    tol = 1e-5 * float(np.abs(ref).max()) + 1e-6
    return float(np.abs(got.astype(np.float64) - ref).max()), float(np.abs(eager - ref).max()), tol


@pytest.fixture(scope="module", params=list(EXPECTED_BLOCKS))
def family(request):
    module, args = _build(request.param)
    return request.param, module, args


def test_structure_implies_the_counts(family):
    """Every LayerNorm of these models is modulated, and the structure gives how many."""
    which, module, _ = family
    in_module, inline = modulated_layernorms(module)
    all_ln = sorted(n for n, m in module.named_modules() if isinstance(m, nn.LayerNorm))
    assert sorted(in_module + inline) == all_ln
    cls, n_blocks = EXPECTED_BLOCKS[which]
    assert sum(type(m).__name__ == cls for m in module.modules()) == n_blocks
    if which == "sd3":  # the second block is context_pre_only: AdaLayerNormContinuous, no norm2_context
        blocks = module.model.transformer_blocks
        assert [b.context_pre_only for b in blocks] == [False, True]
        assert type(blocks[1].norm1_context).__name__ == "AdaLayerNormContinuous" and blocks[1].norm2_context is None
    if which == "flux":
        assert len(module.model.single_transformer_blocks) == 1
    assert len(in_module) + len(inline) >= 5


@pytest.mark.parametrize("swap", [True, False], ids=["swaps", "rewriter_only"])
def test_every_modulated_layernorm_fused(family, swap):
    which, module, args = family
    in_module, inline = modulated_layernorms(module)
    model, report = _convert(module, args, swap)
    counts = fold(op_counts(model))  # a GatedAdaLNZero (the gated residual fused in) counted as its AdaLNZero
    assert counts.get(ADALN, 0) == len(in_module) + len(inline), counts
    assert counts.get("LayerNormalization", 0) == 0, counts
    if report["exporter"]["name"] == "dynamo" and swap:
        # the module forms in torch, the inline ones by the rewriter
        swapped = sorted(e["name"] for e in report["prepare"] if e["action"] == "swapped" and e["op"] == "AdaLNZero")
        assert swapped == sorted(n[: -len(".norm")] for n in in_module), report["prepare"]
        assert _applied(report) == len(inline), report["rewrite"]["rules"]
    else:
        assert _applied(report) == len(in_module) + len(inline), report["rewrite"]["rules"]
    onnx.checker.check_model(model, full_check=True)
    err, eager_err, tol = _errors(module, args, _ort(model, args))
    assert err <= tol, f"{which}: max abs err {err:.3g} > tol {tol:.3g} (eager fp32 {eager_err:.3g})"


def test_torchscript_exporter_file_fuses():
    """A file from another exporter (torch's TorchScript-based one, opset 17, no normexport
    swaps): the rewriter alone fuses every modulated LayerNorm of SD3, AdaLayerNormContinuous
    included, and the result matches the model in float64."""
    module, args = _build("sd3")
    in_module, inline = modulated_layernorms(module)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, f, dynamo=False, opset_version=17)
    plain = onnx.load_from_string(f.getvalue())
    assert op_counts(plain).get("LayerNormalization", 0) == len(in_module) + len(inline)
    report = RewriteReport()
    out = rewrite(plain, target="trt", report=report)
    counts = fold(op_counts(out))  # a GatedAdaLNZero counted as its AdaLNZero
    assert counts.get(ADALN, 0) == len(in_module) + len(inline) and counts.get("LayerNormalization", 0) == 0, counts
    err, eager_err, tol = _errors(module, args, _ort(out, args))
    assert err <= tol, f"max abs err {err:.3g} > tol {tol:.3g} (eager fp32 {eager_err:.3g})"
