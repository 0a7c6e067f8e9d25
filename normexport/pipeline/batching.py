"""A component file called at another batch than the one it holds (docs/design.md §12;
docs/convert.md, "A pipeline folder out"; issue 46 items 1 and 2).

Classifier-free guidance doubles the denoiser's batch but not the VAE's, a prompt list changes
both, and a denoiser taking one tensor per sample (diffusers' Z-Image: `x` and `cap_feats` are
lists) has as many file inputs as the recorded call had samples. convert records which inputs
follow the batch — the tensors whose first axis, and the list parameters whose length, differ
between the two-prompt run and the one-prompt run (`recorded`) — and writes them in the slot's
manifest entry as `"batch": {"inputs": [paths], "lists": [parameters]}`. Where the file keeps
that batch static (a list's length always is; an exporter fallback to static shapes makes a
tensor's so), `split` cuts the pipeline's call into pieces of the file's batch: each sample goes
to the first free position whose list-element shapes it fits (a denoiser's per-sample text
lengths are fixed per position: guidance puts the prompts first and the negative prompts after),
and a free position is padded with a sample that fits there, every sample being computed
independently of the others. `merge` puts the pieces' outputs back together: an output tensor
whose first axis, or an output list whose length, is the file's batch is gathered back per
sample, in the call's order; anything else is taken from the first piece.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree


def recorded(batched: dict, single: dict | None) -> dict:
    """{"inputs": tensor paths whose first axis follows the batch, "lists": list parameters whose
    length does} from a slot's input shapes in the two-prompt run (`batched`) and the one-prompt
    run (`single`, {path: shape}); empty where the slot has no one-prompt call."""
    if not single:
        return {}

    def lengths(shapes: dict) -> dict[str, int]:
        out: dict[str, set] = {}
        for path in shapes:
            parts = path.split(".")
            if len(parts) > 1 and parts[1].isdigit():  # a list parameter's element (x.0, cap_feats.3)
                out.setdefault(parts[0], set()).add(int(parts[1]))
        return {p: len(i) for p, i in out.items()}

    many, one = lengths(batched), lengths(single)
    lists = sorted(p for p, n in many.items() if p in one and n != one[p])
    inputs = sorted(p for p, s in batched.items() if p.split(".")[0] not in lists and p in single
                    and len(s) >= 1 and len(single[p]) == len(s) and s[0] != single[p][0])
    return {k: v for k, v in (("inputs", inputs), ("lists", lists)) if v}


def split(entry: dict, bound: dict, renames: dict) -> tuple[list[dict], list] | None:
    """The call `bound` (by the recorded names) cut into pieces the slot's file takes, and where
    each of the call's samples went ((piece, position) per sample, for merge); None where the call's
    batch is the file's (or the file keeps it dynamic). A RuntimeError where the call's batched
    inputs do not follow one batch."""
    spec = entry.get("batch") or {}
    files = entry["inputs"]
    items = []  # (kind, path, call's size, file's size or None where the file keeps it dynamic)
    for p in spec.get("lists", []):
        value = bound.get(p)
        if isinstance(value, (list, tuple)):
            held = {k.split(".")[1] for k in files if k.startswith(p + ".") and k.split(".")[1:2] != [""]}
            if held:
                items.append(("list", p, len(value), len(held)))
    leaves = dict(_leaves(bound))
    for p in spec.get("inputs", []):
        t, i = leaves.get(p), files.get(renames.get(p, p))
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and i is not None and i["shape"]:
            items.append(("tensor", p, int(t.shape[0]), None if 0 in i.get("dynamic", []) else i["shape"][0]))
    fixed = [it for it in items if it[3] is not None]
    if not fixed or all(c == f for _, _, c, f in fixed):
        return None
    _, _, calls, size = fixed[0]
    if size == 0 or any(c != calls or (f is not None and f != size) for _, _, c, f in items):
        shown = ", ".join(f"{p} {c} (the file takes {f if f is not None else 'any'})" for _, p, c, f in items)
        raise RuntimeError(f"called with batched inputs that do not follow one batch: {shown}: call it with one "
                           "batch for all of them, or convert the pipeline with this call")
    lists = [p for kind, p, _, _ in items if kind == "list"]

    def fits(sample: int, position: int) -> bool:  # a list element's shapes are the file's at that position
        return all(list(t.shape) == files[renames.get(n, n)]["shape"]
                   for p in lists for n, t in _leaves({f"{p}.{position}": bound[p][sample]})
                   if renames.get(n, n) in files)

    pieces: list[list] = []  # per piece, the call's sample at each position (None: free)
    placed = []  # per sample: (piece, position)
    for sample in range(calls):  # each sample at the first free position it fits, in the first piece that has one
        spot = next(((k, j) for k, piece in enumerate(pieces) for j, v in enumerate(piece)
                     if v is None and fits(sample, j)), None)
        if spot is None:
            pieces.append([None] * size)
            spot = next(((len(pieces) - 1, j) for j in range(size) if fits(sample, j)), (len(pieces) - 1, 0))
            if pieces[spot[0]][spot[1]] is not None:  # fits nowhere: the size check names the shapes
                spot = (spot[0], pieces[spot[0]].index(None))
        pieces[spot[0]][spot[1]] = sample
        placed.append(spot)
    calls_out = []
    for piece in pieces:  # free positions padded with a sample that fits there (every sample is computed alone)
        index = [v if v is not None else next((i for i in range(calls) if fits(i, j)), calls - 1)
                 for j, v in enumerate(piece)]
        call = dict(bound)
        for p in lists:
            call[p] = [bound[p][i] for i in index]
        cut = {p: torch.tensor(index) for kind, p, _, _ in items if kind == "tensor"}
        calls_out.append(_index(call, cut) if cut else call)
    return calls_out, (size, placed)


def merge(outputs: list, where):
    """The pieces' outputs as one (module doc): `where` = (the file's batch, (piece, position) per
    sample of the call)."""
    size, placed = where
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() >= 1 and int(first.shape[0]) == size:
            return torch.stack([outputs[k][j] for k, j in placed])
        return first
    if isinstance(first, list) and len(first) == size:
        return [outputs[k][j] for k, j in placed]
    if isinstance(first, (list, tuple)):
        items = [merge([o[i] for o in outputs], where) for i in range(len(first))]
        return type(first)(items) if not hasattr(first, "_fields") else type(first)(*items)
    if isinstance(first, dict):  # a dict, or a library output class (a ModelOutput is an ordered dict)
        values = {k: merge([o[k] for o in outputs], where) for k in first}
        return values if type(first) is dict else type(first)(**values)
    parameters = getattr(first, "parameters", None)
    if isinstance(parameters, torch.Tensor):  # encode's DiagonalGaussianDistribution: rebuilt from its parameters
        return type(first)(merge([o.parameters for o in outputs], where))
    return first


def key_text(k) -> str:
    """A pytree key as the recorded paths write it (a dict key, a list index, an attribute)."""
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _leaves(bound: dict):
    for path, leaf in pytree.tree_flatten_with_path(bound)[0]:
        yield ".".join(key_text(k) for k in path), leaf


def _index(bound: dict, cut: dict[str, torch.Tensor]) -> dict:
    """`bound` with the tensors at the paths in `cut` indexed along their first axis."""
    def pick(path, leaf):
        name = ".".join(key_text(k) for k in path)
        if name in cut and isinstance(leaf, torch.Tensor):
            return leaf.index_select(0, cut[name].to(leaf.device))
        return leaf

    return pytree.tree_map_with_path(pick, bound)
