"""The float64 reference: a float64 copy of the eager model, run with lower-float casts kept in
float64 and the normexport custom ops computed by their numpy references; and the cast of the
reference to the checked dtype."""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import UsageError
from ._util import _LOW_FLOATS, _dtype_name, _flatten, _short

def _fp64_custom_op(func, args, kwargs):
    """float64 implementations of the normexport custom ops (their numpy references), or None."""
    name = getattr(func, "__name__", "")
    ns = getattr(func, "namespace", None)
    if ns != "normexport" or not args or not isinstance(args[0], torch.Tensor) or args[0].dtype != torch.float64:
        return None
    from ..ops import SPECS

    def np_(t):
        return None if t is None else t.detach().cpu().numpy().astype(np.float64)

    bound = {a.name: v for a, v in zip(func._schema.arguments, args)}
    bound.update(kwargs)
    if name.startswith("rms_norm"):
        y = SPECS["RMSNorm"].reference(np_(bound["x"]), np_(bound["scale"]), epsilon=bound["epsilon"], axis=bound["axis"])
    elif name.startswith("adaln_zero"):
        y = SPECS["AdaLNZero"].reference(np_(bound["x"]), np_(bound["shift"]), np_(bound["scale"]),
                                         np_(bound.get("weight")), np_(bound.get("bias")), epsilon=bound["epsilon"],
                                         modulation_axis=int(bound.get("modulation_axis", 0)))
    else:
        return None
    return torch.from_numpy(np.ascontiguousarray(y)).to(args[0].device)


class _Float64Mode(TorchDispatchMode):
    """Keep a float64 computation in float64: casts and factories asking for a lower float dtype
    get float64, normexport ops use their float64 references."""

    _KEEP = ("aten::view.dtype",)  # bit reinterpretation: leave alone

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        y = _fp64_custom_op(func, args, kwargs)
        if y is not None:
            return y
        if str(func._schema.name) + "." + func._overloadname not in self._KEEP:
            if kwargs.get("dtype") in _LOW_FLOATS:
                kwargs["dtype"] = torch.float64
            args = tuple(torch.float64 if a in _LOW_FLOATS else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def kept_in_float64(modules, methods=("forward", "encode", "decode")):
    """While inside: each of `modules`' `methods` (those it has) runs under _Float64Mode, as the float64
    reference does, for float64 copies whose calls other code makes (a diffusers pipeline's own call,
    normexport.pipeline.compare). Without it a float64 transformers text encoder's eager attention
    adds finfo(float64).min for masked keys and takes the softmax with dtype=float32: -1.8e308 casts
    to -inf, and a fully masked row (left padding) is softmax(all -inf) = NaN, where float32 eager
    (finfo(float32).min, finite) gives a uniform row. Nested calls enter the mode once."""
    depth = [0]

    def wrap(original):
        def run(*args, **kwargs):
            if depth[0]:
                return original(*args, **kwargs)
            depth[0] += 1
            try:
                with _Float64Mode():
                    return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        return run

    wrapped = []
    for m in modules:
        for name in methods:
            if callable(getattr(m, name, None)):
                previous = vars(m).get(name)  # an instance attribute already there (another wrapper), or None
                setattr(m, name, wrap(getattr(m, name)))
                wrapped.append((m, name, previous))
    try:
        yield
    finally:
        for m, name, previous in reversed(wrapped):
            if previous is None:
                vars(m).pop(name, None)
            else:
                setattr(m, name, previous)


def _to_fp64(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


#: a float64 copy larger than this is not made (the reference is then eager itself)
FP64_COPY_LIMIT_BYTES = 4 * 2**30


class _Float64Reference:
    """A float64 deep copy of the reference, made once, run per input shape."""

    def __init__(self, reference: nn.Module):
        self.module = None
        self.reason: str | None = None
        try:
            n = sum(t.numel() for t in list(reference.parameters()) + list(reference.buffers()) if t.is_floating_point())
        except Exception:
            n = 0
        self.streamed = n * 8 > FP64_COPY_LIMIT_BYTES
        if self.streamed and any(isinstance(m, torch.jit.ScriptModule) for m in reference.modules()):
            self.reason = ("the model is TorchScript and too large for a float64 copy: its modules refuse the forward "
                           "hooks that upcast one module at a time")
            return
        if self.streamed:  # no float64 copy of the model: each module's own weights upcast while it runs
            self.module = reference
            return
        try:
            self.module = copy.deepcopy(reference).double()
        except Exception as e:  # exotic modules
            self.reason = f"cannot make a float64 copy of the reference ({_short(e)})"

    def __call__(self, inputs: tuple):
        """(flat float64 outputs, None) or (None, reason)."""
        if self.module is None:
            return None, self.reason
        args = tuple(_to_fp64(t) for t in inputs)
        errors = []
        for mode in (_Float64Mode, contextlib.nullcontext):
            try:
                with torch.no_grad(), mode(), (_upcast_while_running(self.module) if self.streamed else contextlib.nullcontext()):
                    out = _flatten(self.module(*args))
                return [o.double() if o.is_floating_point() else o for o in out], None
            except Exception as e:
                errors.append(_short(e))
        return None, f"the reference does not run in float64 ({errors[-1]})"


@contextlib.contextmanager
def _upcast_while_running(model: nn.Module):
    """Forward hooks that give each module float64 copies of its own parameters and buffers just
    before it runs and put the originals back right after: the float64 reference of a model too
    large for a float64 copy, holding one module's weights in float64 at a time (docs/design.md §8)."""
    saved: dict[int, list] = {}

    def pre(module, _args):
        swapped = []
        for store in (module._parameters, module._buffers):
            for name, t in list(store.items()):
                if t is not None and t.is_floating_point() and t.dtype != torch.float64:
                    swapped.append((store, name, t))
                    store[name] = t.detach().double() if store is module._buffers else nn.Parameter(t.detach().double(), requires_grad=False)
        saved[id(module)] = swapped

    def post(module, _args, _out):
        for store, name, t in saved.pop(id(module), []):
            store[name] = t

    handles, pieced = [], []
    for m in model.modules():
        forward = _piecewise_forward(m)
        if forward is not None:  # too large to upcast at once: its float64 forward in pieces
            m.forward = forward
            pieced.append(m)
        elif any(t is not None for t in list(m._parameters.values()) + list(m._buffers.values())):
            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post))
    try:
        yield
    finally:
        for m in pieced:
            del m.forward  # the class's forward again
        for h in handles:
            h.remove()
        for module_saved in saved.values():  # a forward that raised midway: originals back
            for store, name, t in module_saved:
                store[name] = t


#: a Linear / Embedding whose weight in float64 exceeds this is not upcast whole by the streamed
#: reference (an 8 B LLaMA's 128256 x 4096 lm_head would be 4 GiB more): pieces of at most this size
FP64_PIECE_BYTES = 256 << 20


def _piecewise_forward(m: nn.Module):
    """A float64 forward for a plain nn.Linear / nn.Embedding (the class's own forward) whose
    float64 weight would exceed FP64_PIECE_BYTES, or None. Linear: the output columns in slices,
    each from its rows of the weight upcast (the same dot products as the whole weight in float64);
    Embedding: the rows looked up in the weight's dtype, then upcast (exact)."""
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dtype == torch.float64 \
            or w.numel() * 8 <= FP64_PIECE_BYTES or "forward" in m.__dict__:
        return None
    if type(m).forward is nn.Linear.forward:
        def linear(x):
            x = x.double()
            rows = max(1, FP64_PIECE_BYTES // (8 * w.shape[1]))
            y = x.new_empty(*x.shape[:-1], w.shape[0])
            for i in range(0, w.shape[0], rows):
                y[..., i:i + rows] = x @ w[i:i + rows].double().T
            return y + m.bias.double() if m.bias is not None else y

        return linear
    if type(m).forward is nn.Embedding.forward and m.max_norm is None:
        def embedding(ids):
            return torch.nn.functional.embedding(ids, w, m.padding_idx).double()

        return embedding
    return None


# ---- helpers -----------------------------------------------------------------------------------
def _cast_reference(reference, dtype: torch.dtype):
    """`reference` with its floating parameters and buffers in `dtype` (a copy when any differ)."""
    try:
        tensors = list(reference.parameters()) + list(reference.buffers())
    except Exception:
        tensors = []
    if all(t.dtype == dtype for t in tensors if t.is_floating_point()):
        return reference
    try:
        return copy.deepcopy(reference).to(dtype)
    except Exception as e:
        raise UsageError(f"cannot cast the reference model to {_dtype_name(dtype)} ({_short(e)}): "
                         "pass a reference in that dtype, or --dtype matching it") from None
