"""The real forms of complex calls: `ComplexPair` and `RealComplexMode` (docs/design.md §9).

A `ComplexPair` is a tensor subclass that reports a complex tensor's shape and dtype and holds its
values as a real tensor `re_im` of shape [..., 2] (view_as_real's layout). While `RealComplexMode`
is active, every torch call is seen first by it:

* calls that make complex values from real ones (`torch.polar`, `view_as_complex`, `torch.complex`,
  `.to(complex dtype)`, factories with a complex `dtype`, a real tensor times a Python complex
  number) return a ComplexPair computed with real ops;
* calls that take a ComplexPair (or a complex tensor, lifted to one) are computed on `re_im` with
  real ops: arithmetic (mul / add / sub / div / matmul / neg / conj / exp / abs / angle / real /
  imag / sum / mean, in-place forms), reshapes and views (reshape / view / flatten / unflatten /
  (un)squeeze / transpose / permute / expand / repeat / flip / roll / contiguous / clone / to /
  type_as), indexing (getitem / setitem / index / slice / select / narrow / gather / index_select /
  where / masked_fill), splits and joins (split / split_with_sizes / chunk / unbind / cat / stack),
  `view_as_real`; metadata calls (shape, dtype, size, dim, ...) read the ComplexPair's own complex
  metadata;
* a call with no real form raises `ComplexNotLowered` naming it, as does any call that makes a
  complex tensor from real inputs by other means (an FFT): nothing complex reaches the exporters.

Calls are recognised by name, so the Python API (`torch.mul`, `Tensor.__mul__`, ...) and the ATen
overloads of a torch.export graph (`aten.mul.Tensor`, `aten.split_with_sizes.default`, ...) take the
same real form. The model side (which models, stored tables, the check) is `complex.py`.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_COMPLEX_OF = {torch.float16: torch.complex32, torch.float32: torch.complex64, torch.float64: torch.complex128}
_REAL_OF = {v: k for k, v in _COMPLEX_OF.items()}


class ComplexNotLowered(RuntimeError):
    """A torch call on complex values that this module has no real form for."""


# ---- the carrier -------------------------------------------------------------------------------------
class ComplexPair(torch.Tensor):
    """A complex tensor of shape S carried as the real tensor `re_im` of shape S + (2,)."""

    re_im: torch.Tensor

    @staticmethod
    def __new__(cls, re_im: torch.Tensor):
        if re_im.dtype not in _COMPLEX_OF:
            re_im = re_im.float()  # bfloat16 / integers: torch has no complex form of them either
        shape = re_im.shape[:-1]
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=_COMPLEX_OF[re_im.dtype], device=re_im.device,
                                                requires_grad=False)
        t.re_im = re_im
        return t

    def __init__(self, re_im):  # noqa: D107 (all done in __new__)
        pass

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _lowered(func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise ComplexNotLowered(f"complex '{func}' reached the dispatcher without a real form")


def is_complex_value(v) -> bool:
    return isinstance(v, ComplexPair) or (isinstance(v, torch.Tensor) and v.dtype.is_complex)


def _is_concrete(t: torch.Tensor) -> bool:
    """A real tensor with data (not a fake / functional one being traced)."""
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(t) and type(t) in (torch.Tensor, nn.Parameter, nn.Buffer)


def lift(z) -> ComplexPair:
    """A complex tensor as a ComplexPair (a concrete one, e.g. a table or a cached value, as a real
    constant computed outside any tracing)."""
    if isinstance(z, ComplexPair):
        return z
    with torch._C.DisableTorchFunctionSubclass():
        if _is_concrete(z):
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes(), torch._C.DisableTorchFunction():
                return ComplexPair(torch.view_as_real(z.detach().resolve_conj()).clone())
        return ComplexPair(torch.view_as_real(z.resolve_conj()))


def pack(z: torch.Tensor) -> ComplexPair:
    """A stored complex table as a ComplexPair constant (complex128 as float32 pairs)."""
    with torch._C.DisableTorchFunctionSubclass(), torch._C.DisableTorchFunction():
        re_im = torch.view_as_real(z.detach().resolve_conj()).clone()
        return ComplexPair(re_im.float() if re_im.dtype == torch.float64 else re_im)


def map_nested(leaf, v):
    """`leaf` on each value nested in lists / tuples / dicts of `v`, in containers of the same types (a dict
    subclass: a dict); a namedtuple is a leaf."""
    if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
        return type(v)(map_nested(leaf, x) for x in v)
    if isinstance(v, dict):
        return {k: map_nested(leaf, x) for k, x in v.items()}
    return leaf(v)


def _unpacked(v):
    if isinstance(v, ComplexPair):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.view_as_complex(v.re_im.contiguous())
    return v


def unpack(v):
    """ComplexPairs (nested in lists / tuples / dicts) back as complex tensors (for checks)."""
    return map_nested(_unpacked, v)


# ---- call names and arguments ----------------------------------------------------------------------------
def op_name(func) -> str:
    """'mul' for torch.mul, Tensor.mul, Tensor.__mul__ and aten.mul.Tensor; 'shape' for Tensor.shape;
    'mul_' for the in-place forms."""
    if isinstance(func, torch._ops.OpOverload):
        return func._overloadpacket.__name__
    name = getattr(func, "__name__", "") or ""
    if name in ("__get__", "__set__"):
        owner = getattr(getattr(func, "__self__", None), "__name__", "")
        return owner if name == "__get__" else owner + "="
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        name = name[2:-2]
        if name.startswith("i") and name[1:] in _BINARY:  # __imul__ -> mul_
            return name[1:] + "_"
    return name


_BINARY = {"add", "sub", "mul", "truediv", "div"}


def _get(args, kwargs, i, names, default=None):
    if len(args) > i:
        return args[i]
    for n in names if isinstance(names, (tuple, list)) else (names,):
        if n in kwargs:
            return kwargs[n]
    return default


def _sizes(args, start, kwargs, name="size"):
    """Varargs or one sequence: reshape(2, 3) / reshape((2, 3)) / view(size=...)."""
    rest = args[start:]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        return list(rest[0])
    if not rest:
        v = kwargs.get(name, kwargs.get("shape", kwargs.get("dims", ())))
        return list(v) if isinstance(v, (tuple, list, torch.Size)) else [v]
    return list(rest)


def _nd(z: ComplexPair) -> int:
    return z.re_im.dim() - 1


def _dim(d, nd: int) -> int:
    return d + nd if d < 0 else d


def _pair_index(idx):
    """An index on a complex tensor as the index on its re_im (the pair axis kept)."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    idx = tuple(lift(i).re_im if is_complex_value(i) else i for i in idx)
    return idx + (slice(None),) if any(i is Ellipsis for i in idx) else idx + (Ellipsis, slice(None))


# ---- components: (re, im) of any operand ---------------------------------------------------------------
def _parts(v):
    """(re, im) of an operand: a ComplexPair or complex tensor, a real tensor / number (im None), a
    Python complex number."""
    if is_complex_value(v):
        r = lift(v).re_im
        return r[..., 0], r[..., 1]
    if isinstance(v, complex):
        return v.real, v.imag
    return v, None


def _join(re, im) -> ComplexPair:
    if im is None:
        im = torch.zeros_like(re) if isinstance(re, torch.Tensor) else 0.0
    if not isinstance(re, torch.Tensor):
        re = torch.full_like(im, re) if isinstance(im, torch.Tensor) else torch.tensor(float(re))
    if not isinstance(im, torch.Tensor):
        im = torch.full_like(re, im)
    if re.shape != im.shape or re.dtype != im.dtype:
        dt = torch.promote_types(re.dtype, im.dtype)
        re, im = torch.broadcast_tensors(re.to(dt), im.to(dt))
    return ComplexPair(torch.stack([re, im], dim=-1))


def _add(a, b):
    return None if a is None and b is None else a if b is None else b if a is None else a + b


def _sub(a, b):
    return None if a is None and b is None else a if b is None else -b if a is None else a - b


def _mul(a, b):
    return None if a is None or b is None else a * b


def _binary(name, x, y, alpha=None):
    if alpha is not None and alpha != 1:
        y = _binary("mul", y, alpha)
    (a, b), (c, d) = _parts(x), _parts(y)
    if name == "add":
        return _join(_add(a, c), _add(b, d))
    if name == "sub":
        return _join(_sub(a, c), _sub(b, d))
    if name == "mul":
        return _join(_sub(_mul(a, c), _mul(b, d)), _add(_mul(a, d), _mul(b, c)))
    if name in ("div", "truediv"):
        if d is None:  # by a real value
            return _join(a / c, None if b is None else b / c)
        den = c * c + d * d
        return _join(_add(_mul(a, c), _mul(b, d)) / den, _sub(_mul(b, c), _mul(a, d)) / den)
    raise ComplexNotLowered(name)


# ---- handlers ------------------------------------------------------------------------------------------
_H: dict[str, Callable] = {}


def _handles(*names):
    def reg(fn):
        for n in names:
            _H[n] = fn
        return fn
    return reg


@_handles("polar")
def _polar(name, args, kwargs):
    r, theta = _get(args, kwargs, 0, "abs"), _get(args, kwargs, 1, "angle")
    return _join(r * torch.cos(theta), r * torch.sin(theta))


@_handles("complex")
def _complex(name, args, kwargs):
    return _join(_get(args, kwargs, 0, "real"), _get(args, kwargs, 1, "imag"))


@_handles("view_as_complex")
def _view_as_complex(name, args, kwargs):
    x = _get(args, kwargs, 0, ("input", "self"))
    if is_complex_value(x):
        raise ComplexNotLowered("view_as_complex of a complex tensor")
    return ComplexPair(x)


@_handles("view_as_real")
def _view_as_real(name, args, kwargs):
    return lift(_get(args, kwargs, 0, ("input", "self"))).re_im


@_handles("real", "imag")
def _real_imag(name, args, kwargs):
    x = _get(args, kwargs, 0, ("input", "self"))
    return lift(x).re_im[..., 0 if name == "real" else 1] if is_complex_value(x) else (
        x if name == "real" else torch.zeros_like(x))


@_handles("abs", "absolute")
def _abs(name, args, kwargs):
    r = lift(_get(args, kwargs, 0, ("input", "self"))).re_im
    return torch.sqrt(r[..., 0] * r[..., 0] + r[..., 1] * r[..., 1])


@_handles("angle")
def _angle(name, args, kwargs):
    r = lift(_get(args, kwargs, 0, ("input", "self"))).re_im
    return torch.atan2(r[..., 1], r[..., 0])


@_handles("conj", "conj_physical", "_conj", "_conj_physical")
def _conj(name, args, kwargs):
    r = lift(_get(args, kwargs, 0, ("input", "self"))).re_im
    return _join(r[..., 0], -r[..., 1])


@_handles("resolve_conj", "resolve_neg", "contiguous", "clone", "detach", "alias", "lift_fresh", "lift_fresh_copy",
          "positive", "clone_", "requires_grad_", "cpu", "cuda")
def _same(name, args, kwargs):
    z = lift(_get(args, kwargs, 0, ("input", "self")))
    if name in ("contiguous", "clone"):
        return ComplexPair(z.re_im.contiguous() if name == "contiguous" else z.re_im.clone())
    if name in ("cpu", "cuda"):
        return ComplexPair(getattr(z.re_im, name)())
    return z


@_handles("neg", "negative", "_neg_view")
def _neg(name, args, kwargs):
    return ComplexPair(-lift(_get(args, kwargs, 0, ("input", "self"))).re_im)


@_handles("add", "sub", "mul", "div", "truediv", "true_divide", "multiply", "subtract", "divide", "radd", "rsub",
          "rmul", "rtruediv", "rdiv")
def _arith(name, args, kwargs):
    x, y = _get(args, kwargs, 0, ("input", "self")), _get(args, kwargs, 1, "other")
    if kwargs.get("rounding_mode") is not None:
        raise ComplexNotLowered(f"{name} with rounding_mode")
    base = {"multiply": "mul", "subtract": "sub", "divide": "div", "true_divide": "div", "truediv": "div",
            "radd": "add", "rmul": "mul", "rsub": "sub", "rtruediv": "div", "rdiv": "div"}.get(name, name)
    if name.startswith("r") and name not in ("rdiv",) or name == "rdiv":  # reflected: y op x
        x, y = y, x
    return _binary(base, x, y, kwargs.get("alpha", _get(args, {}, 2, ())))


@_handles("exp")
def _exp(name, args, kwargs):
    r = lift(_get(args, kwargs, 0, ("input", "self"))).re_im
    m = torch.exp(r[..., 0])
    return _join(m * torch.cos(r[..., 1]), m * torch.sin(r[..., 1]))


@_handles("sum", "mean")
def _reduce(name, args, kwargs):
    z = lift(_get(args, kwargs, 0, ("input", "self")))
    dim = _get(args, kwargs, 1, "dim")
    keep = _get(args, kwargs, 2, "keepdim", False)
    if kwargs.get("dtype") is not None:
        raise ComplexNotLowered(f"{name} with dtype")
    nd = _nd(z)
    dims = tuple(range(nd)) if dim is None else tuple(_dim(d, nd) for d in (dim if isinstance(dim, (list, tuple)) else [dim]))
    return ComplexPair(getattr(torch, name)(z.re_im, dim=dims, keepdim=keep))


# -- shapes
@_handles("reshape", "view", "_unsafe_view", "_reshape_alias", "view_copy")
def _reshape(name, args, kwargs):
    z = lift(args[0])
    sizes = _sizes(args, 1, kwargs)
    if len(sizes) == 1 and isinstance(sizes[0], torch.dtype):
        raise ComplexNotLowered(f"{name} as dtype {sizes[0]}")
    return ComplexPair(z.re_im.reshape(*sizes, 2))


@_handles("reshape_as", "view_as")
def _reshape_as(name, args, kwargs):
    z, other = lift(args[0]), _get(args, kwargs, 1, "other")
    return ComplexPair(z.re_im.reshape(*other.shape, 2))


@_handles("flatten")
def _flatten(name, args, kwargs):
    z = lift(args[0])
    nd = _nd(z)
    s, e = _dim(_get(args, kwargs, 1, "start_dim", 0), nd), _dim(_get(args, kwargs, 2, "end_dim", -1), nd)
    if nd == 0:
        return ComplexPair(z.re_im.reshape(1, 2))
    return ComplexPair(z.re_im.flatten(s, e))


def _along_dim(fn, *rest, new_dim: bool = False, default_dim=None):
    """The handler of a call `(self, dim, *rest)` that works along one dim, e.g. select(self, dim,
    index): `fn(re_im, dim, *rest)` with dim counted among the complex dims (new_dim: among those of
    the result, which has one more) and the pair axis left last. `rest`: the names of the further
    arguments, or (name, default)."""
    def handler(name, args, kwargs):
        z = lift(args[0])
        dim = _dim(_get(args, kwargs, 1, "dim", default_dim), _nd(z) + new_dim)
        more = [_get(args, kwargs, 2 + i, *(r if isinstance(r, tuple) else (r,))) for i, r in enumerate(rest)]
        return ComplexPair(fn(z.re_im, dim, *more))
    return handler


_H["unflatten"] = _along_dim(torch.Tensor.unflatten, "sizes")
_H["unsqueeze"] = _along_dim(torch.Tensor.unsqueeze, new_dim=True)
_H["select"] = _along_dim(torch.Tensor.select, "index")
_H["narrow"] = _along_dim(torch.Tensor.narrow, "start", "length")
_H["index_select"] = _along_dim(torch.Tensor.index_select, "index")
# aten.slice.Tensor(self, dim=0, start=None, end=None, step=1)
_H["slice"] = _along_dim(torch.ops.aten.slice.Tensor, "start", "end", ("step", 1), default_dim=0)


@_handles("squeeze")
def _squeeze(name, args, kwargs):
    z = lift(args[0])
    nd = _nd(z)
    dim = _get(args, kwargs, 1, "dim")
    if dim is None:
        dims = [i for i in range(nd) if z.re_im.shape[i] == 1]
    else:
        dims = [_dim(d, nd) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
    return ComplexPair(z.re_im.squeeze(tuple(dims)) if dims else z.re_im)


@_handles("transpose", "swapaxes", "swapdims")
def _transpose(name, args, kwargs):
    z = lift(args[0])
    nd = _nd(z)
    return ComplexPair(z.re_im.transpose(_dim(_get(args, kwargs, 1, "dim0"), nd), _dim(_get(args, kwargs, 2, "dim1"), nd)))


@_handles("t", "T", "mT")
def _t(name, args, kwargs):
    z = lift(args[0])
    nd = _nd(z)
    if name == "T":
        return ComplexPair(z.re_im.permute(*reversed(range(nd)), nd))
    return ComplexPair(z.re_im.transpose(nd - 2, nd - 1) if nd >= 2 else z.re_im)


@_handles("permute")
def _permute(name, args, kwargs):
    z = lift(args[0])
    nd = _nd(z)
    return ComplexPair(z.re_im.permute(*[_dim(d, nd) for d in _sizes(args, 1, kwargs, "dims")], nd))


@_handles("movedim", "moveaxis")
def _movedim(name, args, kwargs):
    z = lift(args[0])
    nd = _nd(z)
    src, dst = _get(args, kwargs, 1, "source"), _get(args, kwargs, 2, "destination")
    norm = (lambda v: [_dim(d, nd) for d in v] if isinstance(v, (list, tuple)) else _dim(v, nd))
    return ComplexPair(z.re_im.movedim(norm(src), norm(dst)))


@_handles("expand")
def _expand(name, args, kwargs):
    z = lift(args[0])
    return ComplexPair(z.re_im.expand(*_sizes(args, 1, kwargs), 2))


@_handles("expand_as")
def _expand_as(name, args, kwargs):
    z = lift(args[0])
    return ComplexPair(z.re_im.expand(*_get(args, kwargs, 1, "other").shape, 2))


@_handles("broadcast_to")
def _broadcast_to(name, args, kwargs):
    z = lift(args[0])
    return ComplexPair(z.re_im.expand(*_get(args, kwargs, 1, ("size", "shape")), 2))


@_handles("repeat")
def _repeat(name, args, kwargs):
    z = lift(args[0])
    return ComplexPair(z.re_im.repeat(*_sizes(args, 1, kwargs, "repeats"), 1))


@_handles("repeat_interleave")
def _repeat_interleave(name, args, kwargs):
    z = lift(args[0])
    dim = _get(args, kwargs, 2, "dim")
    if dim is None:
        raise ComplexNotLowered("repeat_interleave without dim")
    return ComplexPair(z.re_im.repeat_interleave(_get(args, kwargs, 1, "repeats"), dim=_dim(dim, _nd(z))))


@_handles("flip")
def _flip(name, args, kwargs):
    z = lift(args[0])
    nd = _nd(z)
    return ComplexPair(z.re_im.flip([_dim(d, nd) for d in _sizes(args, 1, kwargs, "dims")]))


@_handles("roll")
def _roll(name, args, kwargs):
    z = lift(args[0])
    nd = _nd(z)
    dims = _get(args, kwargs, 2, "dims")
    if dims is None or dims == []:
        raise ComplexNotLowered("roll without dims")
    dims = [_dim(d, nd) for d in dims] if isinstance(dims, (list, tuple)) else _dim(dims, nd)
    return ComplexPair(z.re_im.roll(_get(args, kwargs, 1, "shifts"), dims))


# -- splits and joins
@_handles("split", "split_with_sizes", "tensor_split")
def _split(name, args, kwargs):
    z = lift(args[0])
    sizes = _get(args, kwargs, 1, ("split_size_or_sections", "split_size", "split_sizes", "sections", "indices"))
    dim = _dim(_get(args, kwargs, 2, "dim", 0), _nd(z))
    parts = getattr(z.re_im, name if name != "split_with_sizes" else "split")(sizes, dim)
    return tuple(ComplexPair(p) for p in parts)


@_handles("chunk")
def _chunk(name, args, kwargs):
    z = lift(args[0])
    return tuple(ComplexPair(p) for p in z.re_im.chunk(_get(args, kwargs, 1, "chunks"),
                                                       _dim(_get(args, kwargs, 2, "dim", 0), _nd(z))))


@_handles("unbind")
def _unbind(name, args, kwargs):
    z = lift(args[0])
    return tuple(ComplexPair(p) for p in z.re_im.unbind(_dim(_get(args, kwargs, 1, "dim", 0), _nd(z))))


@_handles("iter")
def _iter(name, args, kwargs):
    return iter(_unbind("unbind", args[:1], {}))


def _as_pairs(tensors):
    return [lift(t) if is_complex_value(t) else _join(t, None) for t in tensors]


@_handles("cat", "concat", "concatenate")
def _cat(name, args, kwargs):
    zs = _as_pairs(_get(args, kwargs, 0, "tensors"))
    dim = _get(args, kwargs, 1, ("dim", "axis"), 0)
    nd = _nd(zs[0])
    return ComplexPair(torch.cat([z.re_im for z in zs], dim=_dim(dim, nd)))


@_handles("stack")
def _stack(name, args, kwargs):
    zs = _as_pairs(_get(args, kwargs, 0, "tensors"))
    return ComplexPair(torch.stack([z.re_im for z in zs], dim=_dim(_get(args, kwargs, 1, "dim", 0), _nd(zs[0]) + 1)))


@_handles("pad_sequence")
def _pad_sequence(name, args, kwargs):
    zs = _as_pairs(_get(args, kwargs, 0, "sequences"))
    first = _get(args, kwargs, 1, "batch_first", False)
    value = _get(args, kwargs, 2, "padding_value", 0.0)
    side = _get(args, kwargs, 3, "padding_side", "right")
    pad = torch.nn.utils.rnn.pad_sequence
    if value == 0:
        return ComplexPair(pad([z.re_im for z in zs], first, 0.0, side))
    re, im = _parts(value)
    return _join(pad([z.re_im[..., 0] for z in zs], first, float(re), side),
                 pad([z.re_im[..., 1] for z in zs], first, float(im or 0.0), side))


# -- indexing
@_handles("getitem")
def _getitem(name, args, kwargs):
    return ComplexPair(lift(args[0]).re_im[_pair_index(args[1])])


@_handles("setitem")
def _setitem(name, args, kwargs):
    z, idx, v = args
    if not isinstance(z, ComplexPair):
        raise ComplexNotLowered("setitem of complex values into a real tensor")
    z.re_im[_pair_index(idx)] = _value_pair(v, z)
    return None


def _value_pair(v, like: ComplexPair):
    re, im = _parts(v)
    if not isinstance(re, torch.Tensor):
        return torch.tensor([float(re), float(im or 0.0)], dtype=like.re_im.dtype, device=like.re_im.device)
    return _join(re, im).re_im


@_handles("index")
def _index(name, args, kwargs):  # aten.index.Tensor(self, indices): indices on the leading axes
    return ComplexPair(torch.ops.aten.index.Tensor(lift(args[0]).re_im, _get(args, kwargs, 1, "indices")))


@_handles("gather")
def _gather(name, args, kwargs):
    z = lift(args[0])
    idx = _get(args, kwargs, 2, "index")
    return ComplexPair(z.re_im.gather(_dim(_get(args, kwargs, 1, "dim"), _nd(z)), idx.unsqueeze(-1).expand(*idx.shape, 2)))


@_handles("where")
def _where(name, args, kwargs):
    cond, x, y = _get(args, kwargs, 0, "condition"), _get(args, kwargs, 1, ("input", "self")), _get(args, kwargs, 2, "other")
    (a, b), (c, d) = _parts(x), _parts(y)
    b = torch.zeros_like(a) if b is None and isinstance(a, torch.Tensor) else (0.0 if b is None else b)
    d = torch.zeros_like(c) if d is None and isinstance(c, torch.Tensor) else (0.0 if d is None else d)
    return _join(torch.where(cond, a, c), torch.where(cond, b, d))


@_handles("masked_fill")
def _masked_fill(name, args, kwargs):
    z, mask, v = lift(args[0]), _get(args, kwargs, 1, "mask"), _get(args, kwargs, 2, "value")
    return _where("where", (mask, v, z), {})


@_handles("matmul", "mm", "bmm")
def _matmul(name, args, kwargs):
    (a, b), (c, d) = _parts(_get(args, kwargs, 0, ("input", "self"))), _parts(_get(args, kwargs, 1, ("other", "mat2")))
    mm = getattr(torch, name)
    return _join(_sub(_mm(mm, a, c), _mm(mm, b, d)), _add(_mm(mm, a, d), _mm(mm, b, c)))


def _mm(mm, a, b):
    return None if a is None or b is None else mm(a, b)


# -- dtype, device, factories
def _to_target(args, kwargs):
    """(dtype, device) asked by to(...) / _to_copy(...) / type(...) / type_as(other)."""
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (torch.device, str)) and not (isinstance(a, str) and a.startswith("torch.")):
            device = a
        elif isinstance(a, torch.Tensor):
            dtype, device = a.dtype, a.device
    if isinstance(kwargs.get("other"), torch.Tensor):
        dtype, device = kwargs["other"].dtype, kwargs["other"].device
    return dtype, device


def _cast(x, dtype, device):
    if is_complex_value(x):
        r = lift(x).re_im
        if device is not None:
            r = r.to(device)
        if dtype is None:
            return ComplexPair(r)
        if dtype.is_complex:
            return ComplexPair(r.to(_REAL_OF[dtype]))
        return r[..., 0].to(dtype)  # torch: a complex to real cast discards the imaginary part
    if device is not None:
        x = x.to(device)
    return _join(x.to(_REAL_OF[dtype]), None) if dtype is not None and dtype.is_complex else (
        x.to(dtype) if dtype is not None else x)


@_handles("to", "_to_copy", "type", "type_as")
def _to(name, args, kwargs):
    x = _get(args, kwargs, 0, ("input", "self"))
    if name == "type" and len(args) < 2 and "dtype" not in kwargs:
        raise ComplexNotLowered("type() as a string")
    return _cast(x, *_to_target(args, kwargs))


@_handles("float", "double", "half")
def _float(name, args, kwargs):
    return _cast(args[0], {"float": torch.float32, "double": torch.float64, "half": torch.float16}[name], None)


@_handles("cfloat", "cdouble")
def _cfloat(name, args, kwargs):
    return _cast(args[0], torch.complex64 if name == "cfloat" else torch.complex128, None)


_FILL = {"zeros": 0.0, "ones": 1.0, "empty": 0.0}


@_handles("zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like", "full_like", "new_zeros",
          "new_ones", "new_empty", "new_full", "randn", "rand")
def _factory(name, args, kwargs):
    if name in ("randn", "rand"):
        raise ComplexNotLowered(f"{name} with a complex dtype")
    like = None
    if name.endswith("_like") or name.startswith("new_"):
        like, args = args[0], args[1:]
    base = name.replace("_like", "").replace("new_", "")
    if base == "full":
        fill = args[-1] if name.endswith("_like") else (args[1] if len(args) > 1 else kwargs.get("fill_value"))
        args = args[:1] if not name.endswith("_like") else ()
    else:
        fill = _FILL[base]
    dtype = kwargs.get("dtype") or (like.dtype if like is not None else None)
    device = kwargs.get("device") or (like.device if like is not None else None)
    sizes = list(like.shape) if name.endswith("_like") else _sizes(args, 0, kwargs)
    if dtype is None or not dtype.is_complex:
        raise ComplexNotLowered(f"{name} of a complex tensor with dtype {dtype}")
    re, im = (fill.real, fill.imag) if isinstance(fill, complex) else (fill, 0.0)
    r = torch.empty(*sizes, 2, dtype=_REAL_OF[dtype], device=device)
    r[..., 0], r[..., 1] = re, im
    return ComplexPair(r)


# -- in place
def _inplace(name, args, kwargs):
    z = args[0]
    if not isinstance(z, ComplexPair):
        raise ComplexNotLowered(f"{name} of complex values into a real tensor")
    base = name[:-1]
    if base == "copy":
        z.re_im.copy_(_value_pair(_get(args, kwargs, 1, "src"), z).expand_as(z.re_im))
    elif base == "zero":
        z.re_im.zero_()
    elif base == "fill":
        z.re_im.copy_(_value_pair(_get(args, kwargs, 1, "value"), z).expand_as(z.re_im))
    elif base in _H:
        z.re_im.copy_(lift(_H[base](base, args, kwargs)).re_im)
    else:
        raise ComplexNotLowered(name)
    return z


#: calls that read a ComplexPair's own (complex) metadata
_META = {"shape", "dtype", "device", "size", "dim", "ndim", "ndimension", "numel", "nelement", "is_complex",
         "is_floating_point", "len", "requires_grad", "layout", "is_cuda", "is_cpu", "is_meta", "element_size",
         "is_contiguous", "stride", "hash", "names", "is_sparse", "is_quantized", "is_nested", "is_leaf", "grad_fn",
         "grad", "output_nr", "_version", "is_inference", "storage_offset", "get_device", "dim_order",
         "is_mkldnn", "is_xpu", "is_mps", "_is_view", "__class__"}


@_handles("_assert_tensor_metadata", "_assert_async", "sym_constrain_range_for_size")
def _assertion(name, args, kwargs):  # a check of the graph's own metadata, which the ComplexPair reports
    return None


@_handles("repr", "str", "format")
def _repr(name, args, kwargs):
    return f"ComplexPair(shape={list(args[0].re_im.shape[:-1])}, re_im={args[0].re_im!r})"


@_handles("deepcopy", "reduce_ex")
def _deepcopy(name, args, kwargs):
    if name == "reduce_ex":
        raise ComplexNotLowered("pickling a ComplexPair")
    return args[0]  # a constant table: shared, like the weights (docs/design.md §8)


# ---- the mode --------------------------------------------------------------------------------------------
PRODUCERS = {"polar", "view_as_complex", "complex"}

#: Counters of the lowered calls of the runs `lower_complex` checks
_ACTIVE_COUNTS: list[Counter] = []


def _involves(v) -> bool:
    if isinstance(v, torch.Tensor):
        return type(v) is ComplexPair or v.dtype.is_complex
    if isinstance(v, (list, tuple)):
        return any(_involves(x) for x in v)
    return isinstance(v, complex) or (isinstance(v, torch.dtype) and v.is_complex)


def _lowered(func, args, kwargs):
    name = op_name(func)
    if name in _META:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if _ACTIVE_COUNTS:
        _ACTIVE_COUNTS[-1][name] += 1
    if name in _H:
        return _H[name](name, args, kwargs)
    if name.endswith("_") and not name.startswith("_") and name[:-1] in _H | {"copy": 0, "zero": 0, "fill": 0}:
        return _inplace(name, args, kwargs)
    raise ComplexNotLowered(f"complex values reach '{name}' ({func}), which normexport has no real form for")


class RealComplexMode(TorchFunctionMode):
    """While active, complex values are ComplexPairs and complex arithmetic runs as real arithmetic."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _involves(args) or any(_involves(v) for v in kwargs.values()) or (
                getattr(func, "__name__", "").split(".")[0] in PRODUCERS and op_name(func) in PRODUCERS):
            out = _lowered(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and type(out) is not ComplexPair and out.dtype.is_complex:
            raise ComplexNotLowered(f"'{op_name(func)}' made a complex tensor from real inputs")
        return out


__all__ = ["ComplexPair", "RealComplexMode", "ComplexNotLowered", "lift", "pack", "unpack", "is_complex_value",
           "op_name", "PRODUCERS"]
