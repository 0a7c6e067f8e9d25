"""End-to-end export of real third-party blocks (diffusers, transformers) with random weights.

Each model goes through `normexport.convert_module(..., target="trt")` once (module fixtures),
then: the expected normexport node counts, a FunctionProto for every custom op used,
`onnx.checker.check_model(full_check=True)`, `normexport.check` (onnxruntime at the example shape
and two more sizes of the dynamic axes, against a float64 reference), and an independent
onnxruntime run at another batch and sequence length compared with eager (rel err <= 1e-5).

Weights: the layers' own random init, plus random norm weights / biases (never all ones or all
zeros, so a swapped norm that dropped or misplaced its scale would show) and random linear biases.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import normexport
from normexport import ops
from normexport.export import op_counts
from _norm_counts import fold

diffusers_attention = pytest.importorskip("diffusers.models.attention")
pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm  # noqa: E402

ADALN = f"{ops.DOMAIN}::AdaLNZero"
GATED = f"{ops.DOMAIN}::GatedAdaLNZero"
RMS = f"{ops.DOMAIN}::RMSNorm"
SKIP_RMS = f"{ops.DOMAIN}::SkipRMSNorm"
REL_TOL = 1e-5


# ---- helpers -----------------------------------------------------------------------------------
def randomize_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random norm weights (1 + 0.3 randn; Gemma-style zero-init weights 0.3 randn), norm biases
    and linear biases (small randn); other weights keep their (random) default init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            w = getattr(m, "weight", None)
            if isinstance(m, GemmaRMSNorm):
                w.copy_(0.3 * torch.randn(w.shape, generator=g))
            elif isinstance(m, (nn.LayerNorm, Qwen2RMSNorm)) or type(m).__name__.endswith("RMSNorm"):
                if w is not None:
                    w.copy_(1.0 + 0.3 * torch.randn(w.shape, generator=g))
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
            elif isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()


def convert(module: nn.Module, args: tuple, names: list[str], dynamic: dict) -> tuple[onnx.ModelProto, dict]:
    report: dict = {}
    model = normexport.convert_module(module, args, target="trt", input_names=names, dynamic_axes=dynamic,
                                      report=report)
    return model, report


def run_ort(model: onnx.ModelProto, *inputs: torch.Tensor) -> list[np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.numpy() for i, t in zip(sess.get_inputs(), inputs)}
    return sess.run(None, feeds)


def assert_ort_matches_eager(model: onnx.ModelProto, module: nn.Module, *inputs: torch.Tensor) -> float:
    with torch.no_grad():
        want = module(*inputs).double().numpy()
    (got,) = run_ort(model, *inputs)
    assert got.shape == want.shape
    err = float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())
    assert err <= REL_TOL, f"onnxruntime vs eager at {[tuple(t.shape) for t in inputs]}: rel err {err:.3g}"
    return err


def assert_well_formed(model: onnx.ModelProto) -> None:
    """Every normexport op used has its FunctionProto and the opset import; full ONNX check."""
    used = {n.op_type for n in model.graph.node if n.domain == ops.DOMAIN}
    funcs = {f.name for f in model.functions if f.domain == ops.DOMAIN}
    assert used and used <= funcs, (used, funcs)
    assert {o.domain: o.version for o in model.opset_import}.get(ops.DOMAIN) == 1
    onnx.checker.check_model(model, full_check=True)


def assert_check_passes(model, module, args, dynamic) -> None:
    report = normexport.check(model, module, args, dynamic_axes=dynamic)
    assert report.passed, report.table()
    assert len(report.rows) == 3, report.table()  # example shape + 2 more sizes of the dynamic axes


def _const(model: onnx.ModelProto, name: str) -> np.ndarray:
    """An initializer or Constant node output of the main graph, as numpy."""
    for i in model.graph.initializer:
        if i.name == name:
            return onnx.numpy_helper.to_array(i)
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output[0] == name:
            return onnx.numpy_helper.to_array(n.attribute[0].t)
    raise KeyError(name)


def _affine(model: onnx.ModelProto, node: onnx.NodeProto, hidden: int) -> tuple[list, list]:
    """The LayerNorm weight / bias an AdaLNZero-kind node applies, found by its op spec's input
    order (AdaLNZero: X, shift, scale, weight, bias; GatedAdaLNZero: X, update, gate, shift, scale,
    weight, bias); an input the node leaves out is the spec's fill (weight 1, bias 0)."""
    spec_inputs = ops.SPECS[node.op_type].inputs
    out = []
    for name in ("weight", "bias"):
        i = next(k for k, s in enumerate(spec_inputs) if s.name == name)
        if i < len(node.input) and node.input[i]:
            out.append(_const(model, node.input[i]).tolist())
        else:
            out.append([spec_inputs[i].fill] * hidden)
    return out[0], out[1]


def swapped(report: dict) -> list[tuple[str, str]]:
    return [(e["name"], e["op"]) for e in report["prepare"] if e["action"] == "swapped"]


# ---- diffusers: DiT-style BasicTransformerBlock (norm_type="ada_norm_zero") -------------------
N_CLASSES = 10


class DiTBlock(nn.Module):
    """BasicTransformerBlock with positional (x, timestep, class_labels) for export."""

    def __init__(self, **kw):
        super().__init__()
        self.block = diffusers_attention.BasicTransformerBlock(
            64, 4, 16, norm_type="ada_norm_zero", num_embeds_ada_norm=N_CLASSES, **kw)

    def forward(self, x, timestep, class_labels):
        return self.block(x, timestep=timestep, class_labels=class_labels)


def _dit_inputs(b: int, s: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s, 64, generator=g) + 0.2,
            torch.randint(1, 1000, (b,), generator=g),
            torch.randint(0, N_CLASSES, (b,), generator=g))


DIT_NAMES = ["x", "timestep", "class_labels"]
DIT_DYNAMIC = {"x": [0, 1], "timestep": [0], "class_labels": [0]}

# Expected counts, from the block's structure (diffusers 0.42, attention.py):
# - norm1 is AdaLayerNormZero (LayerNorm without affine, then * (1 + scale_msa) + shift_msa):
#   swapped in torch for AdaLayerNormZeroNE -> 1 AdaLNZero(x, shift, scale) with 3 inputs.
# - norm2 exists only with cross attention (cross_attention_dim or double_self_attention) and is
#   then a plain affine nn.LayerNorm feeding attn2, with no modulation after it ->
#   1 LayerNormalization. In the default config norm2 is None.
# - norm3 is an affine nn.LayerNorm followed by `* (1 + scale_mlp[:, None]) + shift_mlp[:, None]`:
#   left alone in torch, exported as LayerNormalization -> Mul -> Add, which the ONNX adaln rule
#   fuses into 1 AdaLNZero(x, shift, scale, weight, bias) with 5 inputs (the random affine).
# - --target trt fuses a gated residual add before a modulated norm (rule gated_adaln): without
#   norm2, norm3's input is `x + gate_msa * attn1(...)`, so norm3 is 1 GatedAdaLNZero; with norm2
#   the add before norm3 is attn2's ungated residual, nothing to fuse.
# Counts: fused residual nodes folded into the norm they carry (`fold`), then the exact split.
DIT_CASES = {
    "default": ({}, {ADALN: 2, "LayerNormalization": 0}, {ADALN: 1, GATED: 1}),
    "double_self_attention": ({"double_self_attention": True}, {ADALN: 2, "LayerNormalization": 1},
                              {ADALN: 2, GATED: 0}),
}


@pytest.fixture(scope="module", params=list(DIT_CASES))
def dit(request):
    kw, expected, split = DIT_CASES[request.param]
    module = randomize_(DiTBlock(**kw), seed=1)
    args = _dit_inputs(2, 8, seed=2)
    model, report = convert(module, args, DIT_NAMES, DIT_DYNAMIC)
    return module, args, model, report, kw, expected, split


def test_dit_block_structure_and_counts(dit):
    module, _, model, report, kw, expected, split = dit
    block = module.block
    assert type(block.norm1).__name__ == "AdaLayerNormZero"
    assert (block.norm2 is None) == (not kw)
    assert isinstance(block.norm3, nn.LayerNorm) and block.norm3.elementwise_affine
    raw = op_counts(model)
    counts = fold(raw)
    for op, n in expected.items():
        assert counts.get(op, 0) == n, counts
    for op, n in split.items():
        assert raw.get(op, 0) == n, raw
    assert counts.get(RMS, 0) == 0
    assert swapped(report) == [("block.norm1", "AdaLNZero")]
    # norm1 has no affine (its node leaves weight / bias out or passes ones / zeros), norm3 has its
    # random affine.
    affine = sorted(_affine(model, n, 64) for n in model.graph.node if n.domain == ops.DOMAIN)
    want = [([1.0] * 64, [0.0] * 64), (block.norm3.weight.tolist(), block.norm3.bias.tolist())]
    assert len(affine) == 2
    for (w, b), (ew, eb) in zip(affine, sorted(want)):
        np.testing.assert_allclose(w, ew, rtol=0, atol=0)
        np.testing.assert_allclose(b, eb, rtol=0, atol=0)
    rules = {r["name"]: r["applied"] for r in report["rewrite"]["rules"]}
    assert rules["adaln_zero"] + rules["adaln_zero_l"] == 1  # norm3
    # norm3 with the gated residual add fused in (rules gated_adaln_zero*)
    assert sum(n for name, n in rules.items() if name.startswith("gated_adaln_zero")) == split[GATED]


def test_dit_block_well_formed(dit):
    assert_well_formed(dit[2])


def test_dit_block_parity(dit):
    module, args, model, *_ = dit
    assert_check_passes(model, module, args, DIT_DYNAMIC)
    assert_ort_matches_eager(model, module, *_dit_inputs(5, 11, seed=3))


# ---- transformers: LlamaDecoderLayer ----------------------------------------------------------
class LlamaBlock(nn.Module):
    """LlamaDecoderLayer for export. In transformers 5.x the layer takes `position_embeddings`
    (cos, sin), computed once per model by LlamaRotaryEmbedding; here they are computed from the
    sequence length like LlamaModel does. attn "sdpa" with no mask is causal (as in LlamaModel
    without padding)."""

    def __init__(self):
        super().__init__()
        cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                          num_hidden_layers=1, vocab_size=32, max_position_embeddings=128,
                          attn_implementation="sdpa")
        self.layer = LlamaDecoderLayer(cfg, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(cfg)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        return self.layer(x, position_embeddings=self.rotary(x, positions))


@pytest.fixture(scope="module")
def llama():
    module = randomize_(LlamaBlock(), seed=4)
    args = (torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(5)) + 0.3,)
    model, report = convert(module, args, ["x"], {"x": [0, 1]})
    return module, args, model, report


def test_llama_decoder_layer(llama):
    module, args, model, report = llama
    raw = op_counts(model)
    counts = fold(raw)
    assert counts.get(RMS, 0) == 2, counts  # input_layernorm, post_attention_layernorm
    # post_attention_layernorm takes `x + attn(...)`: fused with that residual add (--target trt)
    assert (raw.get(RMS, 0), raw.get(SKIP_RMS, 0)) == (1, 1), raw
    assert counts.get(ADALN, 0) == 0
    assert swapped(report) == [("layer.input_layernorm", "RMSNorm"), ("layer.post_attention_layernorm", "RMSNorm")]
    assert_well_formed(model)
    assert_check_passes(model, module, args, {"x": [0, 1]})
    x = torch.randn(3, 13, 64, generator=torch.Generator().manual_seed(6)) + 0.3
    assert_ort_matches_eager(model, module, x)


# ---- transformers: Qwen2RMSNorm + GemmaRMSNorm ------------------------------------------------
class QwenGemmaNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.qwen = Qwen2RMSNorm(64, eps=1e-6)
        self.proj = nn.Linear(64, 64)
        self.gemma = GemmaRMSNorm(64, eps=1e-6)

    def forward(self, x):
        return self.gemma(self.proj(self.qwen(x)))


def test_qwen_and_gemma_rmsnorm():
    module = randomize_(QwenGemmaNorms(), seed=7)
    assert not torch.all(module.gemma.weight == 0) and not torch.all(module.qwen.weight == 1)
    args = (torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(8)) + 0.5,)
    model, report = convert(module, args, ["x"], {"x": [0, 1]})
    counts = op_counts(model)
    assert counts.get(RMS, 0) == 2, counts
    assert swapped(report) == [("qwen", "RMSNorm"), ("gemma", "RMSNorm")]
    assert "Gemma" in report["prepare"][1]["reason"]

    # the scale initializer of each RMSNorm: Qwen's w, Gemma's 1 + w folded (float32, exact)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    rms = [n for n in model.graph.node if n.domain == ops.DOMAIN and n.op_type == "RMSNorm"]
    qwen_node = next(n for n in rms if n.input[0] == model.graph.input[0].name)
    gemma_node = next(n for n in rms if n is not qwen_node)
    np.testing.assert_array_equal(inits[qwen_node.input[1]], module.qwen.weight.detach().numpy())
    np.testing.assert_array_equal(inits[gemma_node.input[1]], (1.0 + module.gemma.weight.detach()).numpy())

    assert_well_formed(model)
    assert_check_passes(model, module, args, {"x": [0, 1]})
    x = torch.randn(4, 5, 64, generator=torch.Generator().manual_seed(9)) + 0.5
    assert_ort_matches_eager(model, module, x)


# ---- no norm at all --------------------------------------------------------------------------
def test_mlp_without_norms_is_untouched():
    module = randomize_(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)), seed=10)
    args = (torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(11)),)
    model, report = convert(module, args, ["x"], {"x": [0, 1]})
    assert report["prepare"] == [] and report["fold_batchnorm"] == []
    assert all(r["applied"] == 0 for r in report["rewrite"]["rules"]), report["rewrite"]["rules"]
    assert not any(n.domain == ops.DOMAIN for n in model.graph.node)
    assert not any(f.domain == ops.DOMAIN for f in model.functions)
    assert ops.DOMAIN not in {o.domain for o in model.opset_import}
    onnx.checker.check_model(model, full_check=True)
    assert_check_passes(model, module, args, {"x": [0, 1]})
    x = torch.randn(5, 3, 32, generator=torch.Generator().manual_seed(12))
    assert_ort_matches_eager(model, module, x)
