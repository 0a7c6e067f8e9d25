"""Norm recognisers for normexport.prepare.swap, one kind per module (the layout of
normexport.rewriter.rules); each has its test in tests/prepare/test_<module>.py.

A module recogniser (MODULE_RECOGNISERS) defines
    recognise(m) -> list[Candidate]   the hypotheses for module `m` (empty: not a candidate);
                                      a Candidate is (op, builder(dtype), inputs_fn(), reason)
    FINAL: bool                       when it recognises `m`, the recognisers after it are not asked
and the replacement module classes its builders make. The driver tries every hypothesis of every
module top-down (a swapped module's children are not visited) and keeps the first that passes the
signature check (normexport.prepare.signature) and the numeric check (normexport.prepare.numeric:
random input, and the inputs captured in an example forward by normexport.prepare.calls).

A block recogniser (BLOCK_RECOGNISERS) defines
    recognise_block(block, name, report) -> set[str]
It runs on every module before the driver visits its children, rewrites the block in place where
its own check passes (reporting each norm it fused or left alone) and returns the children it
handled, which the driver then skips.

standard_norms.skip_reason(m) says why a torch LayerNorm / GroupNorm / BatchNorm / ... is left
alone (`left_alone`); `wrapped_norm`, asked after the recognisers, says it of a weightless wrapper
around one. The recognisers import nothing of the driver (tests/test_import_cycles.py).
"""

from __future__ import annotations

from torch import nn

from . import diffusers_adaln, dit_block, gated_rms, rms_family, standard_norms, torch_rms_norm
from ._common import Candidate, entry

#: tried in this order on every module
MODULE_RECOGNISERS = (
    torch_rms_norm,  # torch.nn.RMSNorm -> RMSNorm (FINAL)
    diffusers_adaln,  # diffusers AdaLayerNormZero / Single / Continuous / SD35 ...ZeroX -> AdaLNZero (FINAL)
    gated_rms,  # (hidden_states, gate) norms, gate before / after, groups -> GatedRMSNorm
    rms_family,  # 1-D weight + eps: x / rms(x) * w, Gemma's * (1 + w) -> RMSNorm (+ bias)
)

#: run on every module before its children, in this order
BLOCK_RECOGNISERS = (
    dit_block,  # modulate(normN(x), shift, scale) in a block's forward -> AdaLNZero (class rebound)
)


def left_alone(m: nn.Module) -> str | None:
    """Why `m` is left alone by design (a standard torch norm), else None."""
    return standard_norms.skip_reason(m)


def wrapped_norm(m: nn.Module) -> str | None:
    """Why `m`, which no recogniser took, is left alone when it only wraps a standard torch norm, else None."""
    return standard_norms.wrapped_reason(m)


def candidates(m: nn.Module) -> list[Candidate]:
    """Every hypothesis the recognisers have for `m`, in registry order."""
    found: list[Candidate] = []
    for rec in MODULE_RECOGNISERS:
        cands = rec.recognise(m)
        found += cands
        if cands and rec.FINAL:
            break
    return found


def recognise_blocks(block: nn.Module, name: str, report: list) -> set[str]:
    """Run the block recognisers on `block`; the names of the children they handled."""
    handled: set[str] = set()
    for rec in BLOCK_RECOGNISERS:
        handled |= rec.recognise_block(block, name, report)
    return handled


__all__ = ["BLOCK_RECOGNISERS", "Candidate", "MODULE_RECOGNISERS", "candidates", "entry", "left_alone",
           "recognise_blocks", "wrapped_norm"]
