"""recognisers/dit_block.py: modulate(normN(x), shift, scale) in a DiT-style block's forward fused
into normexport AdaLNZero (the block's class rebound, its LayerNorms deferred), checked by running
the block; output against the float64 formula y = LayerNorm(x) * (1 + scale) + shift."""

from __future__ import annotations

import copy
import io
import os
import sys

import torch
from torch import nn

from normexport.models.dit import modulate  # module-level, so the blocks below use it like normexport.models.dit
from normexport.prepare.recognisers import dit_block
from normexport.prepare.swap import REL_TOL, prepare, rel_err

sys.path.insert(0, os.path.dirname(__file__))
from _prep import adaln_ref, assert_close64, randn, randomize, swapped, tiny_rows  # noqa: E402

torch.set_grad_enabled(False)


class TinyBlock(nn.Module):
    """The smallest DiT-style block: modulate(norm(x), shift, scale) with shift / scale from c."""

    def __init__(self, hidden=16, eps=1e-3):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=eps)
        self.ada = nn.Linear(hidden, 2 * hidden)

    def forward(self, x, c):
        shift, scale = self.ada(c).chunk(2, dim=1)
        return modulate(self.norm(x), shift, scale)


def test_tiny_block_against_the_formula():
    m = randomize(TinyBlock(eps=1e-3), seed=1)
    report = []
    new = prepare(m, report)
    (e,) = swapped(report, "AdaLNZero")
    assert e["name"] == "norm" and e["kind"] == "LayerNorm" and "block class rebound" in e["reason"]
    assert isinstance(new.norm, dit_block.DeferredLayerNorm) and new.norm.eps == 1e-3
    assert type(new).__name__ == "TinyBlock" and type(new)._normexport_fused == (("modulate",), 1e-3)
    x, c = tiny_rows(randn(3, 5, 16, seed=2)), randn(3, 16, seed=3)
    shift, scale = m.ada(c).chunk(2, dim=1)
    assert_close64(new(x, c), adaln_ref(x, shift, scale, 1e-3))
    assert isinstance(m.norm, nn.LayerNorm) and type(m) is TinyBlock  # input not mutated


def test_is_modulate():
    assert dit_block.is_modulate(modulate, 8)
    assert not dit_block.is_modulate(lambda x, shift, scale: x * scale.unsqueeze(1) + shift.unsqueeze(1), 8)
    assert not dit_block.is_modulate(lambda x, shift: x, 8) and not dit_block.is_modulate(torch.add, 8)


def test_reference_dit_block():
    from normexport.models import dit

    m = dit.tiny()
    report = []
    new = prepare(m, report)
    assert [e["name"] for e in swapped(report, "AdaLNZero")] == ["norm1", "norm2"]
    x = m.example_inputs()
    assert rel_err(new(*x), m(*x)) <= REL_TOL
    assert rel_err(new(*m.example_inputs(3, 5)), m(*m.example_inputs(3, 5))) <= REL_TOL
    assert isinstance(m.norm1, nn.LayerNorm) and type(m) is dit.DiTBlock  # input not mutated
    assert isinstance(new, dit.DiTBlock) and new.input_names == m.input_names
    assert prepare(new) is not new and rel_err(prepare(new)(*x), m(*x)) <= REL_TOL  # idempotent
    # a pickled / deep-copied prepared block still calls the fused op
    buf = io.BytesIO()
    torch.save(new, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is type(new) and rel_err(loaded(*x), m(*x)) <= REL_TOL
    copied = copy.deepcopy(loaded)
    assert type(copied) is type(new) and rel_err(copied(*x), m(*x)) <= REL_TOL
    ep = torch.export.export(copied, x)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.normexport.adaln_zero.default) == 2
    assert torch.ops.aten.layer_norm.default not in targets


def test_dit_block_with_extra_norm_use_is_left_alone():
    from normexport.models import dit

    class LeakyDiT(dit.DiTBlock):  # norm1's output also feeds the residual: fusing would be wrong
        def forward(self, x, c):
            shift, scale, gate, *_ = self.adaLN_modulation(c).chunk(6, dim=1)
            h = self.norm1(x)
            return h + gate.unsqueeze(1) * self.attn(modulate(h, shift, scale))

    m = dit.randomize_(LeakyDiT(), 0).eval()
    report = []
    new = prepare(m, report)
    assert not swapped(report)
    assert any(e["name"] == "norm1" and "changes the output" in e["reason"] for e in report), report
    x = m.example_inputs()
    torch.testing.assert_close(new(*x), m(*x), rtol=0, atol=0)


def test_dit_block_with_a_different_eps_per_norm_is_left_alone_at_torch_level():
    """One fused `modulate` serves every LayerNorm of the block: with a different eps per site the
    block is left to the ONNX rewriter (each node keeps its eps there) and the report says why."""
    from normexport.models import dit

    m = dit.randomize_(dit.DiTBlock(), 0).eval()
    m.norm2.eps = 1e-3
    report = []
    new = prepare(m, report)
    assert not swapped(report, "AdaLNZero")
    assert any(e["name"] == "norm1" and "different eps" in e["reason"] for e in report), report
    x = m.example_inputs()
    torch.testing.assert_close(new(*x), m(*x), rtol=0, atol=0)
