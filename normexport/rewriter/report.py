"""What a rewrite did: per rule matched / applied / rejected (with the reason), per module its
status, opset and node counts, the sizes it verified at and the comparison (docs/design.md §5)."""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx

import normexport
from normexport import ops as _ops
from normexport import sizes as _sizes

from . import _verify, switches


@dataclasses.dataclass
class RuleRecord:
    name: str
    module: str
    matched: int = 0
    applied: int = 0
    rejected: list[dict[str, str]] = dataclasses.field(default_factory=list)

    def reject(self, reason: str, where: str = "") -> None:
        self.rejected.append({"reason": reason, "node": where})


@dataclasses.dataclass
class RewriteReport:
    target: str = "trt"
    verify: bool = True
    rules: dict[str, RuleRecord] = dataclasses.field(default_factory=dict)
    modules: dict[str, str] = dataclasses.field(default_factory=dict)
    opset_before: int = 0
    opset_after: int = 0
    nodes_before: int = 0
    nodes_after: int = 0
    inputs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    sizes: str = ""  # where the input sizes came from (normexport.sizes), "" while not run
    verification: list[_verify.Comparison] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    local: Any = None  # the LocalVerifier (local.py) when verification ran: its checks
    whole_model: str = ""  # the whole-model extra: "passed", "differs: ...", "not run: ..."
    norm_nodes: dict[str, int] = dataclasses.field(default_factory=dict)  # in the result (norm_node_counts)
    off: dict[str, str] = dataclasses.field(default_factory=dict)  # rule modules turned off: {module: flag}
    canonical: dict[str, int] = dataclasses.field(default_factory=dict)  # canonical.py: {step: places changed}

    def record(self, rule_name: str, module: str) -> RuleRecord:
        if rule_name not in self.rules:
            self.rules[rule_name] = RuleRecord(rule_name, module)
        return self.rules[rule_name]

    @property
    def applied(self) -> int:
        return sum(r.applied for r in self.rules.values())

    def unverified(self) -> list[dict[str, str]]:
        """The matches not applied because they failed (or could not be given) local verification."""
        return [r for rec in self.rules.values() for r in rec.rejected if r["reason"].startswith("local verification")]

    @property
    def nothing_verifiable(self) -> bool:
        """Fusions matched, none applied, and verification is why (the CLI exits 1)."""
        return self.applied == 0 and bool(self.unverified())

    def fused_ops(self) -> dict[str, int]:
        by_module: dict[str, int] = {}
        for r in self.rules.values():
            by_module[r.module] = by_module.get(r.module, 0) + r.applied
        return by_module

    def to_dict(self) -> dict[str, Any]:
        return {
            "normexport_version": normexport.__version__,
            "command": "rewrite",
            "target": self.target,
            "verify": self.verify,
            "inputs": [{"name": i["name"], "shape": i["shape"], "dtype": i["dtype"]} for i in self.inputs],
            "sizes": self.sizes or "not run (nothing to verify)",
            "opset": {"before": self.opset_before, "after": self.opset_after},
            "nodes": {"before": self.nodes_before, "after": self.nodes_after},
            "norm_nodes": dict(self.norm_nodes),
            "modules": dict(self.modules),
            "canonical": dict(self.canonical),
            # the switches (rewriter/switches.py): what the command line turned off, and the residual fusion
            "fusion_off": dict(self.off),
            "residual_fusion": switches.residual_fusion(self.off),
            "rules": [
                {"name": r.name, "module": r.module, "matched": r.matched, "applied": r.applied,
                 "rejected": list(r.rejected)}
                for r in self.rules.values()
            ],
            "verification": self._verification_dict(),
            # the whole-model extra: the original graph run in onnxruntime (CPU) is the reference
            "backends": {"ort": {c.output: c.to_dict() for c in self.verification}} if self.verification else {},
            "notes": list(self.notes),
        }

    def _verification_dict(self) -> dict[str, Any]:
        checks = self.local.checks if self.local is not None else []
        return {
            "local": {**(self.local.summary() if self.local is not None else {"checked": 0}),
                      "how": ("each fusion's matched subgraph (its own constants) vs the fused node(s) on random "
                              "inputs of the shapes it sees, both against a float64 evaluation of the subgraph "
                              "(onnx reference evaluator); onnxruntime CPU runs bfloat16 widened to float32"),
                      "checks": [c.to_dict() for c in checks]},
            "whole_model": self.whole_model or ("not run: verification off" if not self.verify else "not run: nothing applied"),
        }

    def summary(self) -> str:
        lines = [f"normexport rewrite (target {self.target}, verify {'on' if self.verify else 'off'}): "
                 f"{self.applied} fusion(s), nodes {self.nodes_before} -> {self.nodes_after}, "
                 f"opset {self.opset_before} -> {self.opset_after}"]
        if self.norm_nodes:
            lines.append("  norm nodes: " + ", ".join(f"{v} {k}" for k, v in self.norm_nodes.items()))
        if self.canonical and self.applied:
            lines.append("  canonical forms first: " + ", ".join(f"{k} {v}" for k, v in self.canonical.items()))
        for r in self.rules.values():
            if not (r.matched or r.applied or r.rejected):
                continue
            reasons: dict[str, int] = {}
            for rej in r.rejected:
                reasons[rej["reason"]] = reasons.get(rej["reason"], 0) + 1
            why = "; ".join(f"{k} x{v}" if v > 1 else k for k, v in reasons.items())
            lines.append(f"  {r.module}/{r.name}: matched {r.matched}, applied {r.applied}"
                         + (f", rejected: {why}" if why else ""))
        for m, status in self.modules.items():
            if status != "ok" and not status.startswith("not for target"):  # (those stay in the JSON report)
                lines.append(f"  module {m}: {status}")
        if self.local is not None and self.local.checks:
            sm = self.local.summary()
            lines.append(f"  local verification: {sm['passed']} of {sm['checked']} fusion(s) verified against float64 "
                         f"({sm['distinct']} distinct subgraph(s) run"
                         + ("; bfloat16 widened to float32 for onnxruntime" if sm["widened_bf16"] else "") + ")")
        bad = self.unverified()
        if bad:
            first = bad[0]["reason"].removeprefix("local verification: ")
            lines.append(f"  NOT APPLIED: {len(bad)} fusion(s) failed local verification (first: {bad[0]['node']}: {first})")
        if self.whole_model:
            lines.append(f"  whole-model comparison: {self.whole_model}")
        if self.sizes:
            lines.append(f"  verified at {_sizes.describe({i['name']: i['shape'] for i in self.inputs})} ({self.sizes})")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


#: the standard and onnxruntime norm ops norm_node_counts counts (besides every normexport op)
STANDARD_NORMS = ("LayerNormalization", "RMSNormalization", "com.microsoft::SkipSimplifiedLayerNormalization",
                  "com.microsoft::SkipLayerNormalization")


def norm_node_counts(nodes) -> dict[str, int]:
    """Norm nodes among `nodes` (onnx or onnx_ir) by "domain::op_type" (default domain bare): every
    normexport op (a SkipRMSNorm / GatedAdaLNZero is a norm with its residual Add fused in) and the
    STANDARD_NORMS, normexport ones first."""
    counts: dict[str, int] = {}
    for n in nodes:
        key = f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
        if n.domain == _ops.DOMAIN or key in STANDARD_NORMS:
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (not kv[0].startswith(_ops.DOMAIN + "::"), kv[0])))


def input_records(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> list[dict[str, Any]]:
    """RewriteReport.inputs for `shapes`: name, shape, ONNX element type and its name."""
    return [{"name": i.name, "shape": list(shapes[i.name]), "elem_type": i.elem_type,
             "dtype": _dtype_name(i.elem_type)} for i in _sizes.real_inputs(model) if i.name in shapes]


def _dtype_name(elem_type: int) -> str:
    """'float', 'int64', ...; 'undefined' for 0 (an optional or sequence input has no tensor type:
    TorchScript's export of an `Optional[Tensor]` forward parameter)."""
    if elem_type not in onnx.helper.get_all_tensor_dtypes():
        return "undefined"
    return onnx.helper.tensor_dtype_to_string(elem_type).replace("TensorProto.", "").lower()
