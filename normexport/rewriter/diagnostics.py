"""Why something was not fused: the tracer that keeps every match attempt worth reporting, and
the records it turns into (failed checks, pattern near-misses, a module's explain_unapplied)."""

from __future__ import annotations

from typing import Any

import onnx
import onnx_ir as ir
from onnxscript.rewriter._basics import MatchingTracer, MatchStatus

from .report import RewriteReport, RuleRecord

_NEAR_MISS_NODES = 3  # a failed match that got this many nodes in is a "pattern near-miss"
_OTHER_USES = "Matched nodes have other uses preventing replacement."


class Tracer(MatchingTracer):
    """Keeps every successful / check-failed match and every near-miss (not just the best)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[Any, ir.Node, Any, MatchStatus]] = []

    def log(self, rule, container, node, match_result, status) -> None:  # noqa: D401
        if status == MatchStatus.NO_MATCH and len(match_result.nodes) < _NEAR_MISS_NODES:
            return
        self.events.append((rule, node, match_result, status))


def where(node: ir.Node) -> str:
    """A node as the report names it: `Op(name) -> first output`."""
    out = node.outputs[0].name if node.outputs else ""
    return f"{node.op_type}{'(' + node.name + ')' if node.name else ''} -> {out}"


def record_unapplied(explain, work: onnx.ModelProto, report: RewriteReport) -> None:
    """Run a module's explain_unapplied hook (`explain` = (module name, hook), or None: nothing to
    do): the nodes it left in place, with its reason, unless a rule of it already said why."""
    if explain is None:
        return
    mod_name, hook = explain
    said = {r["node"] for rec in report.rules.values() if rec.module == mod_name for r in rec.rejected
            if r["reason"] != "pattern near-miss"}
    rec = None
    for node, why in hook(work):
        at = where(node)
        if at in said:
            continue
        rec = rec or report.record("skipped", mod_name)
        rec.reject(f"skipped: {why}", at)


def record_diagnostics(tracer: Tracer, records: dict[str, RuleRecord]) -> None:
    """Failed checks and near-misses, one per root node (the best-scoring rule), skipping nodes
    that some rule of the module matches successfully."""
    covered: set[int] = set()
    for rule, node, mr, status in tracer.events:
        if status == MatchStatus.SUCCESS:
            covered.update(id(n) for n in mr.nodes)
    best: dict[int, tuple[int, Any, ir.Node, Any, MatchStatus]] = {}
    for rule, node, mr, status in tracer.events:
        if status == MatchStatus.SUCCESS or id(node) in covered:
            continue
        score = len(mr.nodes) + 100 * int(status.value)
        if mr.reason == _OTHER_USES:
            score += 100
        if id(node) not in best or score > best[id(node)][0]:
            best[id(node)] = (score, rule, node, mr, status)
    for _, rule, node, mr, status in best.values():
        rec = records[rule.name]
        if status == MatchStatus.CONDITION_FAILED:
            rec.matched += 1
            rec.reject(f"failed check: {mr.reason or 'condition not met'}", where(node))
        elif mr.reason == _OTHER_USES:
            rec.matched += 1
            rec.reject("failed check: an intermediate value is used outside the pattern (or is a graph output)", where(node))
        else:
            rec.reject("pattern near-miss", where(node))
