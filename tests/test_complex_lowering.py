"""Complex arithmetic carried as real pairs (normexport.prepare.complex, docs/design.md §9, issue 22).

Each lowered call is checked against torch's own complex arithmetic in float64 on random values
(the Python API and the ATen overloads a torch.export graph calls); the spellings of complex rotary
embeddings on small modules (polar + view_as_complex, complex tables stored on the module, a
product split into .real / .imag); a call with no real form is named, the model left unchanged and
the export error repeats why; a wrong real form is refused by lower_complex's own check."""

from __future__ import annotations

import onnx
import pytest
import torch

from normexport.errors import ExportError
from normexport.export import convert_module
from normexport.prepare import complex as cx
from normexport.prepare import complex_calls as cc


def _c(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.complex(torch.randn(*shape, generator=g, dtype=torch.float64),
                         torch.randn(*shape, generator=g, dtype=torch.float64))


def _lowered(fn, *inputs):
    """fn run under RealComplexMode on the inputs (complex ones lifted to ComplexPairs); complex
    results turned back into complex tensors."""
    lifted = [cx.lift(x) if isinstance(x, torch.Tensor) and x.is_complex() else x for x in inputs]
    with cx.RealComplexMode():
        out = fn(*lifted)
    return cx.unpack(out)


def _same(got, want):
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
        return
    assert type(got) is torch.Tensor, type(got)  # no ComplexPair left over
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (got - want).abs().max()


A, B = _c(3, 4, 6, seed=1), _c(3, 4, 6, seed=2)
R = torch.randn(4, 6, dtype=torch.float64)
G = torch.randint(0, 4, (3, 2, 6), generator=torch.Generator().manual_seed(4))

CASES = {
    # producers
    "polar": (lambda r, t: torch.polar(r, t), R.abs(), R * 3),
    "view_as_complex": (lambda x: torch.view_as_complex(x), torch.randn(3, 5, 2, dtype=torch.float64)),
    "complex": (lambda a, b: torch.complex(a, b), R, R * 2),
    "to complex": (lambda x: x.to(torch.complex128), R),
    "real x 1j": (lambda x: torch.exp(1j * x), R),
    "zeros complex": (lambda x: torch.zeros(2, 3, dtype=x.dtype) + x[0, 0, :3], A),
    # consumers
    "view_as_real": (lambda a: torch.view_as_real(a), A),
    "real/imag": (lambda a: torch.stack([a.real, a.imag, torch.real(a), torch.imag(a)]), A),
    "abs/angle": (lambda a: torch.stack([a.abs(), torch.angle(a)]), A),
    # arithmetic
    "mul": (lambda a, b: a * b, A, B),
    "mul broadcast": (lambda a, b: a * b[:, 0, None, :], A, B),
    "mul real": (lambda a, r: (a * r, r * a, a * 2.5, 3 * a), A, R),
    "mul complex scalar": (lambda a: (a * (1 - 2j), (0.5 + 1j) * a), A),
    "add/sub": (lambda a, b, r: (a + b, a - b, a + r, r - a, 1 - a, torch.add(a, b, alpha=2), torch.sub(a, r)), A, B, R),
    "div": (lambda a, b, r: (a / b, a / r, a / 2.0, 2.0 / a), A, B, R),
    "matmul": (lambda a, b: (a @ b.transpose(-1, -2), torch.matmul(a, b[0].T), torch.bmm(a, b.mT)), A, B),
    "neg/conj": (lambda a: (-a, a.conj(), torch.conj(a).resolve_conj(), a.conj_physical()), A),
    "exp": (lambda a: torch.exp(a * 0.1), A),
    "sum/mean": (lambda a: (a.sum(-1), a.mean(dim=(0, 2), keepdim=True), a.sum()), A),
    "in place": (lambda a, b: (a.clone().mul_(b), a.clone().add_(b), a.clone().copy_(b)), A, B),
    # shapes
    "reshape/view": (lambda a: (a.reshape(12, 6), a.view(3, -1), a.reshape(*a.shape[:-1], 3, 2), a.view_as(a)), A),
    "flatten/unflatten": (lambda a: (a.flatten(1), a.flatten(-2), a.flatten(), a.unflatten(-1, (2, 3))), A),
    "unsqueeze/squeeze": (lambda a: (a[:, :, None, :], a.unsqueeze(-1), a.unsqueeze(0).squeeze(0), a[:1].squeeze()), A),
    "transpose/permute": (lambda a: (a.transpose(1, 2), a.transpose(-1, 0), a.permute(2, 0, 1), a.mT, a.movedim(0, -1)), A),
    "expand/repeat": (lambda a: (a[:, :1].expand(3, 5, 6), a[:, :1].expand(-1, 5, -1), a.repeat(2, 1, 1),
                                 a.repeat_interleave(2, dim=1), a[0].expand_as(a)), A),
    "flip/roll": (lambda a: (a.flip(-1), a.roll(1, -1)), A),
    "split": (lambda a: (a.split([2, 4], dim=-1), a.split(2, dim=1), torch.split(a, [1, 2], 0), a.chunk(2, -1),
                         a.unbind(1)), A),
    "cat/stack": (lambda a, b, r: (torch.cat([a, b], -1), torch.cat([a, b], 0), torch.stack([a, b], -1),
                                   torch.cat([a[0], r], -1)), A, B, R),
    "pad_sequence": (lambda a, b: (torch.nn.utils.rnn.pad_sequence([a[0], b[0, :2]], batch_first=True),
                                   torch.nn.utils.rnn.pad_sequence([a[0, :1], b[0]], padding_value=1.5)), A, B),
    # indexing
    "getitem": (lambda a: (a[0], a[..., 1], a[:, 1:3], a[..., None, :], a[a.real > 0], a[[0, 2]]), A),
    "gather/index_select": (lambda a, g: (a.gather(1, g), torch.gather(a, -2, g), a.index_select(-1, torch.tensor([5, 0]))),
                            A, G),
    "where/masked_fill": (lambda a, b: (torch.where(a.real > 0, a, b), a.masked_fill(a.imag > 0, 0)), A, B),
    "setitem": (lambda a, b: _setitem(a, b), A, B),
    "to/type_as": (lambda a, r: (a.to(torch.complex64).to(torch.complex128), (a * r).type_as(a), a.contiguous().clone()), A, R),
    "cast to real": (lambda a: a.float().double(), A),
}


def _setitem(a, b):
    z = torch.zeros_like(a)
    z[0, :2] = b[0, :2]
    z[..., -1] = a[..., 0]
    z[1] = 2.0
    return z


@pytest.mark.filterwarnings("ignore:Casting complex values to real")
@pytest.mark.parametrize("name", list(CASES))
def test_lowered_call_equals_complex_arithmetic(name):
    fn, *inputs = CASES[name]
    _same(_lowered(fn, *inputs), fn(*inputs))


def test_aten_overloads_of_a_torch_export_graph():
    """The ATen calls an ExportedProgram's module makes (Qwen-Image's .pt2: split_with_sizes of the
    complex table, slice, view, expand, cat, _to_copy, view_as_complex, mul, view_as_real)."""
    aten = torch.ops.aten

    def fn(table, x):
        parts = aten.split_with_sizes.default(table, [1, 2], 1)
        f = aten.slice.Tensor(parts[1], 0, 1, 4)
        f = aten.cat.default([aten.expand.default(aten.view.default(parts[0][:3], [3, 1]), [3, 2]), f], -1)
        f = aten._to_copy.default(f, dtype=torch.complex128)
        q = aten.view_as_complex.default(aten.view.default(x, [2, 3, 4, 2]))
        prod = aten.mul.Tensor(q, aten.unsqueeze.default(f, 0))
        return aten.view_as_real.default(aten.select.int(aten.index.Tensor(prod, [None, torch.tensor([2, 0])]), 0, 1))

    table, x = _c(5, 3, seed=3).to(torch.complex64), torch.randn(2, 3, 8, dtype=torch.float64)
    want = fn(table, x)
    got = _lowered(fn, table, x)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)


def test_metadata_reads_the_complex_view():
    z = cx.lift(A)
    assert isinstance(z, torch.Tensor) and type(z) is cx.ComplexPair
    with cx.RealComplexMode():
        assert z.shape == A.shape and z.dtype == torch.complex128 and z.dim() == 3 and z.is_complex()
        assert z.size(-1) == 6 and len(z) == 3 and z.numel() == A.numel() and z.ndim == 3


def test_unknown_complex_call_is_named():
    with pytest.raises(cx.ComplexNotLowered, match="'sqrt'"):
        _lowered(lambda a: torch.sqrt(a), A)
    with pytest.raises(cx.ComplexNotLowered, match="fft"):
        _lowered(lambda r: torch.fft.fft(r), R)  # complex values made from real ones by a call without a real form


# ---- models: the spellings ------------------------------------------------------------------------------
class PolarRoPE(torch.nn.Module):
    """Llama / Llama 4 / Qwen-Image spelling: torch.polar in the forward, view_as_complex of q."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(8, 8)

    def forward(self, x):
        pos = torch.arange(x.shape[1], dtype=torch.float32)
        freqs = torch.outer(pos, 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
        q = torch.view_as_complex(self.q(x).float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(q * freqs_cis[None]).flatten(2).type_as(x)


class TableRoPE(torch.nn.Module):
    """Lumina2 / DeepSeek spelling: complex tables stored on the module (a buffer and a list),
    gathered by position ids."""

    def __init__(self):
        super().__init__()
        angles = torch.outer(torch.arange(16, dtype=torch.float64), torch.rand(2, dtype=torch.float64) + 0.1)
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles), persistent=False)  # complex128
        self.tables = [torch.polar(torch.ones(16, 2), torch.rand(16, 2) * 3)]  # complex64, plain attribute
        self.q = torch.nn.Linear(8, 8)

    def forward(self, x, ids):
        f = torch.cat([self.freqs[ids].to(torch.complex64), self.tables[0][ids]], dim=-1)  # [B, S, 4]
        q = torch.view_as_complex(self.q(x).reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(q * f).flatten(2)


class RealImagRoPE(torch.nn.Module):
    """AnyFlow-FAR spelling: the product split into .real / .imag, recombined by hand."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(8, 8)

    def forward(self, x):
        angles = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * torch.linspace(0.1, 1, 4)
        rot = torch.exp(1j * angles)
        q = torch.complex(*self.q(x).unflatten(-1, (-1, 2)).unbind(-1))
        p = q * rot
        return torch.cat([p.real, p.imag], dim=-1) + p.abs().repeat(1, 1, 2)


SPELLINGS = {
    "polar": (PolarRoPE, lambda: (torch.randn(2, 5, 8),)),
    "tables": (TableRoPE, lambda: (torch.randn(2, 5, 8), torch.randint(0, 16, (2, 5)))),
    "real/imag": (RealImagRoPE, lambda: (torch.randn(2, 5, 8),)),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_each_spelling_exports_without_complex_and_matches_float64(spelling):
    """The lowered model exports (dynamo exporter) to a file with no complex type anywhere, whose
    onnxruntime output matches the original eager model in float64."""
    import onnxruntime as ort

    cls, make = SPELLINGS[spelling]
    torch.manual_seed(0)
    model, args = cls().eval(), make()
    report: list = []
    new = cx.lower_complex(model, args, report)
    assert new is not model and [e["action"] for e in report] == ["swapped"], report
    assert report[0]["op"] == "ComplexAsReal" and report[0]["max_rel_err"] <= 1e-5
    proto = convert_module(model, args, target="onnx", fold_bn=False, swap_norms=False, rewrite=False)
    types_ = [v.type.tensor_type.elem_type for v in list(proto.graph.value_info) + list(proto.graph.input)
              + list(proto.graph.output)] + [t.data_type for t in proto.graph.initializer]
    assert not {onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128} & set(types_)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)})[0]
    with torch.no_grad():
        ref = model.double()(*[a.double() if a.is_floating_point() else a for a in args]).numpy()
    assert abs(got - ref).max() <= 1e-5 * abs(ref).max(), abs(got - ref).max()


def test_without_the_lowering_the_spellings_do_not_export(monkeypatch):
    """The mechanism is what makes them export: with lower_complex a no-op, the export fails."""
    monkeypatch.setattr(cx, "lower_complex", lambda module, args, report=None: module)
    with pytest.raises(ExportError, match="complex|ComplexDouble|Complex"):
        convert_module(PolarRoPE().eval(), (torch.randn(2, 5, 8),), target="onnx", fold_bn=False, swap_norms=False,
                       rewrite=False)


def test_wrong_real_form_is_refused(monkeypatch):
    """A planted error in the real product (the sign of b*d) is caught by lower_complex's own
    comparison with the original: the model is returned unchanged, the report says why."""
    real_mul = cc._binary

    def wrong(name, x, y, alpha=None):
        if name == "mul" and cc.is_complex_value(x) and cc.is_complex_value(y):
            (a, b), (c, d) = cc._parts(x), cc._parts(y)
            return cc._join(a * c + b * d, a * d + b * c)
        return real_mul(name, x, y, alpha)

    monkeypatch.setattr(cc, "_binary", wrong)
    model, report = PolarRoPE().eval(), []
    assert cx.lower_complex(model, (torch.randn(2, 5, 8),), report) is model
    assert [e["action"] for e in report] == ["note"] and report[0]["max_rel_err"] > 1e-5, report
    assert "outputs differ" in report[0]["reason"]


class Unlowered(torch.nn.Module):
    def forward(self, x):
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(torch.sqrt(z).unsqueeze(0)).flatten(-2)


def test_unlowered_call_is_reported_and_named_in_the_export_error():
    model, args, report = Unlowered().eval(), (torch.randn(2, 4, 4),), []
    assert cx.lower_complex(model, args, report) is model
    assert [e["action"] for e in report] == ["note"] and "'sqrt'" in report[0]["reason"], report
    with pytest.raises(ExportError, match="complex arithmetic left complex .*'sqrt'"):
        convert_module(model, args, target="onnx", fold_bn=False, swap_norms=False, rewrite=False)


def test_real_model_is_left_alone_without_a_run():
    """No complex tensor stored, no complex name in the code of its classes: no run, no report."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert not cx.may_use_complex(model)
    report: list = []
    assert cx.lower_complex(model, (torch.randn(2, 4),), report) is model and report == []
