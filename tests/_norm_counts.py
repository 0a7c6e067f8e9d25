"""Counting the norm modules a converted file fused (a helper, not tests).

For --target trt the rewriter fuses the residual Add before a norm into it (rules skip_rms_norm_trt,
gated_adaln; on by default, --no-residual-fusion turns them off): such a norm module is then
one normexport::SkipRMSNorm / GatedAdaLNZero node instead of one RMSNorm / AdaLNZero. "Every norm
fused" stays one exact number per norm type: a fused residual node counts as the norm it carries.
Tests about the residual fusion itself count the op types apart (raw counts)."""

from __future__ import annotations

from collections import Counter
from os import PathLike

import onnx

DOMAIN = "normexport"
#: each fused residual op (domain normexport) and the norm op it carries
CARRIES = {"SkipRMSNorm": "RMSNorm", "GatedAdaLNZero": "AdaLNZero"}


def _graph_nodes(model):
    if isinstance(model, (str, PathLike)):
        model = onnx.load(str(model), load_external_data=False)
    return model.graph.node


def norm_ops(model, domain: str | None = None) -> Counter:
    """Op-type counts of `model`'s graph (an onnx.ModelProto or a path), each normexport::SkipRMSNorm
    counted as one RMSNorm and each normexport::GatedAdaLNZero as one AdaLNZero (they have no key of
    their own). `domain`: count only nodes of that domain."""
    out: Counter = Counter()
    for n in _graph_nodes(model):
        if domain is not None and n.domain != domain:
            continue
        out[CARRIES.get(n.op_type, n.op_type) if n.domain == DOMAIN else n.op_type] += 1
    return out


def fold(counts: dict[str, int]) -> dict[str, int]:
    """normexport.export.op_counts()'s {"domain::op": n} the same way: normexport::SkipRMSNorm added to
    normexport::RMSNorm, normexport::GatedAdaLNZero to normexport::AdaLNZero."""
    out: dict[str, int] = {}
    for k, v in counts.items():
        domain, _, op = k.rpartition("::")
        key = f"{DOMAIN}::{CARRIES[op]}" if domain == DOMAIN and op in CARRIES else k
        out[key] = out.get(key, 0) + v
    return out
