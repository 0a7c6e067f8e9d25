"""exporter.depth: a decoder of identical blocks traced 2 blocks deep (3 where 2 do not grow) and
grown to full depth (issue 31 item 3, issue 47 item 2), on a real transformers LlamaForCausalLM
(random weights, 8 layers): the grown file against a float64 eager reference, traced 2 and 3 deep,
a planted wrong weight mapping caught, a planted first-block-only step not grown from 2 blocks,
stacks whose blocks differ (Gemma 3's sliding / full layers) not grown, the module restored after
the shallow trace."""

import copy

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

transformers = pytest.importorskip("transformers")

from normexport.exporter import depth, rungs  # noqa: E402
from normexport.llm import shallow  # noqa: E402
from normexport.llm.cache import CacheLM  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def _model(seed=0, **config):
    """LlamaForCausalLM with random weights, norm scales random too (ones would hide a swapped scale)."""
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
    return m


def _llama(seed=0):
    return CacheLM(_model(seed, **COMMON))


def _run(model: ir.Model, args):
    proto = ir.serde.serialize_model(model)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    feeds = dict(zip(names, [a.numpy() for a in args]))
    return sess.run(None, feeds), [o.name for o in sess.get_outputs()]


def _reference(lm, args):
    """float64 eager: an independent reference for the file's logits and presents."""
    lm64 = copy.deepcopy(lm).double()
    lm64.layout = type(lm.layout)(lm.layout.keys, lm.layout.values, torch.float64)
    with torch.no_grad():
        out = lm64(*[a.double() if a.is_floating_point() else a for a in args])
    return [t.numpy() for t in out]


def _export(lm, args, plan, report):
    return rungs.dynamo(lm, args, lm.input_names, lm.output_names, lm.dynamic_axes(), 18, target="ort",
                        report=report, plan=plan)


@pytest.fixture(scope="module")
def grown():
    lm = _llama()
    args = lm.example_inputs(batch=2, sequence=3, past=5)
    report: dict = {}
    plan = shallow.plan(lm, args, lm.input_names, lm.output_names, lm.dynamic_axes())
    assert plan is not None and plan.stack.path == "inner.model.layers" and plan.stack.depth == 8
    model = _export(lm, args, plan, report)
    return lm, args, model, report


def _matches_float64_eager(lm, args, model):
    # the optimizer's transposed MatMul weights, made again as views of the grown blocks' weights
    views = [n for n in model.graph.initializers if n.endswith("__b7")]
    assert len(views) == 7, views  # q, k, v, o, gate, up, down
    assert [v.name for v in model.graph.inputs] == lm.input_names
    assert [v.name for v in model.graph.outputs] == lm.output_names
    got, names = _run(model, args)
    want = _reference(lm, args)
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, name
        err = np.abs(g.astype(np.float64) - w).max()
        assert err < 1e-4 * max(1.0, np.abs(w).max()), (name, err)


def test_grown_file_matches_float64_eager(grown):
    lm, args, model, report = grown
    assert report["depth"] == {"grown": True, "stack": "inner.model.layers", "blocks": 8, "traced": 2}
    _matches_float64_eager(lm, args, model)
    # the exporter's debugging metadata dropped (rungs.DEBUG_METADATA), the module path kept
    assert not any(k in n.metadata_props for n in model.graph for k in rungs.DEBUG_METADATA)
    assert any("pkg.torch.onnx.name_scopes" in n.metadata_props for n in model.graph)


def test_traced_three_deep_where_two_do_not_grow(monkeypatch):
    """Where the 2-block file does not grow (here: refused by a planted check), the decoder is
    traced 3 deep, block 2 checked node for node against block 1, and the file is eager's."""
    real = depth._only_shared_extras

    def refuse(*a):
        raise depth.NotGrowable("planted")

    monkeypatch.setattr(depth, "_only_shared_extras", refuse)
    lm = _llama()
    args = lm.example_inputs(batch=2, sequence=3, past=5)
    report: dict = {}
    model = _export(lm, args, shallow.plan(lm, args, lm.input_names, lm.output_names, lm.dynamic_axes()), report)
    assert report["depth"] == {"grown": True, "stack": "inner.model.layers", "blocks": 8, "traced": 3,
                               "shallow": "planted"}
    _matches_float64_eager(lm, args, model)
    monkeypatch.setattr(depth, "_only_shared_extras", real)


def test_a_first_block_only_step_is_not_grown_from_two_blocks(monkeypatch):
    """Block 0 with a step of its own (a node only it computes and reads: here its hidden state
    doubled, as a model with a special first layer would) must not be grown from block 1: block 1
    lacks the step, so the 2-block check refuses, and the 3-block file (blocks 1 and 2 alike) is
    grown. The file is eager's with the planted step."""
    from transformers.models.llama import modeling_llama

    real = modeling_llama.LlamaDecoderLayer.forward

    def forward(self, hidden_states, *a, **k):
        if self.self_attn.layer_idx == 0:
            hidden_states = hidden_states * 2.0
        return real(self, hidden_states, *a, **k)

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", forward)
    lm = _llama()
    args = lm.example_inputs(batch=2, sequence=3, past=5)
    report: dict = {}
    model = _export(lm, args, shallow.plan(lm, args, lm.input_names, lm.output_names, lm.dynamic_axes()), report)
    assert report["depth"]["traced"] == 3, report
    assert "blocks 0 and 1 read different values" in report["depth"]["shallow"], report
    _matches_float64_eager(lm, args, model)


def test_grown_file_at_other_sizes(grown):
    lm, _, model, _ = grown
    args = lm.example_inputs(batch=3, sequence=4, past=2, seed=3)
    got, names = _run(model, args)
    want = _reference(lm, args)
    assert np.abs(got[0] - want[0]).max() < 1e-4 * max(1.0, np.abs(want[0]).max())


def test_planted_wrong_weight_mapping_is_caught():
    """Blocks 3.. given block 2's weights (a name mapping bug): the file differs from eager."""
    lm = _llama()
    args = lm.example_inputs(batch=2, sequence=3, past=5)
    plan = shallow.plan(lm, args, lm.input_names, lm.output_names, lm.dynamic_axes())
    right = plan.weights
    plan.weights = lambda name: right(name.replace(f"{plan.stack.path}.{name.split('.')[3]}.", f"{plan.stack.path}.2."))
    model = _export(lm, args, plan, {})
    got, _ = _run(model, args)
    want = _reference(lm, args)
    assert np.abs(got[0] - want[0]).max() > 1e-3


def test_blocks_that_differ_are_not_grown():
    """Gemma 3 with sliding and full layers: the blocks differ in an attribute (and layer_types)."""
    cfg = transformers.Gemma3TextConfig(**COMMON, head_dim=8, sliding_window=4,
                                        layer_types=["sliding_attention", "full_attention"] * 4)
    torch.manual_seed(0)
    lm = CacheLM(transformers.Gemma3ForCausalLM(cfg).eval())
    assert depth.find_stack(lm) is None
    assert depth.find_stack(_llama()) is not None  # the same check on a uniform stack


def test_per_block_partials_are_equal_by_what_they_call():
    """Gemma's MLP activation holds a functools.partial made per block (GELUTanh.act): equal
    partials do not make the blocks differ; one with another argument does."""
    import functools

    torch.manual_seed(0)
    lm = CacheLM(transformers.GemmaForCausalLM(transformers.GemmaConfig(**COMMON, head_dim=8)).eval())
    assert depth.find_stack(lm) is not None
    lm.inner.model.layers[5].mlp.act_fn.act = functools.partial(torch.nn.functional.gelu, approximate="none")
    assert depth.find_stack(lm) is None


def test_too_shallow_is_not_grown():
    cfg = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 4})
    assert depth.find_stack(CacheLM(transformers.LlamaForCausalLM(cfg).eval())) is None


def test_shallow_restores_the_model_after_an_error():
    lm = _llama()
    stack = depth.find_stack(lm)
    blocks = lm.inner.model.layers
    with pytest.raises(RuntimeError):
        with depth.shallow(stack):
            assert len(lm.inner.model.layers) == depth.SHALLOW and lm.inner.config.num_hidden_layers == depth.SHALLOW
            raise RuntimeError("export failed")
    assert lm.inner.model.layers is blocks and lm.inner.config.num_hidden_layers == 8


# ---- convert: the grown file checked against eager; a wrong one exported again whole -----------------------

FUSED = dict(COMMON, hidden_size=64)  # head size 16: onnxruntime's GroupQueryAttention


def _folder(root):
    _model(1, **FUSED).save_pretrained(root / "llama8")
    return root / "llama8"


def _convert(folder, out, *extra):
    import contextlib
    import io

    from normexport.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["convert", str(folder), "-o", f"{out}/", "--target", "ort", "--no-check", *extra])
    return code, buf.getvalue()


def _file_vs_eager(folder, path):
    lm = CacheLM(transformers.AutoModelForCausalLM.from_pretrained(folder).eval())
    args = lm.example_inputs(batch=1, sequence=4, past=3, seed=5)  # GroupQueryAttention: batch 1 with a past
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    feeds = {n: a.numpy() for n, a in zip(lm.input_names, args) if n in names}
    got = sess.run(None, feeds)[0]
    want = _reference(lm, args)[0]
    return float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max()))


def test_convert_checks_the_grown_file_against_eager(tmp_path):
    folder = _folder(tmp_path)
    code, out = _convert(folder, tmp_path / "out")
    assert code == 0, out
    assert "depth: inner.model.layers traced 2 blocks deep, blocks 2-7 copied from block 1" in out
    assert "8 com.microsoft.GroupQueryAttention" in out
    assert "local check PASSED (the fused file in onnxruntime against eager, logits and cache" in out
    assert _file_vs_eager(folder, tmp_path / "out" / "model.onnx") < 1e-4


def plant_wrong_mapping(monkeypatch) -> None:
    """Every grown block reads block 2's weights (a planted bug in the depth plan's weight mapping)."""
    import re

    real = shallow.plan

    def planted(*a, **k):
        plan = real(*a, **k)
        if plan is not None:
            right = plan.weights
            plan.weights = lambda name: right(re.sub(r"layers\.\d+\.", "layers.2.", name))
        return plan

    monkeypatch.setattr(shallow, "plan", planted)


# A planted wrong weight mapping (plant_wrong_mapping): the local check's eager comparison fails, convert says so
# and exports the whole decoder, and the file written matches eager: tests/test_prewrite.py::
# test_refused_grown_file_closes_its_prewrite runs that convert (checked from files, its prewrite closed too);
# one convert for both (docs/design.md §16).


def test_no_fuse_depth_exports_the_whole_decoder(tmp_path):
    folder = _folder(tmp_path)
    code, out = _convert(folder, tmp_path / "out", "--no-fuse", "depth")
    assert code == 0, out
    assert "depth:" not in out
    assert _file_vs_eager(folder, tmp_path / "out" / "model.onnx") < 1e-4
