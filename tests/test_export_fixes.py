"""normexport.export_fixes: exact fixes to the dynamo exporter's output (each vs what it replaces,
bit for bit in onnxruntime), and the diffusers folders they make convert: HunyuanVideo (a bool
masked_fill: onnxruntime has no bool Where) and PixArt-alpha with ada_norm_single (a no-op
`squeeze(1)` written as an ONNX Squeeze that requires a 1)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

import normexport
from normexport.export_fixes import bool_where, einsum_permutations_as_transpose, int64_indices, noop_squeezes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_families import _assert_fused, _convert, _norm_calls  # noqa: E402
from _norm_counts import norm_ops  # noqa: E402


def _model(nodes, ins, outs, inits=()):
    g = onnx.helper.make_graph(nodes, "g", ins, outs, list(inits))
    return onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 22)])


def _run(proto, feeds):
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _fixed(proto, fix):
    m = ir.serde.deserialize_model(proto)
    n = fix(m)
    return n, ir.serde.serialize_model(m)


def test_einsum_permutation_becomes_the_same_transpose():
    vi = onnx.helper.make_tensor_value_info
    proto = _model([onnx.helper.make_node("Einsum", ["x"], ["y"], equation="nhwpqc->nchpwq")],
                   [vi("x", onnx.TensorProto.FLOAT, [2, 3, 4, 2, 2, 5])], [vi("y", onnx.TensorProto.FLOAT, None)])
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 2, 2, 5)).astype(np.float32)
    n, out = _fixed(proto, einsum_permutations_as_transpose)
    assert n == 1 and [x.op_type for x in out.graph.node] == ["Transpose"]
    np.testing.assert_array_equal(_run(out, {"x": x}), np.einsum("nhwpqc->nchpwq", x))


@pytest.mark.parametrize("eq,shapes", [("ij,jk->ik", [[2, 3], [3, 4]]), ("ii->i", [[3, 3]]), ("ij->i", [[2, 3]]),
                                       ("...ij->...ji", [[2, 3, 4]])])
def test_other_einsums_are_left_alone(eq, shapes):
    vi = onnx.helper.make_tensor_value_info
    ins = [vi(f"x{i}", onnx.TensorProto.FLOAT, s) for i, s in enumerate(shapes)]
    proto = _model([onnx.helper.make_node("Einsum", [i.name for i in ins], ["y"], equation=eq)], ins,
                   [vi("y", onnx.TensorProto.FLOAT, None)])
    n, out = _fixed(proto, einsum_permutations_as_transpose)
    assert n == 0 and [x.op_type for x in out.graph.node] == ["Einsum"]


@pytest.mark.parametrize("dims,axes,left", [(["B", "T", 1], [1, 2], [2]), (["B", 16, 4], [1], None),
                                            (["B", 1, 4], [1], [1])])
def test_squeeze_keeps_only_axes_known_to_be_1(dims, axes, left):
    """torch's x.squeeze(d) is a no-op where dim d is not 1; a symbolic dim is >= 2 under
    torch.export: those axes go, an axis known to be 1 stays, no axis left is an Identity."""
    vi = onnx.helper.make_tensor_value_info
    ax = onnx.numpy_helper.from_array(np.array(axes, np.int64), "axes")
    proto = _model([onnx.helper.make_node("Squeeze", ["x", "axes"], ["y"])], [vi("x", onnx.TensorProto.FLOAT, dims)],
                   [vi("y", onnx.TensorProto.FLOAT, None)], [ax])
    n, out = _fixed(proto, noop_squeezes)
    shape = [2 if d == "B" else 5 if d == "T" else d for d in dims]
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    want = torch.from_numpy(x)
    for a in sorted(axes, reverse=True):
        want = want.squeeze(a)
    if left == axes:
        assert n == 0
    else:
        assert n == 1
        ops = [x.op_type for x in out.graph.node]
        assert ops == (["Identity"] if left is None else ["Constant", "Squeeze"]), ops
    np.testing.assert_array_equal(_run(out, {"x": x}), want.numpy())


def test_bool_where_becomes_and_or_not():
    vi = onnx.helper.make_tensor_value_info
    proto = _model([onnx.helper.make_node("Where", ["c", "x", "y"], ["z"])],
                   [vi("c", onnx.TensorProto.BOOL, [4, 1]), vi("x", onnx.TensorProto.BOOL, [4, 5]),
                    vi("y", onnx.TensorProto.BOOL, [1, 5])], [vi("z", onnx.TensorProto.BOOL, None)])
    with pytest.raises(Exception, match="NOT_IMPLEMENTED|Could not find an implementation"):
        _run(proto, {})  # the reason for the fix: no bool Where kernel in onnxruntime's CPU provider
    rng = np.random.default_rng(2)
    c, x, y = rng.random((4, 1)) > 0.5, rng.random((4, 5)) > 0.5, rng.random((1, 5)) > 0.5
    n, out = _fixed(proto, bool_where)
    assert n == 1 and "Where" not in [x.op_type for x in out.graph.node]
    np.testing.assert_array_equal(_run(out, {"c": c, "x": x, "y": y}), np.where(c, x, y))


def test_int32_indices_of_gather_nd_are_cast_to_int64():
    """What torch.onnx writes for advanced indexing with int32 positions (ZImage's transformer): a GatherND
    with int32 indices, which ONNX and onnxruntime refuse. Fixed: the same values as torch."""
    class Pick(torch.nn.Module):
        def forward(self, x, keep):
            idx = torch.nonzero(keep).to(torch.int32)
            return x[idx[:, 0], idx[:, 1]] * 2.0

    g = torch.Generator().manual_seed(3)
    x, keep = torch.randn(3, 4, 5, generator=g), torch.rand(3, 4, generator=g) > 0.5
    proto = torch.onnx.export(Pick(), (x, keep), dynamo=True, verbose=False).model_proto
    with pytest.raises(Exception, match="GatherND"):
        _run(proto, {"x": x.numpy(), "keep": keep.numpy()})
    n, out = _fixed(proto, int64_indices)
    assert n == 1
    np.testing.assert_array_equal(_run(out, {"x": x.numpy(), "keep": keep.numpy()}), Pick()(x, keep).numpy())


def _tiny(name):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    if name == "hunyuan":
        return diffusers.HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
            guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8, rope_theta=256.0, rope_axes_dim=(2, 2, 4))
    return diffusers.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
        patch_size=2, cross_attention_dim=16, caption_channels=12, norm_type="ada_norm_single")


@pytest.mark.parametrize("family,fix", [("hunyuan", "bool_where"), ("pixart", "noop_squeezes")])
def test_folders_that_need_a_fix_convert_fused(cli, tmp_path, family, fix):
    folder = tmp_path / family
    _tiny(family).eval().save_pretrained(folder)
    loaded = normexport.load(str(folder))
    out = tmp_path / f"{family}.onnx"
    stdout, rep, errs = _convert(cli, folder, out)
    assert "PASSED" in stdout and rep["exporter"]["name"] == "dynamo", stdout
    assert rep["export_fixes"].get(fix, 0) >= 1, rep.get("export_fixes")
    _assert_fused(out, _norm_calls(loaded.module, loaded.example_inputs))
    assert max(errs) < 1e-5, errs


@pytest.mark.parametrize("eps", [1e-5, None])
def test_torchscript_fallback_writes_torch_rms_norm_for_the_rewriter(monkeypatch, eps):
    """torch.nn.RMSNorm (aten::rms_norm) has no TorchScript-exporter symbolic before opset 23: the
    fallback writes its decomposition (eps None: float32's machine epsilon, as torch), which the
    rewriter fuses; the file matches the float64 formula."""
    from normexport import export as nexport

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)
            self.norm = torch.nn.RMSNorm(16, eps=eps)
            with torch.no_grad():
                self.norm.weight.copy_(torch.linspace(0.5, 1.5, 16))

        def forward(self, x):
            return self.norm(self.lin(x))

    def no_dynamo(*a, **k):
        raise RuntimeError("dynamo exporter forced to fail")

    from normexport.exporter import rungs

    monkeypatch.setattr(rungs, "_torch_onnx_export", no_dynamo)
    torch.manual_seed(0)
    m = Block().eval()
    x = torch.randn(2, 5, 16) * torch.logspace(-3, 0, 5).reshape(1, 5, 1)  # rows where eps matters
    report: dict = {}
    model = nexport.convert_module(m, (x,), report=report, input_names=["x"])
    assert report["exporter"]["name"] == "torchscript"
    assert [n.op_type for n in model.graph.node].count("RMSNorm") == 1
    with torch.no_grad():
        h = x.double() @ m.lin.weight.double().T + m.lin.bias.double()
        w = m.norm.weight.double()
    e = torch.finfo(torch.float32).eps if eps is None else eps
    ref = (h / torch.sqrt((h * h).mean(-1, keepdim=True) + e) * w).numpy()
    got = _run(model, {"x": x.numpy()})
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max() + 1e-6


def test_pixart_wrapper_pt2_converts(cli, tmp_path):
    """The issue's PixArt-alpha wrapper .pt2 (its squeeze(1) was an invalid Squeeze): dynamo
    exporter, 5 of 5 modulated LayerNorms fused, parity passing."""
    m = _tiny("pixart").eval()

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, hidden_states, encoder_hidden_states, timestep):
            return self.inner(hidden_states, encoder_hidden_states=encoder_hidden_states, timestep=timestep,
                              added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)[0]

    args = (torch.randn(2, 4, 8, 8), torch.randn(2, 5, 12), torch.tensor([3, 500]))
    path = tmp_path / "pixart.pt2"
    torch.export.save(torch.export.export(Wrapper(m), args), str(path))
    out = tmp_path / "pixart.onnx"
    stdout, rep, errs = _convert(cli, path, out)
    assert rep["exporter"]["name"] == "dynamo" and rep["export_fixes"]["noop_squeezes"] >= 1
    ops = norm_ops(out)  # a fused residual norm (GatedAdaLNZero) counted as its norm
    assert ops["AdaLNZero"] == 5 and not ops["LayerNormalization"] and not ops["ReduceMean"], ops
    assert max(errs) < 1e-5, errs


def test_ltx_video_folder_converts_with_its_batch_dynamic(cli, tmp_path):
    """LTX-Video: torch.onnx's capture (backed_size_oblivious) refuses the guards of its token grid as
    inconsistent and the TorchScript exporter writes an invalid Concat, so the file was static at the
    example sizes; the capture retried as torch.export does it by default (exporter/rungs.py) keeps the
    batch dynamic: dynamo exporter, norms fused, parity passing at batches 2, 3 and 4."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    folder = tmp_path / "ltx"
    diffusers.LTXVideoTransformer3DModel(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1,
                                         num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                                         num_layers=1, caption_channels=16).eval().save_pretrained(folder)
    loaded = normexport.load(str(folder))
    out = tmp_path / "ltx.onnx"
    stdout, rep, errs = _convert(cli, folder, out)
    assert "STATIC SHAPES" not in stdout and "(target trt, dynamo exporter)" in stdout, stdout
    assert rep["exporter"]["name"] == "dynamo" and rep["exporter"]["rung"] == "dynamic", rep["exporter"]
    m = onnx.load(str(out))
    batch = {i.name: i.type.tensor_type.shape.dim[0] for i in m.graph.input}
    assert not batch["hidden_states"].HasField("dim_value"), batch  # the batch symbolic in the file
    _assert_fused(out, _norm_calls(loaded.module, loaded.example_inputs))
    assert len(errs) == 3
