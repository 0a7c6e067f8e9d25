"""normexport.rewriter — the engine behind normexport.rewrite(): fuse decomposed normalisation patterns in any ONNX file.

The driver loads every module named in `rules.RULE_MODULES` (in that order) and applies its
rules to the onnx-ir model in place; each match is verified locally before it is applied (its
matched subgraph vs the replacement, both against float64: local.py, docs/design.md §8) and recorded as
"local verification: ..." when it fails. A diagnostic dry run before each module records pattern
near-misses and failed checks, so the report says why something was not fused.

Optional hooks a rule module may define besides RULES / TARGETS (rules/__init__.py):
    rules_for(target) -> list[RewriteRule]   rules for that target (default: RULES)
    required_opset(target) -> int            default-domain opset the replacements need; the
                                             driver upgrades the model first when a rule matches
    explain_unapplied(ir.Model) -> [(ir node, reason)]   after the module ran: the nodes it is about
                                             that are still there, and why (reported as skipped)

Modules (one concern each):
    driver.py       the rewrite loop (rewrite)
    files.py        rewrite_file: load, rewrite, write atomically (external data too)
    report.py       RewriteReport / RuleRecord (docs/design.md §5)
    diagnostics.py  match tracer, failed checks / near-misses / explain_unapplied -> report
    verifier.py     Verifier: the whole-model extra (original vs rewritten in onnxruntime, small models)
    _verify.py      quiet onnxruntime sessions, output comparison within docs/design.md §7
    opset.py        upgrade_opset (bump, or onnx.version_converter on the model without its weights)
    local.py        LocalVerifier: each fusion's subgraph vs its replacement, both vs float64 (docs/design.md §8)
    serialize.py    finish: one AdaLNZero form, our ops' functions attached (in place, on onnx-ir)
    cli.py          `normexport rewrite`
"""

from __future__ import annotations

from . import _verify  # noqa: F401  (normexport.rewriter._verify: tests and tools run models through it)
from . import matcher_speed

matcher_speed.install()  # onnxscript's multi-output patterns tried in O(nodes), not O(nodes^2) (matcher_speed.py)
from .driver import TARGETS, rewrite, rewrite_ir
from .files import rewrite_file
from .opset import upgrade_opset
from .report import RewriteReport, RuleRecord
from .rules import RULE_MODULES  # the driver reads it from here at each call (swappable)

__all__ = ["rewrite", "rewrite_ir", "rewrite_file", "RewriteReport", "RuleRecord", "upgrade_opset", "TARGETS", "RULE_MODULES"]
