"""The reference models in normexport/models/: build, run, deterministic, torch.export-able with their
dynamic axes, and the exported program runs at a second shape."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.export import Dim

NAMES = ("dit", "llama", "bert", "conv_bn", "norm_heavy")


def _tiny(name):
    return importlib.import_module(f"normexport.models.{name}").tiny()


def dynamic_shapes(model):
    """One Dim per axis index, shared by the inputs that vary on that axis."""
    dims: dict[int, Dim] = {}
    shapes = {}
    for name in model.input_names:
        axes = model.dynamic_axes.get(name, [])
        shapes[name] = {a: dims.setdefault(a, Dim(f"{model.__class__.__name__}_d{a}", min=1, max=4096)) for a in axes} or None
    return shapes


@pytest.mark.parametrize("name", NAMES)
def test_builds_runs_deterministic(name):
    m = _tiny(name)
    assert not m.training
    assert set(m.dynamic_axes) <= set(m.input_names)
    inputs = m.example_inputs()
    assert len(inputs) == len(m.input_names)
    for t in inputs:  # random, not constant: values spread out, not all one number
        assert torch.isfinite(t).all() and t.numel() > 1
        assert t.unique().numel() > 1 and (t.float().std() > 0.1 if t.is_floating_point() else True), t
    with torch.no_grad():
        y = m(*inputs)
        y2 = _tiny(name)(*_tiny(name).example_inputs())
    assert torch.isfinite(y).all() and y.abs().max() > 0
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    for pname, p in m.named_parameters():  # random weights: no constant tensors (all ones, zeros, ...)
        assert p.numel() == 1 or p.unique().numel() > p.numel() // 2, pname
        assert not torch.all(p == 1) and not torch.all(p == 0), pname
    for bname, b in m.named_buffers():  # BN running statistics moved off their 0 / 1 defaults
        if bname.endswith("running_mean"):
            assert not torch.allclose(b, torch.zeros_like(b)) and b.unique().numel() > 1, bname
        elif bname.endswith("running_var"):
            assert not torch.allclose(b, torch.ones_like(b)) and b.unique().numel() > 1, bname


@pytest.mark.parametrize("name", NAMES)
def test_export_dynamic(name):
    m = _tiny(name)
    inputs = m.example_inputs()
    ep = torch.export.export(m, inputs, dynamic_shapes=dynamic_shapes(m))
    seq = None if name == "conv_bn" else 5
    other = m.example_inputs(batch=3, seq=seq)
    assert [t.shape for t in other] != [t.shape for t in inputs]
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(*other), m(*other), rtol=1e-5, atol=1e-5)


def test_dit_modulation_not_zero():
    m = _tiny("dit")
    lin = m.adaLN_modulation[1]
    assert lin.weight.abs().min() > 0 and lin.bias.abs().max() > 0
    from normexport.models.dit import modulate  # module-level function the prepare pass looks for

    assert callable(modulate)


def test_conv_bn_stats_non_default():
    m = _tiny("conv_bn")
    bns = [mod for mod in m.modules() if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm)]
    assert len(bns) == 4
    for bn in bns:
        assert not torch.allclose(bn.running_mean, torch.zeros_like(bn.running_mean))
        assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
        assert bn.running_var.min() >= 0.5 and bn.running_var.max() <= 2.0
        assert not torch.allclose(bn.weight, torch.ones_like(bn.weight))
        assert bn.bias.abs().max() > 0


def test_norm_heavy_bench_size():
    from normexport.models import norm_heavy

    assert norm_heavy.tiny().example_inputs()[0].shape == (64, 256)
    m = norm_heavy.NormHeavy(4096, 2048)  # bench() without the randomisation cost
    assert m.seq == 4096 and m.hidden == 2048
    assert norm_heavy.bench.__doc__ and "4096" in norm_heavy.bench.__doc__
