"""`normexport demo`: convert and check every bundled reference model, print one table."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from . import io
from .errors import UsageError
from .export import convert_module, op_counts

#: (name, MODEL factory) of the bundled reference models (normexport/models/)
DEMO_MODELS = (
    ("llama", "normexport.models.llama:tiny"),
    ("dit", "normexport.models.dit:tiny"),
    ("bert", "normexport.models.bert:tiny"),
    ("conv_bn", "normexport.models.conv_bn:tiny"),
    ("norm_heavy", "normexport.models.norm_heavy:tiny"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="demo_out", metavar="DIR", help="folder for the ONNX files (default: demo_out)")
    p.add_argument("--target", choices=("trt", "ort", "onnx"), default="trt")


def fused_ops(counts: dict[str, int], sections: dict) -> str:
    parts = [f"{v} {k.split('::')[-1]}" for k, v in sorted(counts.items())
             if k.startswith("normexport::") or k in ("LayerNormalization", "RMSNormalization")]
    folded = sum(1 for e in sections.get("fold_batchnorm", []) if e.get("action") in ("folded", "affine"))
    if folded:
        parts.append(f"{folded} BN folded")
    if counts.get("BatchNormalization"):
        parts.append(f"{counts['BatchNormalization']} BN left")
    return ", ".join(parts) or "-"


def run(args) -> int:
    from .parity import check

    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create --out folder '{out}' ({e.strerror}): choose another folder") from None
    rows, ok = [], True
    for name, factory in DEMO_MODELS:
        mod_name, _, attr = factory.partition(":")
        module = getattr(importlib.import_module(mod_name), attr)().eval()
        inputs = module.example_inputs()
        sections: dict = {}
        model = convert_module(module, inputs, target=args.target, input_names=module.input_names,
                               output_names=module.output_names, dynamic_axes=module.dynamic_axes, report=sections)
        io.check_onnx(model, workdir=out)  # by path, with external data, when over 2 GiB
        result = check(model, module, inputs, dynamic_axes=module.dynamic_axes, command="demo",
                       plain_export=lambda: convert_module(  # docs/design.md §7: the plain export, built on demand
                           module, inputs, target="onnx", input_names=module.input_names,
                           output_names=module.output_names, dynamic_axes=module.dynamic_axes,
                           fold_bn=False, swap_norms=False, rewrite=False))
        path = io.save_onnx(model, out / f"{name}.onnx", flag="--out")
        err = _max_rel_err(result.to_dict())
        rows.append((name, fused_ops(op_counts(model), sections), f"{err:.2e}", "yes" if result.passed else "NO", path.name))
        ok &= result.passed
    header = ("model", "ops fused", "max rel err", "passed", "file")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    print(f"{sum(r[3] == 'yes' for r in rows)}/{len(rows)} models passed parity in onnxruntime; ONNX files in {out}/")
    return 0 if ok else 1


def _max_rel_err(report: dict) -> float:
    """Largest max_rel_err over every backend, output and shape in a check report."""
    errs = []

    def walk(node):
        if isinstance(node, dict):
            if "max_rel_err" in node and node["max_rel_err"] is not None:
                errs.append(float(node["max_rel_err"]))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(report.get("results", report))
    return max(errs) if errs else float("nan")
