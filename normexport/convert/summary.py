"""What the export stage says on the terminal (docs/design.md §9): the first line (the exporter rung, the
fused norm ops, the node count), why a lower rung of the ladder wrote the file, the torch-side
steps (implementations switched, complex lowering, norm swaps), the rewriter's fusions and their
local verification, and the notes the loader left."""

from __future__ import annotations

from ..exporter.names import RUNG_SUMMARY
from ..prepare.complex import summary_lines as complex_lines
from ..prepare.implementations import summary_lines as implementation_lines
from ..prepare.swap import summary_lines as swap_lines


def lines(rec, counts: dict[str, int]) -> list[str]:
    args = rec.args
    what = f"{args.model} --module {args.module}" if args.module else args.model
    ex = rec.sections.get("exporter", {})
    out = [f"exported {what} -> {rec.out.name} (target {args.target}, {_rung_text(ex)}): " + _fused_summary(counts)]
    out += _exporter_lines(ex, rec.names, rec.inputs)
    out += _depth_lines(rec.sections.get("depth"), _eager_check(rec))
    out += (implementation_lines(rec.sections.get("implementations") or [])
            + complex_lines(rec.sections.get("prepare") or []) + swap_lines(rec.sections.get("prepare") or []))
    out += _rewrite_lines(rec.rewrite)
    out += [f"  note: {note}" for note in getattr(rec.loaded, "notes", ())]  # e.g. sizes the forward fixes (load)
    return out


def _eager_check(rec) -> str:
    """Where the grown file is checked against eager: the generation check, else (--no-check) the
    attention fusion's local check for a float32 model, else nowhere (said)."""
    import torch

    if not rec.args.no_check:
        return "checked against eager by the generation check below"
    if rec.args.target == "ort" and "attention" not in rec.off and \
            getattr(getattr(rec.module, "layout", None), "dtype", None) == torch.float32:
        return "checked against eager by the attention fusion's local check where the fusion runs (attention line below)"
    return "NOT checked against eager (--no-check)"


def _depth_lines(d: dict | None, check: str = "") -> list[str]:
    """The stack of identical blocks traced shallow and grown (normexport.exporter.depth), or why not."""
    if not d:
        return []
    if d.get("grown"):
        return [f"  depth: {d['stack']} traced {d['traced']} blocks deep, blocks {d['traced']}-{d['blocks'] - 1} "
                f"copied from block {d['traced'] - 1} with their own weights"
                + (f" ({d['traced'] - 1} blocks did not grow: {d['shallow']})" if d.get("shallow") else "") + f"; {check}"]
    return [f"  depth: {d['stack']} exported whole (not grown from a shallow trace: {d['reason']})"]


def _rung_text(ex: dict) -> str:
    """The exporter ladder's rung that wrote the file (docs/design.md §9), for the first output line."""
    rung = ex.get("rung", "dynamic")
    axes = _axes(ex.get("static_axes") or {})
    return RUNG_SUMMARY[rung].format(axes=axes) if rung in RUNG_SUMMARY else f"{ex.get('name')} exporter"


def _exporter_lines(ex: dict, names, inputs) -> list[str]:
    """Why the file came from a lower rung of the exporter ladder, and what it fixes (docs/design.md §9)."""
    lines = []
    tried = ex.get("attempts") or []
    why = "; ".join(f"{a['rung']}" + (f" ({_axes(a['axes'])})" if a.get("axes") else "") + ": "
                    + (a.get("error") or ("parity failed" if a.get("parity") else a.get("skipped", ""))) for a in tried)
    if ex.get("parity_failed"):
        lines.append(f"  no rung of the exporter ladder passed parity ({why}): the first file is shown")
    static = ex.get("static_axes") or {}
    if static:
        axes = _axes(static)
        shapes = ", ".join(f"{n}: {'x'.join(map(str, t.shape))}" for n, t in zip(names, inputs) if n in static)
        lines.append(f"  STATIC SHAPES: no exporter kept the dynamic axes {axes} ({why}): the file is fixed to "
                     f"{shapes}; export one file per size with --input")
    if ex.get("name") == "torchscript":
        lines.append(f"  the dynamo exporter failed ({ex.get('dynamo_error')}): used the TorchScript-based exporter "
                     f"(opset {ex.get('opset')}); the rewriter fused its norms")
    return lines


def _rewrite_lines(rw: dict | None) -> list[str]:
    """What the rewriter did to the export, on the terminal: fusions and their local verification,
    and every fusion it could not verify (never silent; docs/design.md §8)."""
    if not rw:
        return []
    applied = sum(r["applied"] for r in rw["rules"])
    local = rw.get("verification", {}).get("local", {})
    lines = []
    if local.get("checked"):
        lines.append(f"  rewriter: {applied} fusion(s), {local['passed']} of {local['checked']} verified locally against "
                     f"float64 ({local['distinct']} distinct subgraph(s) run"
                     + ("; bfloat16 widened to float32 for onnxruntime" if local.get("widened_bf16") else "") + ")")
    bad = [(x["node"], x["reason"]) for r in rw["rules"] for x in r["rejected"] if x["reason"].startswith("local verification")]
    if bad:
        lines.append(f"  NOT APPLIED: {len(bad)} fusion(s) failed local verification (first: {bad[0][0]}: "
                     f"{bad[0][1].removeprefix('local verification: ')})")
    off: dict[str, list[str]] = {}  # rule modules turned off (--no-residual-fusion, --no-fuse), by reason
    for name, status in rw.get("modules", {}).items():
        if status.startswith("off ("):
            off.setdefault(status.removeprefix("off "), []).append(name)
    lines.extend(f"  note: rewriter rules {', '.join(names)} off {why}" for why, names in off.items())
    return lines


def _fused_summary(counts: dict[str, int]) -> str:
    """The first line's counts: the norm ops (RMSNorm and AdaLNZero always, the fused residual forms
    SkipRMSNorm / GatedAdaLNZero and the standard ones where there are any) and all nodes."""
    keys = ("normexport::RMSNorm", "normexport::SkipRMSNorm", "normexport::AdaLNZero", "normexport::GatedAdaLNZero",
            "LayerNormalization", "RMSNormalization", "BatchNormalization")
    always = ("normexport::RMSNorm", "normexport::AdaLNZero")
    return ", ".join(f"{counts.get(k, 0)} {k}" for k in keys if counts.get(k) or k in always) + f", {sum(counts.values())} nodes"


def _axes(axes: dict) -> str:
    return ", ".join(f"{n}:{','.join(map(str, a))}" for n, a in axes.items())
