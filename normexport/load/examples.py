"""Example inputs, in one place: what a module declares (`example_inputs()`, `input_names`,
`dynamic_axes`), and what normexport derives for a pretrained model from its forward signature
and config.
"""

from __future__ import annotations

import inspect
import re

import torch
from torch import nn

from ..errors import UsageError
from . import docs, entries
from ._util import short
from .dims import Resolver, config_int, config_width, config_widths
from .inputs import padded_mask

BATCH, SEQ, TEXT_SEQ = 2, 8, 6


def declared_inputs(module: nn.Module):
    """Example inputs, names and dynamic axes a module may declare (see models/)."""
    fn = getattr(module, "example_inputs", None)
    example = None
    if callable(fn):
        name = type(module).__name__
        try:
            example = fn()
        except Exception as e:
            raise UsageError(f"{name}.example_inputs() raised {type(e).__name__} ({short(e)}): fix it, "
                             "or remove it and pass --input NAME:DIMS[:DTYPE]") from None
        if isinstance(example, torch.Tensor):
            example = (example,)
        if not isinstance(example, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in example):
            got = type(example).__name__ if not isinstance(example, (tuple, list)) else \
                "a " + type(example).__name__ + " of " + ", ".join(sorted({type(t).__name__ for t in example}))
            raise UsageError(f"{name}.example_inputs() returned {got}, not a tuple of tensors: "
                             "return tensors, or pass --input NAME:DIMS[:DTYPE]")
        example = tuple(example)
    return example, getattr(module, "input_names", None), getattr(module, "dynamic_axes", None)




#: inputs whose first axis is the batch (and, for token ids, the second the sequence)
BATCHED = ("input_ids", "attention_mask", "hidden_states", "timestep", "class_labels", "encoder_hidden_states",
            "pooled_projections", "guidance", "encoder_attention_mask", "pixel_values", "sample", "decoder_input_ids",
            "token_type_ids")


def _cfg(config, *names, default=None):
    for n in names:
        v = config.get(n) if isinstance(config, dict) else getattr(config, n, None)
        if v is not None:
            return v
    return default


def example_kwargs(model, library: str) -> dict[str, torch.Tensor]:
    """Random example inputs (keyword, by forward parameter) that fit the model class (derive);
    what cannot be made is one error (missing_message)."""
    out, missing = derive(model, library)
    if missing:
        raise UsageError(missing_message(type(model).__name__, missing))
    return out


class Made(dict):
    """Example inputs by parameter; `free[p]`: the axes of p's tensor that only count (tokens,
    frames: any small size fits), which the eager check (probe) may resize; `others[p]`: other
    shapes p may have, in order (the eager check tries them when the model's error is about p)."""

    def __init__(self, *a, free: dict | None = None, others: dict | None = None, **k):
        super().__init__(*a, **k)
        self.free = dict(free or {})
        self.others = dict(others or {})


def derive(model, library: str, given: dict | None = None, extra=()) -> tuple[dict, dict[str, str]]:
    """(inputs by forward parameter, {parameter: shape the config implies} when some cannot be
    made: the missing ones first, then the other required ones, for the message; else {}).
    `given` (the user's --input / --inputs values, by parameter) is kept as is, and the derived
    ones take its batch and lengths. Derived: every parameter of forward without a default, plus
    the optional ones the config switches on (class labels, pooled projections, guidance, ...)
    and those in `extra` (the eager check asks for them); shapes from the parameter's name, its
    annotation and documented shape (docs), the config's sizes (channels, image and patch size,
    frames, RoPE axes, text dims) and the folder's processor files (folder_files, set by
    pretrained as `_normexport_folder_sizes`); per-family layouts only where neither the signature
    nor the documentation can tell (CogVideoX's [B, F, C, H, W] latents, LTX-Video's packed tokens).
    A dict parameter (added_cond_kwargs) is an empty entries.Keys: the eager check (probe) fills
    it with the keys the forward reads from it."""
    given = dict(given or {})
    batch = _batch_of(given)
    gen = torch.Generator().manual_seed(0)
    config = model.config
    signature = _signature(model)
    params = list(signature)
    documented = docs.params(model)
    folder = getattr(model, "_normexport_folder_sizes", None) or {}
    required = [p for p, prm in signature.items()
                if prm.default is inspect.Parameter.empty and prm.kind not in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD)]
    wanted = list(dict.fromkeys(required + [p for p in extra if p in signature]))
    if library == "transformers":
        out, missing = _transformers_kwargs(model, config, required, gen, batch, given, folder)
        resolver = Resolver(config, folder, batch, known=_patch_grid(config, {**out, **given}), free_size=SEQ,
                            fallback=_module_sizes(model))
        made = Made({**out, **given})
        for p in wanted:
            if p not in made and p not in missing:
                value = _from_docs(p, documented, resolver, gen, config, made)
                if value is not None:
                    made[p] = value
        for p in list(missing):
            if p not in made:
                value = _from_docs(p, documented, resolver, gen, config, made)
                if value is not None:
                    made[p] = value
        missing = {p: v for p, v in missing.items() if p not in made}
        missing.update({p: _documented_text(documented.get(p), resolver) for p in wanted
                        if p not in made and p not in missing})
        made = Made({**{p: made[p] for p in params if p in made}, **made}, free=made.free)  # forward order
        return made, {p: v for p, v in missing.items() if p not in given}
    sizes = _Sizes(type(model).__name__, config, params, batch, given)
    resolver = Resolver(config, folder, batch, known=sizes.known(), free_size=SEQ, fallback=_module_sizes(model))
    out = Made()
    for p in params:
        if p in given:
            out[p] = given[p]
            continue
        value = sizes.make(p, signature[p], gen, required=p in wanted)
        if p in ("hidden_states", "sample") and isinstance(value, torch.Tensor) and (doc := documented.get(p)) \
                is not None and doc.kind == "tensor" and doc.dims and len(doc.dims) != value.dim():
            # the library documents another latent layout than the generic one (StableAudio's 1-D
            # latents [B, C, L], SVD's [B, F, C, H, W]): its documented shape, where the config resolves it.
            # With per-token position ids (img_ids) the packed tokens stay the other layout to try: a
            # docstring copied from an older model says "(batch size, channel, height, width)"
            # (LongCat-Image, Bria), where another patchifies what it is given (HiDream)
            documented_value = _from_docs(p, documented, resolver, gen, config, out)
            if documented_value is not None and sizes.packed:
                out.others[p] = [tuple(value.shape)]
            value = value if documented_value is None else documented_value
        if value is None and p in wanted:
            value = _from_docs(p, documented, resolver, gen, config, out)
        if value is None and p in wanted and (n := sizes.values(p, _doc_text(documented.get(p)))) is not None:
            value = torch.rand(batch, n, generator=gen) * sizes.size * 8  # micro-conditioning values
        if value is None and p in wanted and (role := _role(documented.get(p))) is not None:
            value = sizes.make(role, signature[p], gen, required=True, name=p, doc=documented[p].doc)
            if documented[p].kind == "list" and isinstance(value, torch.Tensor):  # one per batch item
                value = list(value.unbind(0))
        if value is None and p in wanted:
            value = _sequence_or_mask(p, documented.get(p), config, sizes, gen, out)
        if value is not None:
            out[p] = value
    missing = [p for p in wanted if p not in out]
    if "hidden_states" in params and "hidden_states" not in out:
        missing.append("hidden_states")
    if not missing:
        return out, {}
    listed = list(dict.fromkeys(missing + [p for p in wanted if p not in given]))
    # what was made is listed with its shape; what was not, with the shape the config implies
    return out, {p: _expected(sizes, documented.get(p), resolver, p) if p in missing
                 else _made_text(out[p]) + " (made)" for p in listed}


#: what a parameter is, from the words its documentation uses when its name says nothing (Z-Image's
#: `x` "Input latents", `t` "denoising step", `cap_feats` "caption embeddings"): the name whose
#: example it takes
ROLES = (("timestep", r"\btime ?steps?\b|denoising step|noise level"),
         ("hidden_states", r"\blatents?\b|noisy (input|sample)"),
         ("pooled_projections", r"^\W*pooled\b|\bpooled (?:text |prompt |clip )?(?:embed|projection|output)"),
         ("encoder_hidden_states", r"(caption|text|prompt|conditional[\w ]*) embeddings"))


def _role(documented) -> str | None:
    if documented is None or not documented.doc:
        return None
    text = documented.doc.split(":", 1)[-1].strip().lower()
    return next((role for role, pattern in ROLES if re.search(pattern, text)), None)


def _doc_text(documented) -> str:
    return documented.doc if documented is not None else ""


def _expected(sizes, documented, resolver, p: str) -> str:
    """The shape the config implies for a parameter nothing made, for the refusal: by its name,
    else its documented shape, else the role its documentation names (a pooled embedding: [2x
    cond_embed_dim]), its widths from the config; what nothing gives stays a word."""
    doc = _doc_text(documented)
    text = sizes.expected(p, doc=doc)
    if "unknown" in text and documented is not None and (documented.dims or documented.kind in ("list", "dict")):
        text = _documented_text(documented, resolver)
    if "unknown" in text and (n := sizes.values(p, doc)) is not None:
        text = f"[{sizes.batch}x{n}]"
    if "unknown" in text and (role := _role(documented)) is not None:
        text = sizes.expected(role, name=p, doc=doc)
    return text


def _made_text(value) -> str:
    if isinstance(value, torch.Tensor):
        return "[" + "x".join(map(str, value.shape)) + "]"
    if isinstance(value, (list, tuple)) and value and all(isinstance(t, torch.Tensor) for t in value):
        return f"[{len(value)} x " + _made_text(value[0]).strip("[]") + "]"
    return "[a dict of tensors]" if isinstance(value, dict) else f"[{type(value).__name__}]"


def _documented_text(documented, resolver) -> str:
    """The shape a parameter's documentation gives, its dims resolved against the config and the
    processor: [2x8x80]; a dim nothing resolves is named as the docstring writes it, and said so
    ([2 x image_size x image_size; image_size: not in the config or the processor files])."""
    if documented is not None and documented.kind in ("list", "dict") and not documented.dims:
        return f"[a {documented.kind} of tensors]"
    if documented is None or not documented.dims:
        return "[shape unknown]"
    dims = [documented.formulas.get(d.strip(), d) for d in documented.dims]
    sizes = [resolver.dim(d)[0] for d in dims]
    if all(sizes):
        return "[" + "x".join(map(str, sizes)) + "]"
    unknown = list(dict.fromkeys(d for d, v in zip(dims, sizes) if not v))
    return ("[" + " x ".join(str(v) if v else d for d, v in zip(dims, sizes)) + f"; {', '.join(unknown)}: not in the "
            "config or the processor files]")


def _from_docs(p: str, documented: dict, resolver: Resolver, gen, config, made: Made):
    """A value for parameter p from its documentation (docs) resolved against the config and folder
    (dims.Resolver): a tensor of the documented shape (token ids within the vocabulary, masks all
    ones), a list of per-item tensors, or an int that counts what a made tensor's documented axis
    counts (`audio_num_frames` <- `num_audio_tokens` of audio_hidden_states); None when nothing
    says what it is. Where the config (or the processor) says otherwise than the docstring, it wins
    (_documented_shape): a name the documentation redefines by a formula, pixels the config cuts into
    patches, a mask over another input, image sizes held in an int tensor."""
    doc = documented.get(p)
    if doc is None:
        return None
    if doc.kind == "dict":  # its keys are what the forward reads from it (entries, probe)
        return entries.Keys()
    if doc.kind == "int":
        return _count_of(p, documented, made) or resolver.dim(p)[0]
    if doc.kind not in ("tensor", "list") or not doc.dims:
        return None
    shape, free = _documented_shape(p, documented, resolver, made)
    if shape is None:
        return None
    if doc.kind == "list":  # one tensor per batch item, each without the batch axis
        return None if len(shape) < 2 else [torch.randn(*shape[1:], generator=gen) for _ in range(shape[0])]
    made.free[p] = free
    if "mask" in p:
        return torch.ones(shape, dtype=torch.bool if doc.dtype == "bool" else torch.long)
    if doc.dtype == "long":
        grid = _image_grid(doc, made)
        if grid is not None:
            return torch.tensor([grid] * shape[0], dtype=torch.long)
        high = config_int(config, "vocab_size") or 2
        return torch.randint(0, high, shape, generator=gen)
    return torch.randn(*shape, generator=gen)


#: documented dims that are an image's side, not a width
SPATIAL = {"height", "width", "image_size", "h", "w", "frame_size", "patch_size", "patch_height", "patch_width"}


def _documented_shape(p: str, documented: dict, resolver: Resolver, made: dict) -> tuple[tuple | None, set[int]]:
    """(shape, free axes) of p from its documented dims, where the config and the processor win over
    the docstring: a mask over another input takes that input's made shape (_mask_over); a dim the
    documentation defines by a formula (Pix2Struct's "`hidden_size` = `num_channels` * `patch_size` *
    `patch_size`") is the formula over the config's / processor's sizes, else the name as the
    config means it, a first guess; documented images whose sides nothing gives are the patch
    sequence the config names (_patch_layout). The width of pixels cut into patches is the model's
    to say: the eager check may correct it from the model's own projection (probe)."""
    doc = documented[p]
    if "mask" in p and (over := _mask_over(p, doc, documented, made)) is not None:
        return over, set()
    dims = [doc.formulas.get(d.strip(), d) for d in doc.dims]
    shape, free, _ = resolver.shape(dims)
    if shape is None and dims != doc.dims:
        shape, free, _ = resolver.shape(doc.dims)
    if shape is None and _pixels(p) and _is_image(doc.dims) \
            and (layout := _patch_layout(resolver.config, resolver.folder)) is not None:
        return (resolver.batch, *layout), set()
    last = dims[-1].strip().lower() if shape is not None else ""
    if shape is not None and _pixels(p) and len(shape) >= 3 and last not in SPATIAL and not last.isdigit():
        free = set(free) | {len(shape) - 1}  # flattened patches: the model's patch projection says the width
    return shape, free


def _pixels(p: str) -> bool:
    """An input that carries pixels (pixel_values, flattened_patches, image_patches), not something of them."""
    return bool(re.search(r"pixel|patch", p)) and not re.search(r"emb|mask|ids|position|shape|size|grid", p)


def _is_image(dims: list[str]) -> bool:
    """A documented image: (batch, channels, height, width) or the like, its sides named."""
    names = [d.strip().lower() for d in dims]
    return len(names) >= 4 and any("channel" in n for n in names) and sum(n in SPATIAL for n in names) >= 2


def _patch_layout(config, folder: dict) -> tuple[int, int] | None:
    """(patches, width) of pixels cut into a padded patch sequence [B, patches, channels x patch x
    patch] (Siglip2's NaFlex), when the config names no image size but a patch count
    (`num_patches`) and a patch size, or the processor does (`max_num_patches`, `max_patches`, its
    `patch_size`); the processor's count first (it pads to it), the config's patch size first (the
    weights take it)."""
    if _config_image_size(config) or folder.get("height"):
        return None
    count = folder.get("max_num_patches") or folder.get("max_patches") or config_int(config, "num_patches") \
        or config_int(config, "max_num_patches")
    patch = config_int(config, "patch_size") or folder.get("patch_size")
    channels = config_int(config, "num_channels") or folder.get("num_channels")
    if not (count and patch and channels):
        return None
    return int(count), int(channels) * int(patch) * int(patch)


def _mask_over(p: str, doc, documented: dict, made: dict) -> tuple | None:
    """The shape of a mask documented over another input's dims less one axis (pixel_attention_mask
    `(batch, H, W)` over pixel_values `(batch, C, H, W)`): that input's made shape less the axis,
    or less its last (feature) axis where it was made as a patch sequence [B, N, C*p*p]."""
    mine = [d.strip().lower() for d in doc.dims]
    words = set(p.split("_")) - {"mask", "attention"}
    for q, t in made.items():
        dq = documented.get(q)
        if q == p or not isinstance(t, torch.Tensor) or dq is None or not dq.dims or len(dq.dims) != len(mine) + 1 \
                or not words & set(q.split("_")):
            continue
        theirs = [d.strip().lower() for d in dq.dims]
        for a in range(1, len(theirs)):
            if theirs[:a] + theirs[a + 1:] != mine:
                continue
            if t.dim() == len(theirs):
                return tuple(int(s) for i, s in enumerate(t.shape) if i != a)
            if t.dim() == len(theirs) - 1:
                return tuple(int(s) for s in t.shape[:-1])
    return None


def _sequence_or_mask(p: str, doc, config, sizes: "_Sizes", gen, made: Made):
    """A parameter that neither its name's rules nor its documentation give a shape (the last
    resort of derive): a mask over another made input of its name (encoder_attention_mask_2 over
    encoder_hidden_states_2: ones over that input's batch and tokens), or a sequence of embeddings
    (named *embed*, or documented as embeddings) whose width the config names (HunyuanVideo 1.5's
    image_embeds, "Image embeddings ...": image_embed_dim): [batch, text tokens, width], tokens and
    width free (the eager check resizes them where the model says otherwise); else None."""
    text = doc.doc if doc is not None else ""
    if "mask" in p:
        key = set(p.split("_")) - {"mask", "attention"}
        for q, t in made.items():
            if q != p and isinstance(t, torch.Tensor) and t.dim() == 3 and t.is_floating_point() \
                    and set(q.split("_")) - {"hidden", "states", "embeds"} == key:
                return torch.ones(t.shape[:2], dtype=torch.bool)
        return None
    if re.search(r"embed", p) or re.search(r"\bembeddings?\b", text, re.I):
        width = config_width(config, p, text)
        if width:
            made.free[p] = {1, 2}
            return torch.randn(sizes.batch, sizes.text_seq, int(width), generator=gen)
    return None


def _image_grid(doc, made: dict) -> list[int] | None:
    """(height, width) per image for an int tensor documented `(batch_size, 2)` as the images'
    "(height, width)" (Siglip2's spatial_shapes, LLaVA-NeXT's image_sizes): the sides of the made
    image [B, C, H, W], the patch grid of a made patch sequence [B, N, C*p*p] (as square as N allows)."""
    if len(doc.dims) != 2 or doc.dims[1].strip() != "2" or not re.search(r"height\W+(?:and\s+)?width", doc.doc, re.I):
        return None
    for q, t in made.items():
        if not _pixels(q) or not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        if t.dim() == 4:
            return [int(t.shape[-2]), int(t.shape[-1])]
        if t.dim() == 3:
            n = int(t.shape[1])
            h = max(d for d in range(1, int(n ** 0.5) + 1) if n % d == 0)
            return [h, n // h]
    return None


def _count_of(p: str, documented: dict, made: dict) -> int | None:
    """An int parameter that counts what an axis of a made tensor counts: the documented axis name
    sharing the most words with p (`audio_num_frames` ~ `num_audio_tokens`: "audio")."""
    words = set(p.lower().split("_")) - {"num", "of", "n"}
    best, score = None, 0
    for name, t in made.items():
        doc = documented.get(name)
        if not isinstance(t, torch.Tensor) or doc is None or not doc.dims or len(doc.dims) != t.dim():
            continue
        for axis, dim in enumerate(doc.dims[1:], start=1):
            shared = len(words & (set(dim.lower().split("_")) - {"num", "of", "n"}))
            if shared > score and not dim.isdigit():
                best, score = int(t.shape[axis]), shared
    return best


def make_one(model, library: str, name: str, kwargs: dict):
    """A value for one more parameter the eager check found the model needs (probe), or None; a
    dotted name `param.key` is one entry of a dict parameter (entries)."""
    if "." in name:
        param, key = name.split(".", 1)
        return _entry(model, param, key, kwargs)
    out, _ = derive(model, library, given=kwargs, extra=[name])
    return out.get(name)


def _entry(model, param: str, key: str, kwargs: dict):
    """One entry of a dict parameter, at the batch and latent size of the other inputs; its free
    axes (a guessed width the model's error may correct) noted on the Keys dict (entries)."""
    batch = _batch_of(kwargs)
    latents = next((v for n, v in kwargs.items() if n in ("sample", "hidden_states") and isinstance(v, torch.Tensor)
                    and v.dim() >= 4), None)
    side = int(latents.shape[-1]) if latents is not None else 8
    value, free = entries.entry(key, model.config, batch, side, torch.Generator().manual_seed(0))
    if isinstance(kwargs.get(param), entries.Keys):
        kwargs[param].free[key] = free
    return value


def missing_message(cls_name: str, missing: dict[str, str]) -> str:
    """The one line when example inputs cannot be made: what is missing, every required input with
    the shape the config implies, and the two ways a user can always give inputs (docs/design.md §9)."""
    lacking = [p for p, shape in missing.items() if not shape.endswith("(made)")]
    each = "; ".join(f"{p} {shape.removesuffix(' (made)')}" for p, shape in missing.items())
    plain = [p for p in lacking if " of tensors" not in missing[p]]  # --input gives plain tensors only
    flags = " ".join(f"--input {p}:{_dims_text(missing[p])}" for p in plain)
    capture = (f"record a real call with `with normexport.capture(model, \"inputs.pt\"): pipeline(...)` and pass "
               f"--inputs inputs.pt")
    if len(plain) < len(lacking):
        return (f"{cls_name}: normexport cannot make example inputs for {', '.join(lacking)} ({each}): "
                f"{capture} (--input NAME:DIMS gives plain tensors only)")
    return (f"{cls_name}: normexport cannot make example inputs for {', '.join(lacking)}: pass --input NAME:DIMS[:DTYPE] "
            f"for each required forward input ({each}), e.g. {flags}; or {capture}")


def _dims_text(shape: str) -> str:
    """The DIMS of an --input hint: the sizes when every one is a number (`2x6x12`, `2x6:bool`), else
    `DIMS` (a size the config does not give is never written into the hint's syntax)."""
    inner = shape.removesuffix(" (made)").strip("[]")
    return inner if re.fullmatch(r"\d+(x\d+)*(:\w+)?", inner) else "DIMS"


def _batch_of(given: dict) -> int:
    """The batch of the user's inputs (the first axis of a batched one), else BATCH."""
    for name, v in given.items():
        if name in BATCHED and isinstance(v, torch.Tensor) and v.dim() >= 1:
            return int(v.shape[0])
    return BATCH


def _signature(model) -> dict:
    try:
        params = dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}
    params.pop("self", None)
    return params


def _transformers_kwargs(model, config, required, gen, batch=BATCH, given=None, folder=None):
    """Token ids for text models (and decoder ids for encoder-decoders); images for vision models
    (`pixel_values` [B, channels, height, width] from the config, else the folder's processor
    config); any other main input (audio features, ...) from its documented shape (derive)."""
    name = getattr(model, "main_input_name", "input_ids")
    given = given or {}
    folder = folder or {}
    if name == "pixel_values":
        layout = _patch_layout(config, folder)
        if layout is not None:  # a patch sequence (NaFlex): the layout the config names, not the docs' image
            return {name: torch.randn(batch, *layout, generator=gen)}, {}
        channels, side = _image_sizes(config)
        channels = channels or folder.get("num_channels")  # the processor's image_mean has one value per channel
        channels = channels or _first_conv_channels(model)  # what the model's own first convolution takes
        height = width = side
        if not _config_image_size(config) and folder.get("height"):  # the size only the processor config gives
            height, width = folder["height"], folder["width"]
        if channels and height:
            return {name: torch.randn(batch, channels, height, width, generator=gen)}, {}
        return {}, {name: f"[{batch}x{channels or 'CHANNELS'}x{height or 'H'}x{width or 'W'}]"}
    out = {}
    if name == "input_ids":
        vocab = int(_cfg(config, "vocab_size", default=32))
        out["input_ids"] = torch.randint(0, vocab, (batch, SEQ), generator=gen)
        out.update(_padding_inputs(model, config, given.get("input_ids", out["input_ids"]), given))
    missing = {} if name == "input_ids" or name in given else {name: "[shape unknown]"}
    if _cfg(config, "is_encoder_decoder") and "decoder_input_ids" in _signature(model) \
            and "decoder_inputs_embeds" not in given:
        # encoder-decoders (T5, BART, Whisper): the decoder's tokens, a shorter sequence than the encoder's
        vocab = int(_cfg(config, "vocab_size", default=32))
        out["decoder_input_ids"] = torch.randint(0, vocab, (batch, DECODER_SEQ), generator=gen)
        start = folder.get("decoder_start_token_id", _cfg(config, "decoder_start_token_id"))
        if isinstance(start, int) and 0 <= start < vocab:
            out["decoder_input_ids"][:, 0] = start
    return out, missing


def _padding_inputs(model, config, ids, given: dict) -> dict[str, torch.Tensor]:
    """What a text encoder is deployed with beside its token ids (as a tokenizer gives them, and as
    optimum exports them): `attention_mask` (int64 ones, the last 2 tokens padding in all but the first
    row) and, where the config has more than one token type, `token_type_ids` (the second half of each
    row type 1). Not for models that generate: a causal LM's inputs are the KV-cache task's."""
    generates = getattr(model, "can_generate", None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or (callable(generates) and generates()):
        return {}
    params = _signature(model)
    batch, seq = (int(d) for d in ids.shape)
    out = {}
    if "attention_mask" in params and "attention_mask" not in given:
        out["attention_mask"] = padded_mask(batch, seq)
    types = _cfg(config, "type_vocab_size")
    if "token_type_ids" in params and "token_type_ids" not in given and isinstance(types, int) and types > 1:
        kinds = torch.zeros(batch, seq, dtype=torch.long)
        kinds[:, seq // 2:] = 1
        out["token_type_ids"] = kinds
    return out


def _patch_grid(config, made: dict) -> dict[str, int]:
    """A patch model's sequence: images [B, C, H, W] made with the config's patch_size give
    (H / p) x (W / p) patches, the `sequence_length` / `num_patches` its other inputs are documented
    with (ViTMAE's noise, a masked-patch mask)."""
    images = made.get("pixel_values")
    patch = config_int(config, "patch_size")
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or not patch:
        return {}
    h, w = int(images.shape[-2]), int(images.shape[-1])
    if h % patch or w % patch:
        return {}
    n = (h // patch) * (w // patch)
    return {"sequence_length": n, "num_patches": n}


def _first_conv_channels(model) -> int | None:
    """The input channels of the model's first 2-D convolution (in module order: the stem that
    takes the image), when neither the config nor the folder names them."""
    return _first_conv_in(model, (torch.nn.Conv2d,))


def _first_conv_in(model, kinds) -> int | None:
    conv = next((m for m in model.modules() if isinstance(m, kinds)), None)
    return int(conv.in_channels) if conv is not None else None


def _module_sizes(model) -> dict[str, int]:
    """Sizes of documented dims the model's modules give where its config names none (dims.Resolver's
    fallback): `channels` are what its first convolution (1-, 2- or 3-D: the audio's too) takes."""
    if not isinstance(model, torch.nn.Module):
        return {}
    channels = _first_conv_in(model, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d))
    return {} if channels is None else {k: channels for k in ("channels", "channel", "num_channels", "in_channels")}


#: image side when neither the config nor the folder names one (CNNs take any size; 64 survives 32x downsampling)
IMAGE_SIZE = 64


def _image_sizes(config) -> tuple[int | None, int | None]:
    """(channels, side) of a vision model's images from its config: num_channels (of the config or
    a sub-config: vision_config, backbone_config) and image_size, IMAGE_SIZE when it names none."""
    channels = config_int(config, "num_channels") or config_int(config, "in_channels") or config_int(config, "in_chans")
    size = _config_image_size(config) or IMAGE_SIZE
    return (int(channels) if channels else None), (int(size) if size else None)


def _config_image_size(config) -> int | None:
    sub = _cfg(config, "vision_config")
    size = _cfg(config, "image_size") or (sub is not None and _cfg(sub, "image_size"))
    if isinstance(size, (list, tuple)):
        size = size[0]
    if isinstance(size, dict):
        size = size.get("height") or size.get("shortest_edge")
    return int(size) if size else None


DECODER_SEQ = 4
#: classes whose forward reads the text mask's values in python (`mask.sum(1).tolist()` sizes the
#: joint sequence, position ids and loops): the export is fixed to the example mask, so the example
#: is all ones (no padding: every prompt the full text length; the file then ignores the mask)
MASK_READ_AS_VALUES = ("Lumina2Transformer2DModel",)
#: classes whose forward loops over the batch in python: no exporter keeps the batch dynamic (torch.export
#: infers a static batch; the TorchScript tracer bakes it), so their files get a static batch
BATCH_LOOP = {"MochiTransformer3DModel": "its attention processor (MochiAttnProcessor2_0) loops over the batch in "
                                        "python to drop each prompt's padding tokens"}
#: latent frames of a video example (a multiple of the temporal patch)
FRAMES = 2


class _Sizes:
    """The sizes a diffusers model's config implies for its forward inputs."""

    def __init__(self, cls_name: str, config, params: list[str], batch: int = BATCH, given: dict | None = None):
        self.cls, self.config, self.params, self.batch = cls_name, config, params, batch
        given = given or {}
        c = lambda *n, default=None: _cfg(config, *n, default=default)  # noqa: E731
        self.in_ch = int(c("in_channels", default=4))
        patch = c("patch_size", default=1) or 1
        self.patch = int(patch[-1] if isinstance(patch, (list, tuple)) else patch)
        patch_t = c("patch_size_t") or (patch[0] if isinstance(patch, (list, tuple)) else 1)
        self.patch_t = int(patch_t or 1)
        size = c("sample_size")
        if isinstance(size, (list, tuple)):
            size = size[0]
        # latents: the config's sample size when it is small, else 2 patches per side
        self.size = int(size) if size and int(size) <= 16 else 2 * self.patch
        self.height = int(c("sample_height", default=0) or 0) or self.size
        self.width = int(c("sample_width", default=0) or 0) or self.size
        if self.height > 16 or self.width > 16:
            self.height = self.width = 2 * self.patch
        self.video = "3D" in cls_name or c("patch_size_t") is not None or isinstance(patch, (list, tuple))
        self.frames = FRAMES * self.patch_t if self.video else 0
        self.text_dim = c("text_embed_dim", "text_dim", "cap_feat_dim", "joint_attention_dim", "caption_channels",
                          "encoder_hid_dim", "cross_attention_dim")  # encoder_hid_dim: the encoder's, projected to cross_attention_dim
        if isinstance(self.text_dim, (list, tuple)):
            self.text_dim = self.text_dim[0]
        # a text width under another name (UVit2D's encoder_hidden_size): the config key named for the input
        self.text_dim = self.text_dim or config_width(config, "encoder_hidden_states")
        self.text_seq = int(c("max_text_seq_length", default=TEXT_SEQ)) if c("use_learned_positional_embeddings") \
            else TEXT_SEQ
        text = given.get("encoder_hidden_states")
        if isinstance(text, torch.Tensor) and text.dim() == 3:  # the user's text length
            self.text_seq = int(text.shape[1])
        # Flux, Qwen-Image: packed latents [B, tokens, C], float timesteps
        self.packed = "img_ids" in params or "img_shapes" in params
        axes = c("axes_dims_rope")  # RoPE axes: one position-id column each (Flux.1: 3, Flux.2: 4)
        self.id_cols = len(axes) if isinstance(axes, (list, tuple)) and axes else 3
        latents = given.get("hidden_states")
        self.seq = int(latents.shape[1]) if self.packed and isinstance(latents, torch.Tensor) and latents.dim() == 3 \
            else SEQ
        self.tokens_in = "num_frames" in params and "video_coords" in params  # LTX-Video: patchified tokens

    def known(self) -> dict[str, int]:
        """The latent sizes by the names diffusers documents them with (dims.Resolver)."""
        known = {"height": self.height, "width": self.width, "text_seq_len": self.text_seq}
        if self.video:
            known["num_frames"] = known["frames"] = self.frames
        return known

    def hidden_shape(self) -> tuple:
        if self.packed:
            return self.batch, self.seq, self.in_ch
        if self.tokens_in:
            return self.batch, self.frames * self.height * self.width, self.in_ch
        if self.video:
            if self.cls.startswith("CogVideoX"):  # per family: frames before channels
                return self.batch, self.frames, self.in_ch, self.height, self.width
            return self.batch, self.in_ch, self.frames, self.height, self.width
        return self.batch, self.in_ch, self.height, self.width

    def pooled_dim(self, name: str = "pooled_projections", doc: str = "") -> int | None:
        """The width of a pooled embedding: pooled_projection_dim, else the config key named for the
        input (UVit2D's `pooled_text_emb`, "Pooled text embeddings used for additional
        conditioning": cond_embed_dim)."""
        v = _cfg(self.config, "pooled_projection_dim")
        return int(v) if v else config_width(self.config, name, doc, role=("pooled",))

    def values(self, p: str, doc: str = "") -> int | None:
        """The count of conditioning values p holds (embedded one by one): by its name
        (entries.value_count: time_ids 6, original_size 2), else the ratio of the config's two
        widths named for it, all of them embedded over one encoded (UVit2D's micro_conds:
        micro_cond_embed_dim / micro_cond_encode_dim)."""
        n = entries.value_count(p)
        if n is not None:
            return n
        if not re.search(r"\bvalues?\b|\bconditioning\b", doc, re.I):
            return None
        widths = config_widths(self.config, p)
        if len(widths) >= 2 and max(widths) % min(widths) == 0 and max(widths) > min(widths):
            return max(widths) // min(widths)
        return None

    def expected(self, p: str, name: str | None = None, doc: str = "") -> str:
        """The shape of input p (made under the name `name`, documented `doc`) the config implies; a
        width the config does not give is a word (TEXT_DIM, DIM)."""
        latents = "x".join(map(str, self.hidden_shape()))
        pooled = self.pooled_dim(name or p, doc) if p == "pooled_projections" else None
        shapes = {"hidden_states": latents, "sample": latents, "timestep": f"{self.batch}",
                  "encoder_hidden_states": f"{self.batch}x{self.text_seq}x{self.text_dim or 'TEXT_DIM'}",
                  "encoder_attention_mask": f"{self.batch}x{self.text_seq}:bool",
                  "pooled_projections": f"{self.batch}x{pooled or 'DIM'}",
                  "img_ids": f"{self.seq}x{self.id_cols}", "txt_ids": f"{self.text_seq}x{self.id_cols}"}
        return "[" + shapes.get(p, "shape unknown") + "]"

    def make(self, p: str, prm, gen, required: bool, name: str | None = None, doc: str = ""):
        """A value for input p (or for an input named `name` whose documentation `doc` names p's role)."""
        c = lambda *n, default=None: _cfg(self.config, *n, default=default)  # noqa: E731
        annotation = str(prm.annotation)
        if p in ("hidden_states", "sample"):  # the latents (an autoencoder's: its images)
            return torch.randn(*self.hidden_shape(), generator=gen)
        if p == "timestep":
            if self.packed or ("Long" not in annotation and "int" not in annotation):
                return torch.rand(self.batch, generator=gen)  # flow matching: t in [0, 1]
            return torch.randint(1, 1000, (self.batch,), generator=gen)
        if p == "encoder_hidden_states" and self.text_dim:
            # another input in this role (HunyuanVideo 1.5's encoder_hidden_states_2, "embeddings computed from a
            # second text encoder"): the width the config names for it, where it names one
            width = (config_width(self.config, name, doc) if name and name != p else None) or self.text_dim
            return torch.randn(self.batch, self.text_seq, int(width), generator=gen)
        if p == "encoder_attention_mask" and (required or "encoder_hidden_states" in self.params):
            if not required:
                return None
            if self.cls in MASK_READ_AS_VALUES:
                return torch.ones(self.batch, self.text_seq, dtype=torch.bool)
            return padded_mask(self.batch, self.text_seq, torch.bool)  # padding in all but the first prompt
        if p == "pooled_projections" and (width := self.pooled_dim(name or p, doc)):
            return torch.randn(self.batch, int(width), generator=gen)
        if p == "class_labels" and c("num_embeds_ada_norm"):
            return torch.randint(0, int(c("num_embeds_ada_norm")), (self.batch,), generator=gen)
        if p == "img_ids":
            return torch.randn(self.seq, self.id_cols, generator=gen)
        if p == "txt_ids":
            return torch.randn(self.text_seq, self.id_cols, generator=gen)
        if p == "img_shapes":  # per prompt (frames, height, width) of the packed latent grid: a python constant
            grid = (1, 2, self.seq // 2) if self.seq % 2 == 0 else (1, 1, self.seq)
            return [grid] * self.batch
        if p == "guidance" and c("guidance_embeds"):
            return torch.full((self.batch,), 3.5)
        if self.tokens_in and p in ("num_frames", "height", "width"):
            return {"num_frames": self.frames, "height": self.height, "width": self.width}[p]
        return None


def forward_parameters(model) -> list[str]:
    return list(inspect.signature(model.forward).parameters)


