"""Example inputs, in one place: what a module declares (`example_inputs()`, `input_names`,
`dynamic_axes`), and what normexport derives for a pretrained model from its forward signature
and config.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..errors import UsageError
from . import docs, entries
from ._util import short
from .dims import Resolver, config_int

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
            "pooled_projections", "guidance", "encoder_attention_mask", "pixel_values", "sample", "decoder_input_ids")


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
    frames: any small size fits), which the eager check (probe) may resize."""

    def __init__(self, *a, free: dict | None = None, **k):
        super().__init__(*a, **k)
        self.free = dict(free or {})


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
        resolver = Resolver(config, folder, batch, known=_patch_grid(config, {**out, **given}), free_size=SEQ)
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
    resolver = Resolver(config, folder, batch, known=sizes.known(), free_size=SEQ)
    out = Made()
    for p in params:
        if p in given:
            out[p] = given[p]
            continue
        value = sizes.make(p, signature[p], gen, required=p in wanted)
        if p in ("hidden_states", "sample") and isinstance(value, torch.Tensor) and (doc := documented.get(p)) \
                is not None and doc.kind == "tensor" and doc.dims and len(doc.dims) != value.dim():
            # the library documents another latent layout than the generic one (StableAudio's 1-D
            # latents [B, C, L], SVD's [B, F, C, H, W]): its documented shape, where the config resolves it
            documented_value = _from_docs(p, documented, resolver, gen, config, out)
            value = value if documented_value is None else documented_value
        if value is None and p in wanted:
            value = _from_docs(p, documented, resolver, gen, config, out)
        if value is None and p in wanted and (role := _role(documented.get(p))) is not None:
            value = sizes.make(role, signature[p], gen, required=True)
            if documented[p].kind == "list" and isinstance(value, torch.Tensor):  # one per batch item
                value = list(value.unbind(0))
        if value is None and p in wanted and (n := entries.value_count(p)) is not None:
            value = torch.rand(batch, n, generator=gen) * sizes.size * 8  # micro-conditioning values
        if value is not None:
            out[p] = value
    missing = [p for p in wanted if p not in out]
    if "hidden_states" in params and "hidden_states" not in out:
        missing.append("hidden_states")
    if not missing:
        return out, {}
    listed = list(dict.fromkeys(missing + [p for p in wanted if p not in given]))
    return out, {p: _expected(sizes, documented.get(p), resolver, p) + ("" if p in missing else " (made)") for p in listed}


#: what a parameter is, from the words its documentation uses when its name says nothing (Z-Image's
#: `x` "Input latents", `t` "denoising step", `cap_feats` "caption embeddings"): the name whose
#: example it takes
ROLES = (("timestep", r"\btime ?steps?\b|denoising step|noise level"),
         ("hidden_states", r"\blatents?\b|noisy (input|sample)"),
         ("encoder_hidden_states", r"(caption|text|prompt|conditional[\w ]*) embeddings"))


def _role(documented) -> str | None:
    import re

    if documented is None or not documented.doc:
        return None
    text = documented.doc.split(":", 1)[-1].lower()
    return next((role for role, pattern in ROLES if re.search(pattern, text)), None)


def _expected(sizes, documented, resolver, p: str) -> str:
    text = sizes.expected(p)
    return _documented_text(documented, resolver) if "unknown" in text and documented is not None else text


def _documented_text(documented, resolver) -> str:
    """The shape a parameter's documentation gives, its resolved dims as numbers: [2x8xfeature_dim]."""
    if documented is not None and documented.kind in ("list", "dict") and not documented.dims:
        return f"[a {documented.kind} of tensors]"
    if documented is None or not documented.dims:
        return "[shape unknown]"
    return "[" + "x".join(str(resolver.dim(d)[0] or d) for d in documented.dims) + "]"


def _from_docs(p: str, documented: dict, resolver: Resolver, gen, config, made: Made):
    """A value for parameter p from its documentation (docs) resolved against the config and folder
    (dims.Resolver): a tensor of the documented shape (token ids within the vocabulary, masks all
    ones), a list of per-item tensors, or an int that counts what a made tensor's documented axis
    counts (`audio_num_frames` <- `num_audio_tokens` of audio_hidden_states); None when nothing
    says what it is."""
    doc = documented.get(p)
    if doc is None:
        return None
    if doc.kind == "dict":  # its keys are what the forward reads from it (entries, probe)
        return entries.Keys()
    if doc.kind == "int":
        return _count_of(p, documented, made) or resolver.dim(p)[0]
    if doc.kind not in ("tensor", "list") or not doc.dims:
        return None
    shape, free, unknown = resolver.shape(doc.dims)
    if shape is None:
        return None
    if doc.kind == "list":  # one tensor per batch item, each without the batch axis
        return None if len(shape) < 2 else [torch.randn(*shape[1:], generator=gen) for _ in range(shape[0])]
    made.free[p] = free
    if "mask" in p:
        return torch.ones(shape, dtype=torch.bool if doc.dtype == "bool" else torch.long)
    if doc.dtype == "long":
        high = config_int(config, "vocab_size") or 2
        return torch.randint(0, high, shape, generator=gen)
    return torch.randn(*shape, generator=gen)


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
    the shape the config implies, and the two ways a user can always give inputs (DESIGN §9)."""
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
    inner = shape.removesuffix(" (made)").strip("[]")
    return "DIMS" if not inner or "unknown" in inner else inner


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
    conv = next((m for m in model.modules() if isinstance(m, torch.nn.Conv2d)), None)
    return int(conv.in_channels) if conv is not None else None


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

    def expected(self, p: str) -> str:
        latents = "x".join(map(str, self.hidden_shape()))
        shapes = {"hidden_states": latents, "sample": latents, "timestep": f"{self.batch}",
                  "encoder_hidden_states": f"{self.batch}x{self.text_seq}x{self.text_dim or 'TEXT_DIM'}",
                  "encoder_attention_mask": f"{self.batch}x{self.text_seq}:bool",
                  "pooled_projections": f"{self.batch}x{_cfg(self.config, 'pooled_projection_dim', default='DIM')}",
                  "img_ids": f"{self.seq}x{self.id_cols}", "txt_ids": f"{self.text_seq}x{self.id_cols}"}
        return "[" + shapes.get(p, "shape unknown") + "]"

    def make(self, p: str, prm, gen, required: bool):
        c = lambda *n, default=None: _cfg(self.config, *n, default=default)  # noqa: E731
        annotation = str(prm.annotation)
        if p in ("hidden_states", "sample"):  # the latents (an autoencoder's: its images)
            return torch.randn(*self.hidden_shape(), generator=gen)
        if p == "timestep":
            if self.packed or ("Long" not in annotation and "int" not in annotation):
                return torch.rand(self.batch, generator=gen)  # flow matching: t in [0, 1]
            return torch.randint(1, 1000, (self.batch,), generator=gen)
        if p == "encoder_hidden_states" and self.text_dim:
            return torch.randn(self.batch, self.text_seq, int(self.text_dim), generator=gen)
        if p == "encoder_attention_mask" and (required or "encoder_hidden_states" in self.params):
            if not required:
                return None
            mask = torch.ones(self.batch, self.text_seq, dtype=torch.bool)
            if self.cls not in MASK_READ_AS_VALUES:
                mask[1:, -2:] = False  # padding in all but the first prompt
            return mask
        if p == "pooled_projections" and c("pooled_projection_dim"):
            return torch.randn(self.batch, int(c("pooled_projection_dim")), generator=gen)
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


