"""A text axis that a component's file keeps static, served by padding (docs/design.md §12; issue 46).

Some denoisers take the prompt's text length as a python value (QwenImage's RoPE: `int(text
length)`): torch.export specialises it, so the file holds one text length and a prompt of another
length is refused. Where the component takes a mask over that axis (given by the pipeline, or a
parameter the recorded call left None, such as QwenImage's `encoder_hidden_states_mask`, which its
pipeline drops when every token is valid), a shorter text is the same computation padded: rows of
zeros, mask 0. convert (pipeline/exporting.py) finds such a plan and proves it on the eager
component before it exports the file padded (`verify`, on the recorded call):

- (made masks only) the call with a mask of ones gives the call's outputs: it is a mask over the text;
- the call padded with zero rows (mask 0) gives the call's outputs on the unpadded positions, within
  float rounding (the positional and length-dependent parts of the model see no difference);
- the call padded with random rows gives the zero-padded call's outputs, to 1e-5 of their size (the
  padded rows reach no real output: exact masking gives them no weight at all).

The file is exported at the text length `length`: the pipeline's own `max_sequence_length` (its
`__call__`'s default, the longest text it passes on) where it has one and it is at least the longest
recorded text, else the longest recorded text, so that no prompt the eager pipeline accepts is
refused; the cost is the padded positions, computed on every call. The manifest entry's
`text_padding` lists each plan: {"inputs": {input: axis}, "mask": name, "mask_axis", "mask_made",
"mask_dtype", "mask_pad", "mask_from": the input whose leading dims a made mask takes, "length",
"outputs": {file output index: axis}}; the runtime (`pad`) pads each call to `length`, makes the mask
where the pipeline passed none, and cuts the outputs on the text axis back (`cut`). A text longer
than `length` is refused in one line. Where no plan passes (no mask over the axis; a model that
computes with the unpadded length, as Lumina2's token counts or Z-Image's per-sample caption
padding), the file stays as recorded and the runtime's one-line refusal of other lengths stands.
"""

from __future__ import annotations

import inspect

import torch
import torch.utils._pytree as pytree

#: (a) padded vs unpadded: this share of max|output| (or 8 eps of the component's dtype, if larger)
PADDED_RTOL = 1e-5
#: (b) random rows vs zero rows in the padding: this share of max|output| (exact masking gives 0)
CONTENT_RTOL = 1e-5
#: the mask dtypes a made mask is tried in (the tokenizers' int64 first, then the text's float)
MADE_DTYPES = (torch.int64, None)


def groups(slot) -> list[dict[str, int]]:
    """The text axes of a recorded slot: the non-batch axes whose size differs between the calls at
    the converted size (the prompt's length), grouped by their sizes in every call (the inputs of one
    text: embeddings, mask, text ids); {input: axis} each, top-level inputs only."""
    calls = slot.shapes[:slot.at_size] if slot.at_size is not None else slot.shapes
    if len(calls) < 2:
        return []
    batched = set((slot.batch or {}).get("inputs", []))
    out: dict[tuple, dict[str, int]] = {}
    first = calls[0]
    for path, shape in first.items():
        if any(c.get(path) is None or len(c[path]) != len(shape) for c in calls):
            continue
        for axis in range(len(shape)):
            if axis == 0 and (path in batched or not batched):
                continue  # the batch
            sizes = tuple(c[path][axis] for c in calls)
            if len(set(sizes)) > 1:
                out.setdefault(sizes, {})[path] = axis
    return list(out.values())


def text_axes(slot, module, dynamic: dict | None) -> dict[str, list[int]]:
    """{input: [axes]} of the slot's text axes (`groups`) that a mask may serve padded (`maskable`),
    among the `dynamic` axes asked of the exporter: the ladder's required axes (exporting.py)."""
    out: dict[str, list[int]] = {}
    for group in groups(slot):
        if maskable(module, slot.args, slot.kwargs, group) is not None:
            continue
        for n, a in group.items():
            if a in (dynamic or {}).get(n, []):
                out.setdefault(n, []).append(a)
    return out


def without_text(axes: dict | None, plans: list[dict]) -> dict[str, list[int]]:
    """Dynamic `axes` without the plans' text axes (the padded file fixes them), each made mask with
    its text's batch axis where that is asked."""
    out = {n: list(a) for n, a in (axes or {}).items()}
    for plan in plans:
        for n, a in plan["inputs"].items():
            if a in out.get(n, []):
                out[n].remove(a)
        if plan.get("mask_made") and 0 in out.get(plan["mask_from"], []):
            out[plan["mask"]] = [0]
    return {n: a for n, a in out.items() if a}


def longest(slot, group: dict[str, int]) -> int:
    """The longest text of the group in every recorded call (the one-size-up run's too)."""
    return max((c[p][a] for c in slot.shapes for p, a in group.items() if c.get(p) is not None
                and len(c[p]) > a), default=0)


def plan_for(module, args: tuple, kwargs: dict, group: dict[str, int], length: int) -> tuple[dict | None, str]:
    """A padding plan for `group` proven on the eager `module` at the call (args, kwargs) (module
    doc), and what was found: (plan, why) with plan None where padding is not exact for this model."""
    bound = bind(module, args, kwargs)
    found = _candidates(module, bound, group)
    if isinstance(found, str):
        return None, found
    name, axis, masks, made = found
    size = int(bound[name].shape[axis])
    target = max(length, size + 1)  # padding proven with at least one row (the file's length may be this call's)
    whys = []
    for mask, mask_dtype in [(m, None) for m in masks] + [(m, d) for m in made for d in MADE_DTYPES]:
        plan = {"inputs": dict(group), "mask": mask, "mask_made": mask not in masks, "length": length,
                "mask_from": name}
        if plan["mask_made"]:
            dtype = mask_dtype or bound[name].dtype
            plan.update(mask_axis=axis, mask_dtype=str(dtype).replace("torch.", ""), mask_pad=0)
        else:
            m = bound[mask]
            plan.update(mask_axis=_mask_axis(m, size), mask_dtype=str(m.dtype).replace("torch.", ""),
                        mask_pad=_mask_pad(m))
        ok, why = _verify(module, bound, plan, target)
        if ok:
            plan["outputs"] = why
            return plan, f"padding {name} (axis {axis}) with masked rows ({mask}) is exact for it"
        whys.append(f"{mask}: {why}")
    return None, "; ".join(whys)


def maskable(module, args: tuple, kwargs: dict, group: dict[str, int]) -> str | None:
    """None where the call has a mask over the group's text axis, or a parameter that may be one
    (what plan_for then proves or refuses; nothing is run here); else why it cannot be padded."""
    found = _candidates(module, bind(module, args, kwargs), group)
    return found if isinstance(found, str) else None


def _candidates(module, bound: dict | None, group: dict[str, int]):
    """(text input, its text axis, masks the call gives, unset mask parameters) or why there are none."""
    if bound is None:
        return "its call could not be bound to its parameters"
    text = _text_input(bound, group)
    if text is None:
        return "the text axis is a list element's, with no batch axis for a mask"
    name, axis = text
    masks = _existing_masks(bound, group, name, axis)
    made = [] if masks else _unset_masks(module, bound)
    if not masks and not made:
        return f"it takes no mask over {name}'s axis {axis}"
    return name, axis, masks, made


def pad(bound: dict, plans: list[dict], where: str, fill=None) -> tuple[dict, dict[int, tuple[int, int]]]:
    """`bound` (a call by parameter name) with each plan's inputs padded to its length, its mask made
    where the call gives none and the plan made it, padded with the plan's mask value; and
    {file output index: (axis, the call's length)} to cut the outputs back. A RuntimeError (one
    line) where the text is longer than the file's length. `fill(t, rows)`: the padding rows
    (zeros by default; verify's random rows)."""
    bound = dict(bound)
    cuts: dict[int, tuple[int, int]] = {}
    for plan in plans:
        given = {n: a for n, a in plan["inputs"].items() if isinstance(bound.get(n), torch.Tensor)}
        sizes = {int(bound[n].shape[a]) for n, a in given.items()}
        if not sizes:
            continue  # the file's own input checks name what is missing
        if len(sizes) > 1:
            raise RuntimeError(f"{where} called with {', '.join(f'{n} {list(bound[n].shape)}' for n in given)}, whose "
                               "text lengths differ: give them one text length")
        size, length = sizes.pop(), int(plan["length"])
        if size > length:
            shown = ", ".join(f"{n} {list(bound[n].shape)}" for n in given)
            raise RuntimeError(f"{where} called with a text of {size} positions ({shown}); its file takes at most "
                               f"{length} (shorter texts are padded with masked rows): use a shorter prompt (or "
                               f"max_sequence_length={length}), or convert the pipeline from a folder whose pipeline "
                               "passes longer texts")
        mask = bound.get(plan["mask"])
        if not isinstance(mask, torch.Tensor) and plan.get("mask_made"):
            source = bound.get(plan["mask_from"])
            if isinstance(source, torch.Tensor):
                mask = torch.ones(source.shape[:int(plan["mask_axis"]) + 1], dtype=_dtype(plan["mask_dtype"]))
        rows = length - size
        for n, a in given.items():
            if n != plan["mask"]:  # the mask is padded with its own value (below)
                bound[n] = _grow(bound[n], a, rows, fill)
        if isinstance(mask, torch.Tensor):
            extra = torch.full(_shape_with(mask, int(plan["mask_axis"]), rows), plan.get("mask_pad", 0),
                               dtype=mask.dtype)
            bound[plan["mask"]] = torch.cat([mask, extra], dim=int(plan["mask_axis"]))
        for i, a in (plan.get("outputs") or {}).items():
            cuts[int(i)] = (int(a), size)
    return bound, cuts


def cut(tensors: list, cuts: dict[int, tuple[int, int]]) -> list:
    """The file's outputs with the padded text axis cut back to the call's length."""
    return [t.narrow(cuts[i][0], 0, cuts[i][1]) if i in cuts and isinstance(t, torch.Tensor) else t
            for i, t in enumerate(tensors)]


def batch_with_masks(batch: dict, plans: list[dict]) -> dict:
    """The slot's batch record (pipeline/batching.py) with each made mask following its text's batch."""
    inputs = list(batch.get("inputs", []))
    for plan in plans:
        if plan.get("mask_made") and plan["mask_from"] in inputs and plan["mask"] not in inputs:
            inputs.append(plan["mask"])
    return {**batch, **({"inputs": sorted(inputs)} if inputs else {})}


def renamed(plans: list[dict], names: dict[str, str]) -> list[dict]:
    """The plans with their input names as the file names them (optimum's renames, `names`)."""
    def n(x):
        return names.get(x, x)

    return [{**p, "inputs": {n(k): a for k, a in p["inputs"].items()}, "mask": n(p["mask"]),
             "mask_from": n(p["mask_from"])} for p in plans]


def _verify(module, bound: dict, plan: dict, length: int) -> tuple[bool, object]:
    """(True, {output index: text axis}) where padding to `length` is exact for the module at this
    call (module doc), else (False, why)."""
    base = dict(bound)
    with torch.no_grad():
        ref = _outputs(module, base)
        if plan["mask_made"]:
            ones = dict(base)
            source = base[plan["mask_from"]]
            ones[plan["mask"]] = torch.ones(source.shape[:plan["mask_axis"] + 1], dtype=_dtype(plan["mask_dtype"]))
            err = _compare(ref, _outputs(module, ones), _rtol(module))
            if err is not None:
                return False, f"a mask of ones changes its outputs ({err}): not a mask over the text"
        plan = {**plan, "length": length}
        zero, _ = pad(base, [plan], "")
        padded = _outputs(module, zero)
        axes = _padded_axes(ref, padded)
        if isinstance(axes, str):
            return False, axes
        err = _compare(ref, [t.narrow(axes[i], 0, r.shape[axes[i]]) if i in axes else t
                             for i, (r, t) in enumerate(zip(ref, padded))], _rtol(module))
        if err is not None:
            return False, f"padded with masked zero rows, its outputs change ({err})"
        g = torch.Generator().manual_seed(0)
        noisy, _ = pad(base, [plan], "", fill=lambda t, shape: _random_rows(t, shape, g))
        err = _compare(padded, _outputs(module, noisy), CONTENT_RTOL)
        if err is not None:
            return False, f"the padded rows' values reach its outputs ({err}): the mask does not hide them"
    return True, {str(i): a for i, a in axes.items()}


def _outputs(module, bound: dict) -> list[torch.Tensor]:
    out = module(**bound)
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _padded_axes(ref: list, padded: list) -> dict[int, int] | str:
    """{output index: axis} of the outputs that grew on one axis with the padding; a reason where an
    output changed otherwise."""
    if len(ref) != len(padded):
        return f"padded, it gives {len(padded)} outputs instead of {len(ref)}"
    axes = {}
    for i, (r, p) in enumerate(zip(ref, padded)):
        if r.shape == p.shape:
            continue
        grown = [a for a in range(r.dim()) if r.dim() == p.dim() and r.shape[a] != p.shape[a]]
        if len(grown) != 1 or p.shape[grown[0]] < r.shape[grown[0]]:
            return f"padded, its output {i} changes shape from {list(r.shape)} to {list(p.shape)}"
        axes[i] = grown[0]
    return axes


def _compare(ref: list, got: list, rtol: float) -> str | None:
    """None where every output agrees within rtol x max|ref output| (finite where ref is); else what differs."""
    for i, (r, g) in enumerate(zip(ref, got)):
        if r.shape != g.shape:
            return f"output {i} shape {list(g.shape)} instead of {list(r.shape)}"
        if not (r.is_floating_point() or r.is_complex()):
            if not torch.equal(r, g):
                return f"output {i} differs"
            continue
        r64, g64 = r.detach().double(), g.detach().double()
        finite = torch.isfinite(r64)
        if not torch.isfinite(g64[finite]).all():
            return f"output {i} is not finite where it was"
        scale = float(r64[finite].abs().max()) if finite.any() else 0.0
        err = float((r64 - g64)[finite].abs().max()) if finite.any() else 0.0
        if err > rtol * scale:
            return f"output {i}: max abs difference {err:.2e}, limit {rtol * scale:.2e}"
    return None


def _rtol(module) -> float:
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    return max(PADDED_RTOL, 8 * torch.finfo(dtype).eps)


def bind(module, args: tuple, kwargs: dict) -> dict | None:
    """The call by parameter name (no positional arguments left), return_dict left as given."""
    try:
        sig = inspect.signature(module.forward)
        bound = sig.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None if args else dict(kwargs)
    out = {}
    for k, v in bound.items():
        if sig.parameters[k].kind == inspect.Parameter.VAR_KEYWORD:
            out.update(v)
        elif sig.parameters[k].kind == inspect.Parameter.VAR_POSITIONAL:
            if v:
                return None
        else:
            out[k] = v
    return out


def _text_input(bound: dict, group: dict[str, int]) -> tuple[str, int] | None:
    """The group's text input: its floating tensor of the highest rank whose text axis is not its
    first (the embeddings [B, L, D]); else any tensor of the group with such an axis."""
    found = [(n, a) for n, a in group.items() if isinstance(bound.get(n), torch.Tensor) and a >= 1]
    found.sort(key=lambda na: (not bound[na[0]].is_floating_point(), -bound[na[0]].dim()))
    return found[0] if found else None


def _existing_masks(bound: dict, group: dict[str, int], text: str, axis: int) -> list[str]:
    """The group's inputs that look like a mask over the text: the text's leading dims ([B, L]) or
    [B, ..., L], values of two kinds (0 / 1, or 0 / a large negative fill)."""
    lead = tuple(bound[text].shape[:axis + 1])
    out = []
    for n in group:
        m = bound.get(n)
        if n == text or not isinstance(m, torch.Tensor) or m.dim() < 2 or m.shape[0] != lead[0]:
            continue
        if tuple(m.shape) != lead and m.shape[-1] != lead[-1]:
            continue
        if m.numel() and torch.unique(m).numel() <= 2:
            out.append(n)
    return out


def _unset_masks(module, bound: dict) -> list[str]:
    """Parameters of the module's forward named as a mask that the recorded call leaves None."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return []
    return [n for n, p in params.items() if "mask" in n.lower() and bound.get(n) is None
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _mask_axis(mask: torch.Tensor, size: int) -> int:
    return mask.dim() - 1 if mask.shape[-1] == size else next(a for a in range(1, mask.dim()) if mask.shape[a] == size)


def _mask_pad(mask: torch.Tensor):
    """The mask's value for a padded position: 0 for a 0 / 1 (or boolean) mask, its negative fill for
    an additive one (0 where valid)."""
    if mask.dtype == torch.bool:
        return False
    low = float(mask.min()) if mask.numel() else 0.0
    return low if low < 0 else 0


def _grow(t: torch.Tensor, axis: int, rows: int, fill=None) -> torch.Tensor:
    if rows <= 0:
        return t
    shape = _shape_with(t, axis, rows)
    extra = fill(t, shape) if fill is not None else torch.zeros(shape, dtype=t.dtype)
    return torch.cat([t, extra.to(t.dtype)], dim=axis)


def _random_rows(t: torch.Tensor, shape: list[int], g: torch.Generator) -> torch.Tensor:
    """Rows of values of the input's kind: floats of its spread, integers within its range."""
    if t.is_floating_point():
        scale = float(t.float().std()) if t.numel() > 1 else 1.0
        return torch.randn(shape, generator=g) * (scale or 1.0) + float(t.float().mean())
    if t.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    high = int(t.max()) + 1 if t.numel() else 2
    return torch.randint(0, max(high, 2), shape, generator=g)


def _shape_with(t: torch.Tensor, axis: int, rows: int) -> list[int]:
    shape = list(t.shape)
    shape[axis] = rows
    return shape


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)
