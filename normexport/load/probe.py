"""One eager forward checks the example inputs normexport made before anything is exported
(docs/design.md §9). When the forward raises, the error is read for the parameter it was about and the
alternative is tried:

- a pair the model takes only one of ("You cannot specify both X and Y"): the one we made is dropped;
- a parameter the model needs but we left out ("specify either X or Y", a None dereferenced in
  the forward: the traceback's statement names it): it is made (derive with `extra`);
- a wrong size or layout ("expects ... length 16, but found 8", "expected input[2, 8, 10] to have
  10 channels, but got 8"): the tensor whose shape or name the message gives is resized on an axis
  that only counts tokens or frames, or its channel axis moved where the model reads it.

What still fails is one line naming the parameter, what the model expected of it (its error), what
was tried, and the ways to give inputs (`--inputs` with `normexport.capture`; `--input NAME:DIMS`
where a plain tensor does). The user's own inputs (`given`) are never changed: an error about one
of them says so.
"""

from __future__ import annotations

import ast
import linecache
import re
from typing import Callable

import torch

from ..errors import UsageError, first_line
from . import entries

#: attempts before giving up (each is one eager forward of a tiny example)
TRIES = 8
#: the factor a counted axis (samples, frames) grows by when the model finds it too short
GROW = 16


def settle(model, kwargs: dict, remake: Callable[[str, dict], object], given=(), free: dict | None = None,
           others: dict | None = None) -> dict:
    """kwargs the model's forward accepts, starting from `kwargs` (derived, plus the user's
    `given` names); `remake(name, kwargs)`: a value for a parameter the model asks for (None when
    none can be made); `free[name]`: axes of a made tensor that only count tokens / frames;
    `others[name]`: other shapes a made tensor may take, tried when an error is about it."""
    kwargs, free, given = dict(kwargs), {k: set(v) for k, v in (free or {}).items()}, set(given)
    others = {k: list(v) for k, v in (others or {}).items() if k not in given}
    tried: list[str] = []
    unmade: list[str] = []  # parameters the model reads that nothing could make
    for attempt in range(TRIES):
        try:
            with torch.no_grad():
                first = model(**kwargs)
                if _same(first, model(**kwargs)):
                    return entries.plain(kwargs)
            # two calls disagree: the forward draws random numbers (ViTMAE's masking) unless a
            # parameter documented to control the randomness is given
            chosen = _randomness(model, kwargs, remake)
            if chosen is None:
                return entries.plain(kwargs)  # the parity check will say the file cannot match it
            kwargs, what = chosen
            tried.append(what)
            continue
        except Exception as e:  # noqa: BLE001 - read for the parameter it is about
            error = e
        fix = _alternative(model, error, kwargs, remake, given, free, unmade, others) if attempt < TRIES - 1 else None
        if fix is None or fix[1] in tried:
            break
        kwargs, what = fix
        tried.append(what)
    raise UsageError(refusal(model, error, kwargs, given, tried, unmade))


def _same(a, b) -> bool:
    """Two outputs of the forward are the same values (nested tuples / dicts / ModelOutputs of tensors)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b) or (a.is_floating_point() and torch.isnan(a).any()))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return True


def _randomness(model, kwargs: dict, remake):
    """(kwargs, what) with the optional parameters the forward's documentation says control its
    randomness ("used to control randomness": ViTMAE's `noise`) made, or None when there is none."""
    from . import docs

    names = [n for n, d in docs.params(model).items() if n not in kwargs and re.search(r"\brandom", d.doc, re.I)]
    made = {n: remake(n, kwargs) for n in names}
    made = {n: v for n, v in made.items() if v is not None}
    if not made:
        return None
    return {**kwargs, **made}, f"with {', '.join(made)} (the forward draws random numbers without it)"


def missing_package(error: BaseException) -> str | None:
    """The package a NameError of the model's code stands for when that code imports the name only if
    the package is installed (diffusers' Cosmos: `from torchvision import transforms` under
    is_torchvision_available()), and it is not: its top-level name; else None."""
    import importlib.util

    if not isinstance(error, NameError) or not getattr(error, "name", None):
        return None
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return None
    lines = linecache.getlines(tb.tb_frame.f_code.co_filename)
    name = re.escape(error.name)
    for line in lines:
        m = re.match(rf"\s*from\s+([\w.]+)\s+import\s+.*\b{name}\b|\s*import\s+([\w.]+)\s+as\s+{name}\b|"
                     rf"\s*import\s+({name})\b", line)
        if m:
            package = (m.group(1) or m.group(2) or m.group(3)).split(".")[0]
            if not package:  # a relative import: the library's own module, not an optional package
                return None
            return package if importlib.util.find_spec(package) is None else None
    return None


def refusal(model, error: BaseException, kwargs: dict, given=(), tried=(), unmade=()) -> str:
    """The one line when the made inputs stay refused: the parameter, what the model expected, the escape hatches."""
    cls = type(model).__name__
    if (package := missing_package(error)) is not None:
        return (f"{cls}.forward needs the package {package}, which is not installed here (its error: "
                f"{first_line(error, 120)}): pip install {package}, then convert again")
    if unmade:  # the forward reads a parameter normexport has no value for
        expected = first_line(error, 200)
        return (f"{cls}.forward needs {', '.join(dict.fromkeys(unmade))}, which normexport cannot make (its error: "
                f"{expected}): record a real call with `with normexport.capture(model, \"inputs.pt\"): pipeline(...)` "
                f"and pass --inputs inputs.pt")
    name = _about(error, kwargs) or _named_in(str(error), kwargs)
    shapes = ", ".join(f"{n} {_shape_text(v)}" for n, v in kwargs.items() if _shape_text(v))
    expected = first_line(error, 200)
    plain = name is not None and isinstance(kwargs.get(name), torch.Tensor)
    hatch = (f"--input {name}:DIMS[:DTYPE] with the shape it needs, or " if plain else "") + \
        "record a real call with `with normexport.capture(model, \"inputs.pt\"): pipeline(...)` and pass --inputs inputs.pt"
    if name is not None and name in given:
        return f"{cls}.forward refused your input {name} {_shape_text(kwargs[name])} ({expected}): give {name} as the model " \
               f"expects it: {hatch}"
    about = f" about {name}" if name else ""
    what = f"; tried {', '.join(tried)}" if tried else ""
    return (f"{cls}.forward refused the example inputs normexport made ({shapes}): its error{about}: {expected}{what}: "
            f"{hatch}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape_text(v) -> str:
    if isinstance(v, torch.Tensor):
        return "[" + "x".join(map(str, v.shape)) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_shape_text(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, torch.Tensor) for x in v):
        return f"{len(v)} x " + _shape_text(v[0])
    return ""


def _alternative(model, error, kwargs, remake, given, free, unmade, others=None):
    """(new kwargs, what was done) for the parameter the error is about, or None."""
    msg = str(error)
    params = _parameters(model)
    # a made tensor with another layout to try (derive's `others`: packed latents [B, N, C] beside a
    # documented [B, C, H, W]), whose features a projection refused ("mat1 and mat2 shapes cannot be
    # multiplied (256x2 and 64x16)": its rows and last axis are the first pair): its next layout
    m = re.search(r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and \d+x\d+\)", msg)
    for name, shapes in (others or {}).items():
        t = kwargs.get(name)
        if m and shapes and isinstance(t, torch.Tensor) and t.dim() >= 2 \
                and (t.shape[:-1].numel(), int(t.shape[-1])) == (int(m.group(1)), int(m.group(2))):
            shape = shapes.pop(0)
            free[name] = {1} if len(shape) == 3 else set()  # packed: the token axis counts
            return {**kwargs, name: _like(t, shape)}, f"{name} {'x'.join(map(str, shape))} (its other layout)"
    # a dict parameter short of keys the forward reads from it (entries): each is made
    for name, value in kwargs.items():
        if isinstance(value, entries.Keys) and (keys := entries.wanted(value, error)):
            made = {k: remake(f"{name}.{k}", kwargs) for k in keys}
            unmade += [f"{name}[{k!r}]" for k, v in made.items() if v is None]
            made = {k: v for k, v in made.items() if v is not None}
            if made:
                return {**kwargs, name: value.grown(made)}, f"{name} with {', '.join(made)}"
    # a width a projection did not take ("mat1 and mat2 shapes cannot be multiplied (2x40 and 32x16)"):
    # the made tensor (or dict entry) of that width, else the only one of a guessed width, takes it
    m = re.search(r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)", msg)
    if m:
        fixed = _resize_width(kwargs, int(m.group(1)), int(m.group(2)), int(m.group(3)), given, free)
        if fixed is not None:
            return fixed
    # an input too short for the model's convolutions ("Kernel size can't be greater than actual input
    # size"): the only made tensor with an axis that only counts (samples, frames) grows on it
    if re.search(r"Kernel size can't be greater than actual input size|Output size is too small|"
                 r"input size .* is too small|smaller than (?:the )?kernel", msg, re.I):
        counted = [n for n, v in kwargs.items() if n not in given and isinstance(v, torch.Tensor) and free.get(n)]
        if len(counted) == 1:
            n = counted[0]
            shape = list(kwargs[n].shape)
            for a in free[n]:
                shape[a] *= GROW
            return {**kwargs, n: _like(kwargs[n], shape)}, f"{n} {'x'.join(map(str, shape))}"
    # an embedding looked up with values of a made float tensor (Pix2Struct reads the row / column of
    # each flattened patch from its first two columns: `flattened_patches[:, :, 0].long()`): the made
    # float tensors with negative values become values in [0, 1), whose integer part is a valid index
    if re.search(r"index out of range in self|index -?\d+ is out of bounds", msg):
        floats = [n for n, v in kwargs.items() if n not in given and isinstance(v, torch.Tensor)
                  and v.is_floating_point() and v.numel() and bool((v < 0).any())]
        if floats:
            g = torch.Generator().manual_seed(2)
            return ({**kwargs, **{n: torch.rand(kwargs[n].shape, generator=g, dtype=kwargs[n].dtype) for n in floats}},
                    f"{', '.join(floats)} in [0, 1) (read as indices)")
    # a made integer tensor where the model computes in floating point (HunyuanVideo 1.5's timestep,
    # documented LongTensor, through a Linear: "mat1 and mat2 must have the same dtype, but got Long and
    # Float"; Speech2Text's input_features, documented LongTensor, through a Conv1d: "Input type (long int)
    # and bias type (float) should be the same"): the made integer tensors that are not ids, indices, masks
    # or sizes become float, values kept
    if re.search(r"same dtype, but got (?:Long|Int)\w* and (?:Float|Half|BFloat16|Double)|"
                 r"expected scalar type (?:Float|Half|BFloat16|Double) but found (?:Long|Int)|"
                 r"Input type \((?:torch\.)?(?:long|int)[^)]*\) and (?:bias|weight) type \((?:torch\.)?"
                 r"(?:float|half|bfloat16|double)", msg, re.I):
        ints = [n for n, v in kwargs.items() if n not in given and isinstance(v, torch.Tensor)
                and not v.is_floating_point() and v.dtype != torch.bool
                and not re.search(r"ids?$|_ids?_|index|indices|mask|position|shape|size|grid|len|label", n)]
        if ints:
            dtype = next((q.dtype for q in model.parameters() if q.is_floating_point()), torch.float32) \
                if isinstance(model, torch.nn.Module) else torch.float32
            return {**kwargs, **{n: kwargs[n].to(dtype) for n in ints}}, f"{', '.join(ints)} as {_dtype_name(dtype)}"
    # a mask the model uses as a condition ("where expected condition to be a boolean tensor, but got a
    # tensor with dtype Long": Qwen-Image 2.1's img_mask): the made integer masks become bool
    if re.search(r"boolean tensor|expected .{0,40}\bbool", msg, re.I):
        masks = [n for n, v in kwargs.items() if n not in given and "mask" in n and isinstance(v, torch.Tensor)
                 and not v.is_floating_point() and v.dtype != torch.bool]
        if masks:
            return {**kwargs, **{n: kwargs[n] != 0 for n in masks}}, f"{', '.join(masks)} as bool"
    # a pair the model takes only one of: drop the one we made
    m = re.search(r"(?:both|and not both|only one of)\W+(\w+)\W+(?:and|or)\W+(\w+)", msg, re.I)
    if m and m.group(1) in kwargs and m.group(2) in kwargs:
        drop = next((n for n in (m.group(2), m.group(1)) if n not in given), None)
        if drop is not None:
            return {k: v for k, v in kwargs.items() if k != drop}, f"without {drop}"
    # a parameter the model needs that we left out: the message names it, or the statement that
    # dereferenced None reads it
    wanted = [n for n in re.findall(r"\w+", msg) if n in params and n not in kwargs]
    if "NoneType" in msg or "None" in msg:
        wanted += _none_read(error, params, kwargs)
    for name in dict.fromkeys(wanted):
        value = remake(name, kwargs)
        if value is not None:
            return {**kwargs, name: value}, f"with {name}"
        unmade.append(name)
    # a rank the model did not expect ("not enough values to unpack (expected 4, got 3)"): the one
    # made tensor (or list of per-item tensors) of that rank gets a size-1 axis after its first
    r = re.search(r"not enough values to unpack \(expected (\d+), got (\d+)\)", msg)
    if r and int(r.group(1)) == int(r.group(2)) + 1:
        rank = int(r.group(2))
        hits = [n for n, v in kwargs.items() if n not in given and _rank(v) == rank]
        if len(hits) == 1:
            n = hits[0]
            v = kwargs[n]
            grown = [t.unsqueeze(1) for t in v] if isinstance(v, list) else v.unsqueeze(1)
            free.pop(n, None)
            return {**kwargs, n: grown}, f"{n} with one more axis"
    # a size or layout the model did not expect
    name = _about(error, kwargs)
    c = re.search(r"to have (\d+) channels, but got (\d+) channels", msg)
    if c and name is None:
        # the convolution takes the latents concatenated with something the forward made (a
        # ControlNet-style hint): the made latents keep the channels the rest leaves
        extra = int(c.group(2)) - int(c.group(1))
        latents = [n for n in ("sample", "hidden_states") if n in kwargs and n not in given
                   and isinstance(kwargs[n], torch.Tensor) and kwargs[n].dim() >= 4]
        if latents and extra > 0 and int(kwargs[latents[0]].shape[1]) > extra:
            n = latents[0]
            shape = list(kwargs[n].shape)
            shape[1] -= extra
            return {**kwargs, n: _like(kwargs[n], shape)}, f"{n} {'x'.join(map(str, shape))}"
    if name is not None and name not in given and isinstance(kwargs[name], torch.Tensor):
        t = kwargs[name]
        c = re.search(r"to have (\d+) channels, but got (\d+) channels", msg)
        if c:
            want = int(c.group(1))
            axes = [a for a in range(1, t.dim()) if int(t.shape[a]) == want and a != 1]
            if axes:  # the documented layout put the channels elsewhere: move them to axis 1
                order = list(range(t.dim()))
                order[1], order[axes[0]] = order[axes[0]], order[1]
                free[name] = {order.index(a) for a in free.get(name, set())}
                return {**kwargs, name: _like(t, [int(t.shape[a]) for a in order])}, f"{name} channels first"
            if int(t.shape[1]) == int(c.group(2)) and want > 0:
                # made with another input's channels (WanVACE's control_hidden_states like the latents, where
                # its own embedding takes vace_in_channels): the channels the convolution takes
                shape = list(t.shape)
                shape[1] = want
                return {**kwargs, name: _like(t, shape)}, f"{name} {'x'.join(map(str, shape))}"
        n = re.search(r"expect\w*\D*?(\d+)\D*?(?:but|found|got|instead)\D*?(\d+)", msg)
        if n:
            want, got = int(n.group(1)), int(n.group(2))
            axes = [a for a in sorted(free.get(name, ())) if int(t.shape[a]) == got]
            if axes and want > 0:
                shape = list(t.shape)
                shape[axes[0]] = want
                return {**kwargs, name: _like(t, shape)}, f"{name} {'x'.join(map(str, shape))}"
            fixed = [a for a in range(1, t.dim()) if int(t.shape[a]) == got and a not in free.get(name, ())]
            counted = sorted(free.get(name, ()))
            if fixed and counted and want > 0:  # the model reads the length where the documentation put a size
                a, b = fixed[0], counted[0]
                shape = list(t.shape)
                shape[a], shape[b] = want, shape[a]
                free[name] = (free[name] - {b}) | {a}
                return {**kwargs, name: _like(t, shape)}, f"{name} {'x'.join(map(str, shape))} (axes {b}, {a} swapped)"
    # a length the model fixes, given in a message that names just it and the made one ("Input sequence
    # length (8) doesn't match model configuration (32)": PatchTST's past_values, sized by context_length):
    # every made tensor's counted axis of the made size takes the other
    sizes = {int(x) for x in re.findall(r"(?<![\w.])\d+(?![\w.])", msg)}
    counted = [(n, a) for n, v in kwargs.items() if n not in given and isinstance(v, torch.Tensor)
               for a in sorted(free.get(n, ())) if int(v.shape[a]) in sizes]
    if len(sizes) == 2 and len({int(kwargs[n].shape[a]) for n, a in counted}) == 1:
        got = int(kwargs[counted[0][0]].shape[counted[0][1]])
        want = (sizes - {got}).pop()
        if want > 0:
            out = dict(kwargs)
            for n, a in counted:
                shape = list(out[n].shape)
                shape[a] = want
                out[n] = _like(out[n], shape)
            return out, ", ".join(f"{n} {'x'.join(map(str, out[n].shape))}" for n in dict.fromkeys(n for n, _ in counted))
    # last: a dict entry the forward read with a default of its own (made from another input, which
    # did not fit): made as the entry its name says
    for name, value in kwargs.items():
        if isinstance(value, entries.Keys) and value.optional:
            made = {k: remake(f"{name}.{k}", kwargs) for k in value.optional}
            made = {k: v for k, v in made.items() if v is not None}
            if made:
                return {**kwargs, name: value.grown(made)}, f"{name} with {', '.join(made)}"
    return None


def _resize_width(kwargs, rows: int, got: int, want: int, given, free):
    """(kwargs, what) with the last axis of one made tensor or dict entry resized so that a
    projection taking `want` features gets them; the candidates are those whose last axis is free
    (a guess) and whose other axes make the `rows` of the projection's input: the one of width
    `got`, else the only one (its width grown by want - got, when the features it feeds are
    concatenated with others)."""
    cands = []  # (parameter, key or None, tensor)
    for n, v in kwargs.items():
        if n in given:
            continue
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.dim() - 1 in free.get(n, ()):
            cands.append((n, None, v))
        if isinstance(v, entries.Keys):
            cands += [(n, k, t) for k, t in v.items() if isinstance(t, torch.Tensor) and t.dim() >= 2
                      and t.dim() - 1 in v.free.get(k, ())]
    cands = [c for c in cands if c[2].shape[:-1].numel() == rows]
    exact = [c for c in cands if int(c[2].shape[-1]) == got]
    if exact:
        (n, k, t), width = exact[0], want
    elif len(cands) == 1:
        (n, k, t) = cands[0]
        have = int(t.shape[-1])
        each = got // have if got % have == 0 else 0
        if not re.search(r"embed|states|features", k or n) and each > 1 and want % each == 0:
            width = want // each  # values embedded one by one (SVD's added_time_ids: n x addition_time_embed_dim)
        else:
            width = have + want - got  # features concatenated with others (SDXL's text_embeds beside time ids)
    else:
        return None
    if width <= 0 or width == int(t.shape[-1]):
        return None
    new = _like(t, list(t.shape[:-1]) + [width])
    if k is None:
        return {**kwargs, n: new}, f"{n} {'x'.join(map(str, new.shape))}"
    grown = kwargs[n].grown({k: new})
    grown.free[k] = set()  # settled by the model's own size
    return {**kwargs, n: grown}, f"{n}[{k!r}] {'x'.join(map(str, new.shape))}"


def _rank(v) -> int | None:
    if isinstance(v, torch.Tensor):
        return v.dim()
    if isinstance(v, list) and v and all(isinstance(t, torch.Tensor) for t in v) and len({t.dim() for t in v}) == 1:
        return v[0].dim()
    return None


def _like(t: torch.Tensor, shape) -> torch.Tensor:
    """A new example of another shape, of t's dtype and range."""
    g = torch.Generator().manual_seed(1)
    if t.dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)
    if not t.is_floating_point():
        return torch.randint(0, int(t.max()) + 1 if t.numel() else 2, shape, generator=g, dtype=t.dtype)
    return torch.randn(shape, generator=g, dtype=t.dtype)


def _parameters(model) -> list[str]:
    import inspect

    try:
        return [n for n, p in inspect.signature(model.forward).parameters.items()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):
        return []


def _about(error, kwargs) -> str | None:
    """The tensor the message is about: its shape written in the message ([2, 8, 10], (2, 8, 10),
    2x8x10; of several of that shape, the one the failing statements name: WanVACE's
    `control_hidden_states = self.vace_patch_embedding(control_hidden_states)` beside hidden_states),
    else the parameter whose name's words the message uses ("mel input features")."""
    msg = str(error)
    hits = []
    for n, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.dim() > 1:
            dims = [str(int(d)) for d in v.shape]
            if re.search(r"[\[(]\s*" + r"\s*,\s*".join(dims) + r"\s*[\])]", msg) or "x".join(dims) in msg:
                hits.append(n)
    if len(hits) > 1:
        return _named_in_traceback(error, hits) or hits[0]
    return hits[0] if hits else _named_in(msg, kwargs)


def _named_in_traceback(error, names: list[str]) -> str | None:
    """Of `names`, the one the failing statements use, innermost first (the line of each frame)."""
    tb, lines = error.__traceback__, []
    while tb is not None:
        lines.append(linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    for line in reversed(lines):
        used = [n for n in names if re.search(rf"\b{re.escape(n)}\b", line)]
        if len(used) == 1:
            return used[0]
    return None


def _named_in(msg: str, kwargs) -> str | None:
    words = set(re.findall(r"[a-z]+", msg.lower()))
    best, score = None, 0
    for n, v in kwargs.items():
        parts = [p for p in n.lower().split("_") if p]
        if isinstance(v, torch.Tensor) and parts and all(p in words for p in parts) and len(parts) > score:
            best, score = n, len(parts)
    return best


def _none_read(error, params, kwargs) -> list[str]:
    """Forward parameters we left out that the failing statements read (innermost first): a name
    loaded in a statement of the traceback whose value there is None."""
    out = []
    tb = error.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    for tb in reversed(frames):
        frame = tb.tb_frame
        code = frame.f_code
        start = tb.tb_lineno
        end = start
        for pos in code.co_positions():  # the whole statement, not its first line
            if pos[0] == start and pos[1] is not None:
                end = max(end, pos[1])
        text = "".join(linecache.getline(code.co_filename, i) for i in range(start, end + 1))
        for name in _loaded_names(text):
            if name in params and name not in kwargs and frame.f_locals.get(name, 0) is None:
                out.append(name)
    return out


def _loaded_names(text: str) -> list[str]:
    src = text.strip()
    for candidate in (src, src.rstrip(":") + ": pass", "(" + src + ")"):
        try:
            tree = ast.parse(candidate)
        except SyntaxError:
            continue
        return [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)] + \
            [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return re.findall(r"\w+", src)

