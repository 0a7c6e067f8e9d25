"""Helpers shared by the tests of issue 22's families (tiny real classes, random weights)."""

from __future__ import annotations

import json
from collections import Counter

import torch

from _norm_counts import norm_ops


def norm_calls(module, inputs) -> Counter:
    """Normalizations the model's forward runs, from its own norm modules (not from ONNX):
    'rms' (RMSNorm classes), 'ln' (LayerNorm / channels-first LayerNorm classes), 'bn' (BatchNorm)."""
    calls: Counter = Counter()
    handles = []
    for m in module.modules():
        cls = type(m).__name__
        if isinstance(m, torch.nn.RMSNorm) or cls.endswith("RMSNorm"):
            kind = "rms"
        elif isinstance(m, torch.nn.LayerNorm) or cls.endswith("LayerNorm"):
            kind = "ln"
        elif isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            kind = "bn"
        else:
            continue
        handles.append(m.register_forward_hook(lambda *a, kind=kind: calls.update([kind])))
    with torch.no_grad():
        module(*inputs)
    for h in handles:
        h.remove()
    return calls


def ops(path) -> Counter:
    """Op-type counts of the file, a fused residual norm (SkipRMSNorm, GatedAdaLNZero) counted as its norm."""
    return norm_ops(path)


def convert(cli, model, out, *extra):
    """`normexport convert` in-process: (stdout, report, max abs errors of the file vs float64)."""
    report = out.with_suffix(".json")
    code, stdout, err = cli("convert", model, "-o", out, "--report", report, *extra)
    assert code == 0, (stdout, err)
    rep = json.loads(report.read_text())
    rows = [row for per_output in rep["results"]["ort"].values() for row in per_output]
    assert rows and all(row["passed"] for row in rows), rows
    return stdout, rep, [row["max_abs_err"] for row in rows]


def tiny_chroma():
    import diffusers

    torch.manual_seed(0)
    m = diffusers.ChromaTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                           attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                                           axes_dims_rope=(4, 6, 6), approximator_num_channels=8,
                                           approximator_hidden_dim=32, approximator_layers=1)
    _perturb_norms(m)
    return m.eval()


def _perturb_norms(m) -> None:
    """Norm weights away from 1 (random, not the init's ones), BN statistics away from 0 / 1."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
                mod.running_mean.copy_(torch.rand(mod.running_mean.shape, generator=g) - 0.5)
                mod.running_var.copy_(torch.rand(mod.running_var.shape, generator=g) * 1.5 + 0.5)
        for n, p in m.named_parameters():
            if "norm" in n and p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


def save_folders(models: dict, root):
    """{name: (factory, expected shapes)} -> one save_pretrained folder per name under `root` (seeded,
    norm weights perturbed so that a wrong fusion cannot pass by accident)."""
    for name, (make, _) in models.items():
        torch.manual_seed(0)
        m = make()
        _perturb_norms(m)
        m.eval().save_pretrained(root / name)
    return root


def made_shapes(folder, want: dict):
    """(the loaded folder, {input: shape} of its example inputs), after checking `want`'s shapes."""
    import normexport

    loaded = normexport.load(str(folder))
    shapes = {n: tuple(t.shape) for n, t in zip(loaded.input_names, loaded.example_inputs)}
    assert {n: shapes.get(n) for n in want} == want, shapes
    return loaded, shapes
