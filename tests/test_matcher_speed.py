"""normexport.rewriter.matcher_speed: the shortcut in onnxscript's matcher for patterns with several
output nodes (issue 31 item 3) changes nothing but the time: the optimizer torch.onnx.export runs
(onnxscript's default rules) and the attention fusion give the same graph, node for node, with
and without it, on a 4-layer LLaMA exported unoptimised; and the matcher's whole-graph index is
built far fewer times."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest
import torch

from test_llm_bypath import exported  # noqa: F401 (fixture: convert's decomposed file of a tiny LLaMA)


@pytest.fixture(scope="module")
def raw_model(tmp_path_factory):
    import transformers

    from normexport.llm import CacheLM, probe_layout

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    lm = CacheLM(transformers.LlamaForCausalLM(cfg).eval(), probe_layout(transformers.LlamaForCausalLM(cfg).eval()))
    prog = torch.onnx.export(lm, lm.example_inputs(), dynamo=True, optimize=False, input_names=list(lm.input_names),
                             output_names=list(lm.output_names), verbose=False)
    path = tmp_path_factory.mktemp("raw") / "raw.onnx"
    ir.save(prog.model, path)
    return path


def _graph(model: ir.Model) -> list:
    proto = ir.serde.serialize_model(model)
    return [(n.op_type, n.domain, list(n.input), list(n.output), onnx.helper.printable_attribute
             and [onnx.helper.printable_attribute(a) for a in n.attribute]) for n in proto.graph.node]


def _optimised(path, shortcut: bool, counter: list):
    from onnxscript._framework_apis.torch_2_8 import optimize
    from onnxscript.rewriter import _matcher

    from normexport.rewriter import matcher_speed

    (matcher_speed.install if shortcut else matcher_speed.uninstall)()
    real = _matcher.SimplePatternMatcher._multi_match

    def counted(self, *a, **k):
        counter.append(1)
        return real(self, *a, **k)

    _matcher.SimplePatternMatcher._multi_match = counted
    try:
        model = ir.load(str(path))
        optimize(model)
        return model
    finally:
        _matcher.SimplePatternMatcher._multi_match = real
        matcher_speed.install()


def test_same_graph_fewer_index_builds(raw_model):
    slow_calls, fast_calls = [], []
    slow = _optimised(raw_model, False, slow_calls)
    fast = _optimised(raw_model, True, fast_calls)
    assert _graph(fast) == _graph(slow)
    assert len(_graph(fast)) < 600  # optimised: the raw export's constants folded away
    assert len(fast_calls) * 10 < len(slow_calls), (len(fast_calls), len(slow_calls))


def test_attention_fusion_same_with_and_without(exported):
    """The GroupQueryAttention fusion (onnxscript's rotary / SDPA fusions and ours) on convert's
    decomposed file of a tiny LLaMA: the same fused graph and local-check numbers either way."""
    from normexport.llm import attention
    from normexport.rewriter import matcher_speed

    model = ir.load(str(exported[1]))
    results = []
    for shortcut in (False, True):
        (matcher_speed.install if shortcut else matcher_speed.uninstall)()
        try:
            f = attention.fuse(model, max_positions=128)
        finally:
            matcher_speed.install()
        assert f.model is not None, f.reason
        results.append((_graph(f.model), f.local["max_abs_err"]))
    assert results[0] == results[1]
