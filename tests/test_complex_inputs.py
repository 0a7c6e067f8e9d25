"""Complex forward inputs taken as real (re, im) pairs (issue 40).

diffusers' LuminaPipeline computes its RoPE table (`get_2d_rotary_pos_embed_lumina`: complex64, from
`torch.polar`) and passes it to `LuminaNextDiT2DModel.forward` as `image_rotary_emb`. Before, every
exporter rung failed on it ("Numpy_type 14 can't be converted to MLDataType", "Exporting the operator
'aten::view_as_real' ... is not supported"). Now the call's CallAdapter (normexport.load.call) takes a
complex leaf as view_as_real's pairs (its name kept, its shape + (2,)) and hands the model
view_as_complex of them, which the complex lowering (normexport.prepare.complex) carries as real.

The numerics are checked independently of the lowering and of the adapter: onnxruntime is fed
`torch.view_as_real(z)` of the user's complex tensor, and its outputs are compared with the eager
model called with the complex tensor itself (and with float64 numpy complex arithmetic for the small
model), random weights and non-zero inputs."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from normexport.export import convert_module
from normexport.load.call import CallAdapter

ort = pytest.importorskip("onnxruntime")


def _no_complex(m: onnx.ModelProto):
    types = [v.type.tensor_type.elem_type for v in list(m.graph.value_info) + list(m.graph.input) + list(m.graph.output)]
    types += [t.data_type for t in m.graph.initializer]
    assert not {onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128} & set(types)


def _inputs(m: onnx.ModelProto) -> dict[str, tuple]:
    inits = {t.name for t in m.graph.initializer}
    return {i.name: (i.type.tensor_type.elem_type, [d.dim_value if d.HasField("dim_value") else d.dim_param
                                                    for d in i.type.tensor_type.shape.dim])
            for i in m.graph.input if i.name not in inits}


def _run(path_or_proto, feeds: dict) -> list[np.ndarray]:
    src = path_or_proto.SerializeToString() if isinstance(path_or_proto, onnx.ModelProto) else str(path_or_proto)
    sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    return sess.run(None, {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in feeds.items()})


def _c(*shape, g):
    """A random complex64 tensor of non-unit magnitude."""
    return torch.polar(torch.rand(*shape, generator=g) + 0.5, torch.rand(*shape, generator=g) * 6.0)


# ---- the adapter ----------------------------------------------------------------------------------------
def test_adapter_takes_nested_complex_inputs_as_pairs():
    g = torch.Generator().manual_seed(0)
    x, a, b = torch.randn(2, 3, generator=g), _c(3, 4, g=g), _c(5, g=g).to(torch.complex128)
    seen = []

    class Inner(torch.nn.Module):
        def forward(self, x, rope, extra=None):
            seen.append((x, rope, extra))
            return x

    adapter = CallAdapter(Inner(), (x, (a, 1)), {"extra": {"b": b, "n": None}})
    assert adapter.input_names == ["x", "rope.0", "extra.b"]
    xs = adapter.example_inputs
    assert [t.dtype for t in xs] == [torch.float32, torch.float32, torch.float64]
    assert [tuple(t.shape) for t in xs] == [(2, 3), (3, 4, 2), (5, 2)]
    assert torch.equal(xs[0], x) and torch.equal(xs[1][..., 0], a.real) and torch.equal(xs[1][..., 1], a.imag)
    assert torch.equal(xs[2][..., 0], b.real) and torch.equal(xs[2][..., 1], b.imag)
    assert adapter.complex_inputs == {"rope.0": (torch.complex64, (3, 4)), "extra.b": (torch.complex128, (5,))}
    for ad in (adapter, adapter.with_inner(Inner())):
        seen.clear()
        ad.call_inner(*xs)
        gx, (ga, one), extra = seen[0]
        assert gx is xs[0] and one == 1 and extra["n"] is None
        assert ga.dtype == torch.complex64 and torch.equal(ga, a)  # the user's values, bit for bit
        assert extra["b"].dtype == torch.complex128 and torch.equal(extra["b"], b)
    # half pairs (--dtype float16 casts float inputs): complex64 again for the model
    seen.clear()
    adapter.call_inner(xs[0], xs[1].half(), xs[2])
    assert seen[0][1][0].dtype == torch.complex64


# ---- a small model: complex inputs in a tuple and a dict, products and .real / .imag ------------------
class RotaryWithInputs(torch.nn.Module):
    """q rotated by a complex table given in a tuple, a gain read with .real / .imag from a dict entry
    (no complex name in its code for the scan to find: only the inputs say it is complex)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, tables, extra):
        q = self.proj(x)
        qc = torch.view_as_complex(q.reshape(*q.shape[:-1], -1, 2))
        rotated = torch.view_as_real(qc * tables[0]).flatten(-2)
        gain = extra["gain"]
        return rotated * gain.real.unsqueeze(-1) + gain.imag.unsqueeze(-1)


def _small():
    torch.manual_seed(0)
    model = RotaryWithInputs().eval()
    with torch.no_grad():
        model.proj.bias.uniform_(-0.5, 0.5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 8, generator=g)
    freqs, gain = _c(5, 4, g=g), _c(2, 5, g=g)
    return model, (x, (freqs,)), {"extra": {"gain": gain}}


def _small_expected(model, x, freqs, gain) -> np.ndarray:
    """float64 numpy complex arithmetic, from the user's complex tensors (no normexport code)."""
    w, b = model.proj.weight.detach().double().numpy(), model.proj.bias.detach().double().numpy()
    q = x.double().numpy() @ w.T + b
    qc = q[..., 0::2] + 1j * q[..., 1::2]
    r = qc * freqs.numpy().astype(np.complex128)
    rotated = np.stack([r.real, r.imag], axis=-1).reshape(*r.shape[:-1], -1)
    gz = gain.numpy().astype(np.complex128)
    return rotated * gz.real[..., None] + gz.imag[..., None]


def _small_file(model, args, kwargs):
    adapter = CallAdapter(model, args, kwargs)
    report: dict = {}
    proto = convert_module(adapter, adapter.example_inputs, input_names=adapter.input_names, target="onnx",
                           fold_bn=False, swap_norms=False, rewrite=False, report=report)
    return adapter, proto, report


def test_small_model_with_complex_inputs_exports_real_and_matches_float64():
    model, args, kwargs = _small()
    x, (freqs,), gain = args[0], args[1], kwargs["extra"]["gain"]
    with torch.no_grad():
        eager = model(*args, **kwargs).numpy()
    want = _small_expected(model, x, freqs, gain)
    assert np.abs(eager - want).max() < 1e-5 * np.abs(want).max()  # the formula is the model's
    adapter, proto, report = _small_file(model, args, kwargs)
    _no_complex(proto)
    assert _inputs(proto) == {"x": (onnx.TensorProto.FLOAT, [2, 5, 8]),
                              "tables.0": (onnx.TensorProto.FLOAT, [5, 4, 2]),
                              "extra.gain": (onnx.TensorProto.FLOAT, [2, 5, 2])}
    entry = [e for e in report["prepare"] if e.get("lowering") == "complex"]
    assert [e["action"] for e in entry] == ["swapped"], entry
    assert entry[0]["complex_inputs"] == ["tables.0 (complex64 5x4 -> float32 5x4x2)",
                                          "extra.gain (complex64 2x5 -> float32 2x5x2)"]
    from normexport.prepare.complex import summary_lines

    assert ("  complex inputs taken as real (re, im) pairs, a trailing axis of 2 (feed torch.view_as_real(x)): "
            "tables.0 (complex64 5x4 -> float32 5x4x2), extra.gain (complex64 2x5 -> float32 2x5x2)") \
        in summary_lines(report["prepare"])
    (got,) = _run(proto, {"x": x, "tables.0": torch.view_as_real(freqs), "extra.gain": torch.view_as_real(gain)})
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 2e-6, err
    # other values of the same shapes (the table is an input, not a constant of the file)
    g = torch.Generator().manual_seed(7)
    x2, f2, g2 = torch.randn(2, 5, 8, generator=g), _c(5, 4, g=g), _c(2, 5, g=g)
    (got2,) = _run(proto, {"x": x2, "tables.0": torch.view_as_real(f2), "extra.gain": torch.view_as_real(g2)})
    want2 = _small_expected(model, x2, f2, g2)
    assert np.abs(got2 - want2).max() < 2e-6 * np.abs(want2).max()


def test_parity_check_feeds_the_same_pairs_to_eager_and_onnxruntime():
    """normexport's parity check (eager = the adapter, which makes the pairs complex again; onnxruntime
    = the pairs) on the file: PASS, with the float64 reference available."""
    from normexport.parity import check

    model, args, kwargs = _small()
    adapter, proto, _ = _small_file(model, args, kwargs)
    result = check(proto, adapter, adapter.example_inputs, extra_shapes=0)
    assert result.passed, result.table()
    assert result.fp64_reference["available"], result.fp64_reference


# ---- the real model: diffusers LuminaNextDiT2DModel with the pipeline's complex RoPE table --------------
def _lumina(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    import normexport

    torch.manual_seed(0)
    model = diffusers.LuminaNextDiT2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2,
                                           num_attention_heads=2, num_kv_heads=1, multiple_of=16,
                                           cross_attention_dim=16, learn_sigma=True).eval()
    with torch.no_grad():  # random weights throughout (several are initialised to zero)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / "lumina")
    # as LuminaPipeline makes it (there 384 x 384 positions; a 16 x 16 table here, sliced to the 4 x 4
    # patches by the model's patch embedder as in the pipeline)
    rope = get_2d_rotary_pos_embed_lumina(model.head_dim, 16, 16, linear_factor=1.0, ntk_factor=1.0)
    assert rope.dtype == torch.complex64 and tuple(rope.shape) == (16, 16, 8)
    g = torch.Generator().manual_seed(1)
    kwargs = dict(hidden_states=torch.randn(2, 4, 8, 8, generator=g), timestep=torch.rand(2, generator=g),
                  encoder_hidden_states=torch.randn(2, 5, 16, generator=g),
                  encoder_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]), image_rotary_emb=rope,
                  cross_attention_kwargs={}, return_dict=False)
    with normexport.capture(model, tmp_path / "inputs.pt", quiet=True), torch.no_grad():
        eager = model(**kwargs)[0]
    return model, kwargs, eager


def test_lumina_next_folder_with_complex_rope_input_converts(cli, tmp_path):
    model, kwargs, eager = _lumina(tmp_path)
    out, rep_path = tmp_path / "l.onnx", tmp_path / "l.json"
    code, stdout, err = cli("convert", tmp_path / "lumina", "--inputs", tmp_path / "inputs.pt", "-o", out,
                            "--report", rep_path)
    assert code == 0, (stdout, err)
    assert ("complex inputs taken as real (re, im) pairs, a trailing axis of 2 (feed torch.view_as_real(x)): "
            "image_rotary_emb (complex64 16x16x8 -> float32 16x16x8x2)") in stdout, stdout
    assert "complex values carried as real (re, im) pairs: LuminaNextDiT2DModel (" in stdout, stdout
    rep = json.loads(rep_path.read_text())
    lowering = [e for e in rep["prepare"] if e.get("lowering") == "complex"]
    assert [e["action"] for e in lowering] == ["swapped"] and lowering[0]["max_rel_err"] <= 1e-5, lowering
    rows = [r for per in rep["results"]["ort"].values() for r in per]
    assert "PASSED" in stdout and rows and all(r["passed"] for r in rows), rows
    proto = onnx.load(str(out))
    _no_complex(proto)
    ins = _inputs(proto)
    assert ins["image_rotary_emb"] == (onnx.TensorProto.FLOAT, [16, 16, 8, 2]), ins
    # onnxruntime on view_as_real of the user's table vs the eager model called with the complex table
    feeds = {n: (torch.view_as_real(v) if v.dtype.is_complex else v) for n, v in kwargs.items()
             if isinstance(v, torch.Tensor)}
    assert set(feeds) == set(ins), (set(feeds), ins)
    (got,) = _run(out, feeds)
    want = eager.numpy()
    err = np.abs(got - want).max() / np.abs(want).max()
    assert np.abs(want).max() > 0.1 and err < 1e-5, err
    # and against float64 eager (complex128 table): the file's error within a few float32 roundings
    m64 = model.double()
    with torch.no_grad():
        want64 = m64(**{**kwargs, "hidden_states": kwargs["hidden_states"].double(),
                        "timestep": kwargs["timestep"].double(),
                        "encoder_hidden_states": kwargs["encoder_hidden_states"].double(),
                        "image_rotary_emb": kwargs["image_rotary_emb"].to(torch.complex128)})[0].numpy()
    assert np.abs(got - want64).max() < 1e-5 * np.abs(want64).max()


def test_pt2_with_a_complex_positional_input(cli, tmp_path):
    """A .pt2 whose program takes a complex RoPE table positionally: the file takes it as a
    (re, im) pair and matches the program fed the complex table (it failed with "Numpy_type 14"
    before: no call adapter was made for a plain positional tensor)."""
    import onnxruntime as ort

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x, rope):
            xc = torch.view_as_complex(self.lin(x).reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(xc * rope).flatten(-2)

    torch.manual_seed(0)
    m = M().eval()
    x, rope = torch.randn(2, 4, 16), torch.polar(torch.ones(4, 8), torch.randn(4, 8))
    torch.export.save(torch.export.export(m, (x, rope)), tmp_path / "c.pt2")
    code, out, err = cli("convert", tmp_path / "c.pt2", "-o", tmp_path / "c.onnx")
    assert code == 0, err
    sess = ort.InferenceSession(str(tmp_path / "c.onnx"))
    names = [i.name for i in sess.get_inputs()]
    got = sess.run(None, dict(zip(names, [x.numpy(), torch.view_as_real(rope).numpy()])))[0]
    want = m.double()(x.double(), rope.to(torch.complex128)).detach().numpy()
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max(), np.abs(got - want).max()
