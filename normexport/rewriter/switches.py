"""Which rule modules a rewrite runs: the command line turns modules off (`--no-residual-fusion`,
`--no-fuse MODULE`), recorded in the report with the flag that did it (docs/design.md §2, §5).

`NORMEXPORT_RESIDUAL_FUSION=0` in the environment still turns the residual fusion off for one
release; the reason then says to use the flag instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from normexport.errors import UsageError

from .rules import RULE_MODULES

#: the rule modules that fuse a residual Add into the norm after it (target trt): SkipRMSNorm,
#: GatedAdaLNZero; `--no-residual-fusion` turns them off
RESIDUAL_FUSION = ("skip_rms_norm_trt", "gated_adaln")
FLAG = "--no-residual-fusion"
#: fusions outside the rule modules that --no-fuse also names: `attention` (convert --target ort of an
#: LLM with its KV cache: GroupQueryAttention, exact for unpadded batches only; normexport.llm.attention),
#: `depth` (convert of an LLM with its KV cache: the decoder's identical blocks traced 2 deep and grown;
#: normexport.exporter.depth)
OTHER_FUSIONS = ("attention", "depth")
#: deprecated: the variable that turned the residual fusion off before the flag
ENV = "NORMEXPORT_RESIDUAL_FUSION"


def from_flags(no_residual_fusion: bool = False, no_fuse: Iterable[str] = (), command: str = "convert") -> dict[str, str]:
    """{rule module: the flag that turns it off} for the command-line flags; an unknown module name
    is a usage error naming the modules there are (`rewrite` has no OTHER_FUSIONS: they are convert's)."""
    off = {m: FLAG for m in RESIDUAL_FUSION} if no_residual_fusion else {}
    for spec in no_fuse:
        for name in filter(None, (s.strip() for s in spec.split(","))):
            known = RULE_MODULES + (OTHER_FUSIONS if command == "convert" else ())
            if name in OTHER_FUSIONS and name not in known:
                raise UsageError(f"--no-fuse {name}: {command} makes no {name} fusion (convert --target ort of an "
                                 f"LLM does); use one of {', '.join(known)}")
            if name not in known:
                raise UsageError(f"--no-fuse {name}: no such rule module; use one of {', '.join(known)}")
            off.setdefault(name, f"--no-fuse {name}")
    return off


def resolve(off: Mapping[str, str] | None) -> dict[str, str]:
    """The modules off for one rewrite: `off` (from the flags) plus the residual fusion when the
    deprecated environment variable says 0 (any value but 0 / 1 / empty is refused)."""
    out = dict(off or {})
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise UsageError(f"{ENV}={value!r}: the variable is deprecated; pass {FLAG} to convert / rewrite instead "
                         "(or unset it)")
    if value == "0":
        for m in RESIDUAL_FUSION:
            out.setdefault(m, f"{ENV}=0 in the environment; deprecated, use {FLAG}")
    return out


def residual_fusion(off: Mapping[str, str]) -> bool:
    """Whether the residual fusion runs under `off` (the report's `residual_fusion`)."""
    return not any(m in off for m in RESIDUAL_FUSION)
