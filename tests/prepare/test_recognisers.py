"""normexport/prepare/recognisers/__init__.py: the ordered registry the driver walks (the layout of
rewriter/rules: one recogniser kind per module, each with its test here), the FINAL rule, and the
recognisers importing nothing of the driver."""

from __future__ import annotations

import ast
from pathlib import Path

from torch import nn

from normexport.prepare import recognisers

PKG = Path(recognisers.__file__).resolve().parent
HERE = Path(__file__).resolve().parent


def _name(mod) -> str:
    return mod.__name__.rsplit(".", 1)[-1]


def test_registry_order_and_interface():
    assert [_name(r) for r in recognisers.MODULE_RECOGNISERS] == ["torch_rms_norm", "diffusers_adaln", "gated_rms",
                                                                  "rms_family"]
    assert [_name(r) for r in recognisers.BLOCK_RECOGNISERS] == ["dit_block"]
    for rec in recognisers.MODULE_RECOGNISERS:
        assert callable(rec.recognise) and isinstance(rec.FINAL, bool), rec
        assert rec.recognise(nn.Linear(4, 4)) == []
    for rec in recognisers.BLOCK_RECOGNISERS:
        assert callable(rec.recognise_block) and rec.recognise_block(nn.Linear(4, 4), "", []) == set()


def test_every_recogniser_module_is_registered_and_tested():
    mods = {p.stem for p in PKG.glob("*.py") if not p.stem.startswith("_")}
    registered = {_name(r) for r in recognisers.MODULE_RECOGNISERS + recognisers.BLOCK_RECOGNISERS} | {"standard_norms"}
    assert mods == registered
    missing = [m for m in sorted(mods) if not (HERE / f"test_{m}.py").is_file()]
    assert not missing, missing


def test_final_stops_the_walk():
    """A FINAL recogniser's hypotheses are the only ones tried; the others add up in order."""
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    assert len(recognisers.candidates(nn.RMSNorm(8, eps=1e-6))) == 1  # not also rms_family's 2
    gated = MambaRMSNormGated(8, group_size=8, eps=1e-5)
    cands = recognisers.candidates(gated)
    assert [c[3].split(":")[0] for c in cands] == ["gated RMSNorm by behaviour"] * 2 + [
        "RMSNorm by behaviour", "Gemma-style RMSNorm by behaviour"]
    assert recognisers.candidates(nn.LayerNorm(8)) != [] and recognisers.left_alone(nn.LayerNorm(8))  # left alone first


def test_recognisers_do_not_import_the_driver():
    """The recognisers sit below the driver (swap.py) and the call capture (calls.py, which walks
    the registry): they import neither (tests/test_import_cycles.py checks the whole package)."""
    for p in PKG.glob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom):
                names = [n.module or ""] + [a.name for a in n.names]
                assert not {"swap", "calls"} & {x.rsplit(".", 1)[-1] for x in names}, (p.name, names)
