"""A shortcut in onnxscript's pattern matcher (issue 31 item 3: export time), installed when
normexport.rewriter is imported.

onnxscript's SimplePatternMatcher, for a pattern with several output nodes, first indexes every
node of the graph by op type and enumerates combinations, and only then finds that the node it
was handed is not of the first output node's op type. RewriteRuleSet hands it every node of the
graph, so each such rule costs O(nodes^2): on a 22-layer LLaMA export most of the time of the
optimizer torch.onnx.export runs (onnxscript's default rules), of our rewriter's rules and of the
attention fusion's. Here a node whose op type or domain the first output node does not accept
gets the failed match at once, before the index is built: the same result (every combination
would fail at that node), no other change. With a match tracer (the rewriter's diagnostics), the
original runs, so the recorded failure reasons stay as they were."""

from __future__ import annotations

_INSTALLED = "_normexport_first_node_shortcut"


def install() -> bool:
    """Install the shortcut (once); False where onnxscript's matcher is not the one expected."""
    try:
        from onnxscript.rewriter import _basics, _matcher
    except ImportError:
        return False
    cls = getattr(_matcher, "SimplePatternMatcher", None)
    if cls is None or getattr(cls.match, _INSTALLED, False):
        return cls is not None
    original = cls.match

    def match(self, model, graph_or_function, node, *, verbose: int = 0, remove_nodes: bool = True, tracer=None):
        pattern = self.pattern
        if tracer is None and not pattern.has_single_output_node:
            first = pattern.output_nodes[0]
            if not first.op.matches(node.op_type) or not first.domain.matches(node.domain):
                return _basics.MatchResult().fail(f"OpType mismatch: expected {first.op}, got {node.op_type}.", node)
        return original(self, model, graph_or_function, node, verbose=verbose, remove_nodes=remove_nodes,
                        tracer=tracer)

    setattr(match, _INSTALLED, True)
    match.__wrapped__ = original
    cls.match = match
    return True


def uninstall() -> None:
    """Put onnxscript's own matcher back (tests compare the two)."""
    from onnxscript.rewriter import _matcher

    m = _matcher.SimplePatternMatcher.match
    if getattr(m, _INSTALLED, False):
        _matcher.SimplePatternMatcher.match = m.__wrapped__
