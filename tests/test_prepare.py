"""normexport.prepare: behaviour-checked swaps of norm modules for normexport modules."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from torch import nn

from normexport.prepare import nn as nenn
from normexport.ops import adaln_zero as A
from normexport.ops import rms_norm as R
from normexport.prepare.swap import REL_TOL, prepare, rel_err
from normexport.models.dit import modulate  # module-level, so DiT-style blocks below use it like normexport.models.dit

torch.set_grad_enabled(False)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0, offset=0.3):
    return torch.randn(shape, generator=_gen(seed)) * 2.0 + offset


def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Random weights, never all ones: 1-D weights ~ 1 + N(0, 0.3²), the rest N(0, 0.3²)."""
    g = _gen(seed)
    for name, p in module.named_parameters():
        base = 1.0 if name.endswith("weight") and p.dim() == 1 else 0.0
        p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))
    return module.eval()


def swapped(report, op=None):
    return [e for e in report if e["action"] == "swapped" and (op is None or e["op"] == op)]


def count_modules(module, cls):
    return sum(isinstance(m, cls) for m in module.modules())


def check_swap(module, *inputs, op="RMSNorm", n=1):
    report = []
    new = prepare(module, report)
    assert len(swapped(report, op)) == n, report
    for e in swapped(report):
        assert e["max_rel_err"] <= REL_TOL
        assert set(e) == {"name", "kind", "action", "op", "reason", "max_rel_err"}
    assert rel_err(new(*inputs), module(*inputs)) <= REL_TOL
    return new, report


# ---- torch.nn.RMSNorm ------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(64,), (37,), (5, 12)])
@pytest.mark.parametrize("eps", [1e-6, None])
def test_torch_rmsnorm(shape, eps):
    m = randomize(nn.RMSNorm(shape, eps=eps))
    x = randn(3, 4, *shape)
    new, _ = check_swap(m, x)
    assert isinstance(new, nenn.RMSNorm) and new.axis == -len(shape)
    want = R.reference(x.numpy(), m.weight.numpy(), torch.finfo(torch.float32).eps if eps is None else eps,
                       axis=-len(shape))
    np.testing.assert_allclose(new(x).numpy(), want, rtol=1e-5, atol=1e-5)


def test_torch_rmsnorm_no_affine():
    m = nn.RMSNorm(40, eps=1e-5, elementwise_affine=False)
    new, _ = check_swap(m, randn(2, 40))
    assert torch.equal(new.weight, torch.ones(40))


# ---- Hugging Face family ---------------------------------------------------------------------
def _hf_norms():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    return {"llama": LlamaRMSNorm, "qwen2": Qwen2RMSNorm, "mistral": MistralRMSNorm, "t5": T5LayerNorm,
            "gemma": GemmaRMSNorm}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "t5", "gemma"])
@pytest.mark.parametrize("hidden", [64, 37])
def test_hf_rmsnorm(kind, hidden):
    m = randomize(_hf_norms()[kind](hidden, eps=1e-5), seed=hidden)
    x = randn(2, 7, hidden, seed=1)
    new, report = check_swap(m, x)
    w = m.weight.double().numpy() + (1.0 if kind == "gemma" else 0.0)  # Gemma: (1 + w)
    np.testing.assert_allclose(new(x).double().numpy(), R.reference(x.numpy(), w, 1e-5), rtol=1e-5, atol=1e-5)
    assert ("Gemma" in report[0]["reason"]) == (kind == "gemma")
    assert report[0]["kind"] == type(m).__name__


def _rms_module(kind, hidden):
    if kind == "torch":
        return nn.RMSNorm(hidden, eps=1e-6)
    if kind == "diffusers":
        from diffusers.models.normalization import RMSNorm

        return RMSNorm(hidden, eps=1e-6)
    return _hf_norms()[kind](hidden, eps=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "t5", "gemma", "torch", "diffusers"])
def test_half_precision_no_worse_than_eager(kind, dtype):
    hidden = 37
    m = _rms_module(kind, hidden)
    m = randomize(m, seed=3).to(dtype)
    new = prepare(m)
    assert all(p.dtype == dtype for p in new.parameters()) or kind == "gemma"  # Gemma keeps 1 + w in fp32
    x = randn(256, hidden, seed=4).to(dtype)
    w = m.weight.double().numpy() + (1.0 if kind == "gemma" else 0.0)
    ref = R.reference(x.double().numpy(), w, 1e-6)
    y_new, y_eager = new(x), m(x)
    assert y_new.dtype == y_eager.dtype == dtype
    err_new = np.abs(y_new.double().numpy() - ref).max()
    err_eager = np.abs(y_eager.double().numpy() - ref).max()
    assert err_new <= err_eager * (1 + 1e-6), (err_new, err_eager)
    assert err_new <= {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype] * np.abs(ref).max()


def _hf_llama_layer():
    """A transformers LlamaDecoderLayer (tiny config, random weights) with its rotary embedding
    computed inside forward, so it takes one tensor x [B, S, H]."""
    from transformers.models.llama.modeling_llama import LlamaConfig, LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=64, intermediate_size=172, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_hidden_layers=1, vocab_size=32, rms_norm_eps=1e-6,
                      attn_implementation="sdpa")

    class HFLlamaLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.rope = LlamaRotaryEmbedding(cfg)
            self.layer = LlamaDecoderLayer(cfg, layer_idx=0)

        def forward(self, x):
            pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            return self.layer(x, position_embeddings=self.rope(x, pos))

    torch.manual_seed(0)
    return randomize(HFLlamaLayer(), seed=5)


def test_llama_decoder_layer():
    m = _hf_llama_layer()
    x = randn(2, 9, 64, seed=6, offset=0.0)
    report = []
    new = prepare(m, report)
    assert [e["name"] for e in swapped(report, "RMSNorm")] == ["layer.input_layernorm",
                                                                "layer.post_attention_layernorm"]
    assert {e["kind"] for e in swapped(report)} == {"LlamaRMSNorm"}
    assert count_modules(new, nenn.RMSNorm) == 2
    assert rel_err(new(x), m(x)) <= REL_TOL
    assert type(m.layer.input_layernorm).__name__ == "LlamaRMSNorm"  # input not mutated


# ---- diffusers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("affine,bias", [(True, False), (False, False), (True, True)])
def test_diffusers_rmsnorm(affine, bias):
    from diffusers.models.normalization import RMSNorm

    m = randomize(RMSNorm(48, eps=1e-6, elementwise_affine=affine, bias=bias), seed=7)
    x = randn(2, 5, 48, seed=8)
    new, _ = check_swap(m, x)
    w = m.weight.numpy() if affine else np.ones(48)
    want = R.reference(x.numpy(), w, 1e-6) + (m.bias.numpy() if bias else 0.0)
    np.testing.assert_allclose(new(x).numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_embeddings", [None, 10])
def test_diffusers_adaln_zero(num_embeddings):
    from diffusers.models.normalization import AdaLayerNormZero

    torch.manual_seed(0)
    m = randomize(AdaLayerNormZero(32, num_embeddings=num_embeddings), seed=9)
    x = randn(2, 6, 32, seed=10)
    if num_embeddings is None:
        args = (x, None, None, None, randn(2, 32, seed=11))
    else:
        args = (x, torch.tensor([10.0, 700.0]), torch.tensor([1, 7]), torch.float32, None)
    report = []
    new = prepare(m, report)
    assert len(swapped(report, "AdaLNZero")) == 1, report
    assert count_modules(new, nenn.AdaLNZero) == 1
    want, got = m(*args), new(*args)
    assert len(got) == len(want) == 5
    for g_, w_ in zip(got[1:], want[1:]):  # gate_msa, shift_mlp, scale_mlp, gate_mlp unchanged
        torch.testing.assert_close(g_, w_, rtol=0, atol=0)
    assert rel_err(got[0], want[0]) <= REL_TOL
    # against the fp64 reference of the op, from the module's own modulation
    emb = m.linear(m.silu(args[4] if num_embeddings is None else m.emb(args[1], args[2], hidden_dtype=torch.float32)))
    shift, scale = emb.chunk(6, dim=1)[:2]
    np.testing.assert_allclose(got[0].numpy(), A.reference(x.numpy(), shift.numpy(), scale.numpy()),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_diffusers_adaln_zero_half_precision_no_worse_than_eager(dtype):
    """fp16 / bf16 AdaLayerNormZero: the swapped op (fp32 statistics) is no further from the
    float64 reference than diffusers' own module in the same dtype."""
    from diffusers.models.normalization import AdaLayerNormZero

    torch.manual_seed(0)
    m = randomize(AdaLayerNormZero(48), seed=21).to(dtype)
    new = prepare(m)
    assert count_modules(new, nenn.AdaLNZero) == 1
    x, emb = randn(4, 33, 48, seed=22).to(dtype), randn(4, 48, seed=23).to(dtype)
    y_new, y_eager = new(x, emb=emb)[0], m(x, emb=emb)[0]
    assert y_new.dtype == y_eager.dtype == dtype
    shift, scale = m.linear(m.silu(emb)).chunk(6, dim=1)[:2]  # the module's own modulation, in dtype
    ref = A.reference(x.double().numpy(), shift.double().numpy(), scale.double().numpy(), epsilon=1e-6)
    err_new = np.abs(y_new.double().numpy() - ref).max()
    err_eager = np.abs(y_eager.double().numpy() - ref).max()
    assert err_new <= err_eager * (1 + 1e-6), (err_new, err_eager)
    assert err_new <= {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype] * np.abs(ref).max()


def test_diffusers_adaln_zero_inside_model():
    from diffusers.models.normalization import AdaLayerNormZero

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = AdaLayerNormZero(32)
            self.proj = nn.Linear(32, 32)

        def forward(self, x, emb):
            h, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, emb=emb)
            return x + gate[:, None] * self.proj(h) * (1 + scale_mlp[:, None]) + shift_mlp[:, None] + gate_mlp[:, None]

    m = randomize(Block(), seed=12)
    check_swap(m, randn(2, 5, 32, seed=13), randn(2, 32, seed=14), op="AdaLNZero")


def _diffusers_adaln_module(kind):
    """(module, args, the fp64 formula's (x, shift, scale, weight, bias, eps) per modulated output)"""
    from diffusers.models import normalization as dn

    torch.manual_seed(0)
    x, c = randn(2, 6, 32, seed=31), randn(2, 24, seed=32)
    if kind == "single":
        m = randomize(dn.AdaLayerNormZeroSingle(32), seed=33)
        m.linear = randomize(nn.Linear(24, 96), seed=34)
        parts = m.linear(m.silu(c)).chunk(3, dim=1)
        return m, (x, c), {0: (parts[0], parts[1], None, None, 1e-6)}
    if kind in ("continuous", "continuous_plain", "continuous_nobias"):
        affine, bias = kind != "continuous_plain", kind != "continuous_nobias"
        m = randomize(dn.AdaLayerNormContinuous(32, 24, elementwise_affine=affine, eps=1e-6 if affine else 3e-5,
                                                bias=bias), seed=35)
        scale, shift = m.linear(m.silu(c)).chunk(2, dim=1)
        w = m.norm.weight if affine else None
        b = m.norm.bias if affine and bias else None
        return m, (x, c), {None: (shift, scale, w, b, m.norm.eps)}
    assert kind == "sd35x"
    m = randomize(dn.SD35AdaLayerNormZeroX(32), seed=36)
    m.linear = randomize(nn.Linear(24, 9 * 32), seed=37)
    parts = m.linear(m.silu(c)).chunk(9, dim=1)
    return m, (x, c), {0: (parts[0], parts[1], None, None, 1e-6), 5: (parts[6], parts[7], None, None, 1e-6)}


@pytest.mark.parametrize("kind", ["single", "continuous", "continuous_plain", "continuous_nobias", "sd35x"])
def test_diffusers_adaln_family(kind):
    """AdaLayerNormZeroSingle, AdaLayerNormContinuous (LayerNorm with / without affine / bias, its
    own eps) and SD35AdaLayerNormZeroX become normexport AdaLNZero; the modulated outputs match
    the op's fp64 formula from the module's own shift / scale, the other outputs are unchanged."""
    m, args, mods = _diffusers_adaln_module(kind)
    report = []
    new = prepare(m, report)
    assert len(swapped(report, "AdaLNZero")) == 1, report
    assert count_modules(new, nenn.AdaLNZero) == 1 and count_modules(new, nn.LayerNorm) == 0
    want, got = m(*args), new(*args)
    want_t = list(want) if isinstance(want, tuple) else [want]
    got_t = list(got) if isinstance(got, tuple) else [got]
    assert len(got_t) == len(want_t)
    for i, (g_, w_) in enumerate(zip(got_t, want_t)):
        key = i if i in mods else (None if None in mods and i == 0 else -1)
        if key == -1:
            torch.testing.assert_close(g_, w_, rtol=0, atol=0)  # gates etc. unchanged
            continue
        shift, scale, w, b, eps = mods[key]
        ref = A.reference(args[0].numpy(), shift.numpy(), scale.numpy(), None if w is None else w.numpy(),
                          None if b is None else b.numpy(), epsilon=eps)
        assert np.abs(g_.double().numpy() - ref).max() <= 1e-5 * np.abs(ref).max() + 1e-6
        assert rel_err(g_, w_) <= REL_TOL


def test_diffusers_adaln_continuous_rms_norm_is_not_adaln():
    """AdaLayerNormContinuous(norm_type="rms_norm") is no LayerNorm: not AdaLNZero; its RMSNorm is swapped."""
    from diffusers.models.normalization import AdaLayerNormContinuous

    m = randomize(AdaLayerNormContinuous(32, 24, eps=1e-6, norm_type="rms_norm"), seed=38)
    report = []
    new = prepare(m, report)
    assert swapped(report, "AdaLNZero") == [] and [e["name"] for e in swapped(report, "RMSNorm")] == ["norm"]
    args = (randn(2, 6, 32, seed=39), randn(2, 24, seed=40))
    assert rel_err(new(*args), m(*args)) <= REL_TOL


def test_diffusers_adaln_continuous_half_precision_no_worse_than_eager():
    from diffusers.models.normalization import AdaLayerNormContinuous

    m = randomize(AdaLayerNormContinuous(48, 24, elementwise_affine=False, eps=1e-6), seed=41).half()
    new = prepare(m)
    assert count_modules(new, nenn.AdaLNZero) == 1
    x, c = randn(3, 17, 48, seed=42).half(), randn(3, 24, seed=43).half()
    scale, shift = m.linear(m.silu(c)).chunk(2, dim=1)
    ref = A.reference(x.double().numpy(), shift.double().numpy(), scale.double().numpy(), epsilon=1e-6)
    err_new = np.abs(new(x, c).double().numpy() - ref).max()
    err_eager = np.abs(m(x, c).double().numpy() - ref).max()
    assert err_new <= err_eager * (1 + 1e-6) and err_new <= 2e-3 * np.abs(ref).max(), (err_new, err_eager)


# ---- reference models --------------------------------------------------------------------------
def test_reference_dit_block():
    from normexport.models import dit

    m = dit.tiny()
    report = []
    new = prepare(m, report)
    assert [e["name"] for e in swapped(report, "AdaLNZero")] == ["norm1", "norm2"]
    x = m.example_inputs()
    assert rel_err(new(*x), m(*x)) <= REL_TOL
    assert rel_err(new(*m.example_inputs(3, 5)), m(*m.example_inputs(3, 5))) <= REL_TOL
    assert isinstance(m.norm1, nn.LayerNorm) and type(m) is dit.DiTBlock  # input not mutated
    assert isinstance(new, dit.DiTBlock) and new.input_names == m.input_names
    assert prepare(new) is not new and rel_err(prepare(new)(*x), m(*x)) <= REL_TOL  # idempotent
    # a pickled / deep-copied prepared block still calls the fused op
    buf = io.BytesIO()
    torch.save(new, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is type(new) and rel_err(loaded(*x), m(*x)) <= REL_TOL
    copied = copy.deepcopy(loaded)
    assert type(copied) is type(new) and rel_err(copied(*x), m(*x)) <= REL_TOL
    ep = torch.export.export(copied, x)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.normexport.adaln_zero.default) == 2
    assert torch.ops.aten.layer_norm.default not in targets


def test_dit_block_with_extra_norm_use_is_left_alone():
    from normexport.models import dit

    class LeakyDiT(dit.DiTBlock):  # norm1's output also feeds the residual: fusing would be wrong
        def forward(self, x, c):
            shift, scale, gate, *_ = self.adaLN_modulation(c).chunk(6, dim=1)
            h = self.norm1(x)
            return h + gate.unsqueeze(1) * self.attn(modulate(h, shift, scale))

    m = dit.randomize_(LeakyDiT(), 0).eval()
    report = []
    new = prepare(m, report)
    assert not swapped(report)
    assert any(e["name"] == "norm1" and "changes the output" in e["reason"] for e in report), report
    x = m.example_inputs()
    torch.testing.assert_close(new(*x), m(*x), rtol=0, atol=0)


def test_dit_block_with_a_different_eps_per_norm_is_left_alone_at_torch_level():
    """One fused `modulate` serves every LayerNorm of the block: with a different eps per site the
    block is left to the ONNX rewriter (each node keeps its eps there) and the report says why."""
    from normexport.models import dit

    m = dit.randomize_(dit.DiTBlock(), 0).eval()
    m.norm2.eps = 1e-3
    report = []
    new = prepare(m, report)
    assert not swapped(report, "AdaLNZero")
    assert any(e["name"] == "norm1" and "different eps" in e["reason"] for e in report), report
    x = m.example_inputs()
    torch.testing.assert_close(new(*x), m(*x), rtol=0, atol=0)


def test_reference_llama_block():
    from normexport.models import llama

    m = llama.tiny()
    x = m.example_inputs()
    new, report = check_swap(m, *x, n=2)
    assert {e["kind"] for e in report} == {"LlamaStyleRMSNorm"}


def test_reference_models_other():
    from normexport.models import bert, conv_bn, norm_heavy

    for mod, n_rms in ((bert, 0), (conv_bn, 0), (norm_heavy, 2)):
        m = mod.tiny()
        report = []
        new = prepare(m, report)
        assert len(swapped(report, "RMSNorm")) == n_rms, report
        x = m.example_inputs()
        assert rel_err(new(*x), m(*x)) <= REL_TOL
        assert all(e["reason"] for e in report)


# ---- negatives ---------------------------------------------------------------------------------
class FakeRMSNorm(nn.Module):
    """Named and shaped like an RMSNorm but subtracts the mean: not an RMSNorm."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class ScaleNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.tensor(1.7))

    def forward(self, x):
        return self.g * x / x.norm(dim=-1, keepdim=True).clamp_min(1e-5)


def test_fake_norm_is_skipped():
    m = nn.Sequential(nn.Linear(16, 16), FakeRMSNorm(16), ScaleNorm())
    randomize(m, seed=15)
    report = []
    new = prepare(m, report)
    assert not swapped(report)
    by_name = {e["name"]: e for e in report}
    assert by_name["1"]["action"] == "skipped" and by_name["1"]["kind"] == "FakeRMSNorm"
    assert "rel err" in by_name["1"]["reason"] and by_name["1"]["max_rel_err"] > REL_TOL
    assert by_name["2"]["action"] == "skipped" and by_name["2"]["reason"]
    x = randn(3, 16, seed=16)
    torch.testing.assert_close(new(x), m(x), rtol=0, atol=0)


def test_no_norm_model():
    m = randomize(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)), seed=17)
    report = []
    new = prepare(m, report)
    assert report == [] and new is not m
    x = randn(5, 8, seed=18)
    assert torch.equal(new(x), m(x))


def test_input_not_mutated_and_training_flag_kept():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    m = nn.Sequential(randomize(LlamaRMSNorm(24)), nn.Linear(24, 24)).train()
    state = {k: v.clone() for k, v in m.state_dict().items()}
    new = prepare(m)
    assert isinstance(m[0], LlamaRMSNorm) and isinstance(new[0], nenn.RMSNorm)
    assert all(torch.equal(state[k], v) for k, v in m.state_dict().items())
    assert m.training and new.training


# ---- ONNX export ---------------------------------------------------------------------------------
def _export(module, inputs, dynamic_shapes):
    import onnx

    from normexport import ops

    program = torch.onnx.export(module, inputs, dynamo=True, custom_translation_table=ops.TRANSLATION_TABLE,
                                dynamic_shapes=dynamic_shapes, verbose=False)
    model = ops.attach_functions(program.model_proto)
    onnx.checker.check_model(model, full_check=True)
    return model


def _ort_run(model, names, inputs):
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = dict(zip([i.name for i in sess.get_inputs()], [t.numpy() for t in inputs]))
    return sess.run(None, feed)[0]


@pytest.mark.parametrize("name,op", [("llama", "RMSNorm"), ("dit", "AdaLNZero")])
def test_onnx_export(name, op):
    import importlib

    from torch.export import Dim

    mod = importlib.import_module(f"normexport.models.{name}")
    m = mod.tiny()
    new = prepare(m)
    batch, seq = Dim("batch", min=1, max=64), Dim("seq", min=1, max=512)
    dyn = {"x": {0: batch, 1: seq}} | ({"c": {0: batch}} if name == "dit" else {})
    model = _export(new, m.example_inputs(), dyn)
    nodes = [n for n in model.graph.node if n.domain == "normexport"]
    assert [n.op_type for n in nodes] == [op, op]
    assert not [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    for shape in ((2, None), (3, 5)):
        x = m.example_inputs(*shape)
        y = _ort_run(model, m.input_names, x)
        want = m(*x).double().numpy()
        assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max() + 1e-6


def test_onnx_export_hf_llama_decoder_layer():
    from torch.export import Dim

    m = _hf_llama_layer()
    new = prepare(m)
    model = _export(new, (randn(2, 9, 64, seed=19),), {"x": {0: Dim("batch", min=1, max=64),
                                                            1: Dim("seq", min=1, max=512)}})
    assert [n.op_type for n in model.graph.node if n.domain == "normexport"] == ["RMSNorm", "RMSNorm"]
    for shape in ((2, 9), (3, 5)):
        x = randn(*shape, 64, seed=20)
        want = m(x).double().numpy()
        assert np.abs(_ort_run(model, ["x"], (x,)) - want).max() <= 1e-5 * np.abs(want).max() + 1e-6
