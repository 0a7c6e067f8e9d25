"""A documented shape made concrete (docs/design.md §9): the dim names a library writes in its docstrings
(`batch_size`, `num_channels`, `height`, `self.config.caption_channels`, `sequence_length`)
resolved against the config (and its sub-configs), the folder's processor files
(folder_files), and the sizes the example already uses. A dim that only counts tokens or
frames is "free": any small size does, and the eager check (probe) may change it when the model
asks for another.
"""

from __future__ import annotations

import re

#: dims that are the batch
BATCH_NAMES = {"batch", "batch_size", "batch size", "bs", "b", "n"}
#: sub-configs a size may live in (a detector's backbone, a multimodal model's towers)
SUB_CONFIGS = ("vision_config", "backbone_config", "audio_config", "encoder_config", "text_config")
#: aliases: a documented name -> the config / folder keys that give it, in order
ALIASES = {
    "channel": ("in_channels", "num_channels", "in_chans", "input_channels"),
    "channels": ("in_channels", "num_channels", "in_chans", "input_channels"),
    "num_channels": ("num_channels", "in_channels", "in_chans"),
    "in_channels": ("in_channels", "num_channels"),
    "feature_dim": ("num_mel_bins", "feature_size", "input_feat_per_channel", "input_dim"),
    "feature_size": ("num_mel_bins", "feature_size", "input_feat_per_channel"),
    "num_mel_bins": ("num_mel_bins", "feature_size"),
    "hidden_size": ("hidden_size", "d_model", "dim", "inner_dim"),
    "embed_dim": ("hidden_size", "d_model", "embed_dim"),
    "height": ("height", "image_size"),
    "width": ("width", "image_size"),
    "image_size": ("image_size", "height"),
    "image_channels": ("num_channels", "in_channels", "in_chans"),
    "patch_height": ("patch_height", "patch_size"),
    "patch_width": ("patch_width", "patch_size"),
}
#: a dim written as arithmetic of names (`num_channels * patch_size * patch_size`, `patch_size_ x
#: patch_size x num_channels`, `2 + patch_height * patch_width * image_channels`, `patch_size**2`)
_EXPR_TOKEN = re.compile(r"\*\*|[*+/()-]|(?<![\w.])x(?![\w.])|[A-Za-z_][\w.]*|\d+")


def _get(config, key):
    v = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    return v


def config_int(config, key: str) -> int | None:
    """A positive int the config (or one of its sub-configs) gives for `key`."""
    for cfg in [config] + [_get(config, s) for s in SUB_CONFIGS]:
        if cfg is None:
            continue
        v = _get(cfg, key)
        if isinstance(v, (list, tuple)) and v and all(isinstance(x, int) for x in v) and key.endswith("size"):
            v = v[0]
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


class Resolver:
    """Dim names -> sizes for one example call. `known`: sizes the caller fixes by name (a
    diffusers model's latent height / width / frames / text length); `folder`: the folder's
    processor sizes; `free_size`: a size for token / frame counts (kept per name, so two inputs
    documented with `text_seq_len` agree); `fallback`: sizes by name the model's own modules give
    (its first convolution's input channels), taken only where neither the config nor the folder
    names the dim (Encodec's `channels`, which its config calls `audio_channels`)."""

    def __init__(self, config, folder: dict | None, batch: int, known: dict | None = None, free_size: int = 8,
                 fallback: dict | None = None):
        self.config, self.folder, self.batch = config, dict(folder or {}), batch
        self.known = dict(known or {})
        self.fallback = dict(fallback or {})  # sizes the model's modules give, when no config key does
        self.free_size = free_size
        self.free: dict[str, int] = {}

    def dim(self, name: str) -> tuple[int | None, bool]:
        """(size, free) for one documented dim name; (None, False) when nothing gives it. A dim
        written as arithmetic of names is computed from theirs (free when one of them is)."""
        raw = name.strip()
        key = re.sub(r"^(self\.)?(config\.)", "", raw.lower()).strip().rstrip("_")
        if raw.isdigit():
            return int(raw), False
        if is_expression(key):
            return self._expression(key)
        if key in BATCH_NAMES:
            return self.batch, True
        if key in self.known:
            return self.known[key], False
        for k in (key,) + ALIASES.get(key, ()):
            if k in self.known:
                return self.known[k], False
            if k in self.folder:
                return self.folder[k], False
            v = config_int(self.config, k)
            if v is not None:
                return v, False
        for k in (key,) + ALIASES.get(key, ()):
            if k in self.fallback:
                return self.fallback[k], False
        if _counts(key):
            return self.free.setdefault(key, self.free_size if "target" not in key else max(2, self.free_size // 2)), True
        return None, False

    def _expression(self, key: str) -> tuple[int | None, bool]:
        import ast

        text, free = [], False
        for tok in _EXPR_TOKEN.findall(key):
            if tok == "x":
                tok = "*"
            elif tok[0].isalpha() or tok[0] == "_":
                v, is_free = self.dim(tok)
                if v is None:
                    return None, False
                tok, free = str(v), free or is_free
            text.append(tok)
        try:
            tree = ast.parse("".join(text), mode="eval")
            if not all(isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult,
                                      ast.FloorDiv, ast.Div, ast.Pow)) for n in ast.walk(tree)):
                return None, False
            v = eval(compile(tree, "<dim>", "eval"), {"__builtins__": {}})  # ints and + - * / ** only
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError):
            return None, False
        return (int(v), free) if isinstance(v, (int, float)) and v > 0 and int(v) == v else (None, False)

    def shape(self, dims: list[str]) -> tuple[tuple[int, ...] | None, set[int], list[str]]:
        """(shape, free axes, unresolved names) of a documented shape; a repeated name (`image_size,
        image_size`) is one size. A new free dim takes a size no other axis of the shape has, so an
        error that names a size says which axis it is about."""
        keys = [re.sub(r"^(self\.)?(config\.)", "", d.strip().lower()).strip() for d in dims]
        counted = [k not in BATCH_NAMES and not is_expression(k) and _counts(k) and k not in self.known
                   and k not in self.folder
                   and k not in ALIASES and k not in self.fallback and config_int(self.config, k) is None for k in keys]
        bound = {self.dim(d)[0] for d, c in zip(dims, counted) if not c}
        for key, c in zip(keys, counted):
            if c and key not in self.free:
                size = self.free_size if "target" not in key else max(2, self.free_size // 2)
                while size in bound or size == self.batch:
                    size += 1
                self.free[key] = size
        sizes, free, unknown = [], set(), []
        for i, d in enumerate(dims):
            v, is_free = self.dim(d)
            if v is None:
                unknown.append(d)
                continue
            sizes.append(v)
            if is_free and i > 0:
                free.add(i)
        return (tuple(sizes) if not unknown else None), free, unknown


def _counts(key: str) -> bool:
    """A dim that counts tokens, frames or positions: any small size fits it."""
    return bool(re.search(r"(seq|sequence|length|len|tokens|frames|num_patches|positions|steps|time)", key)) \
        or key.startswith("num_")  # a count no config key names (SVD's num_additional_ids): the eager check sizes it


def is_expression(key: str) -> bool:
    """A documented dim written as arithmetic of names (`num_channels * patch_size**2`, `a x b`)."""
    return bool(re.search(r"[*+/]|\s-\s|\sx\s", key))


#: endings of config keys that name a width (`encoder_hidden_size`, `pooled_projection_dim`,
#: `caption_channels`, `cond_embed_dim`)
WIDTH_KEY = re.compile(r"^[a-z][a-z0-9_]*_(dim|size|channels|features)$")
#: words that say nothing of what a width is for
_PLAIN_WORDS = {"dim", "size", "channels", "features", "in", "out", "num", "of", "the", "a", "to", "and", "with",
                "for", "is", "be", "that", "are", "used", "input", "inputs", "tensor", "torch", "shape", "batch"}


#: words every tensor input of a model could be named with: a key named only with them (`hidden_size`)
#: is the model's own width, not the width of an input
_WEAK_WORDS = {"hidden", "states", "embed", "embeds", "emb", "embedding", "embeddings"}
#: words that say how a key's value embeds the input (`micro_cond_embed_dim`, `micro_cond_encode_dim`)
_HOW_WORDS = {"embed", "encode", "embedding", "encoding", "proj", "projection"}


def config_width(config, name: str, doc: str = "", role: tuple[str, ...] = ()) -> int | None:
    """The width the config gives an input named `name` (documented `doc`): the config key ending in
    _dim / _size / _channels / _features whose words the input's name, its role words and its
    documentation use (`encoder_hidden_states` ~ `encoder_hidden_size`, "Pooled text embeddings
    used for additional conditioning" ~ `cond_embed_dim`): every one of the key's words used
    (prefixes count: emb ~ embeddings, cond ~ conditioning), one of them more than `hidden` /
    `embed` (`hidden_size` is the model's own width); the key with the most words the name itself
    uses, then the most words; None when no key is named so."""
    # an ordinal the name ends in is a word of it: encoder_hidden_states_2 ~ text_embed_2_dim (and only
    # a name with the ordinal takes a key with one)
    own = _words(name) | set(role) | set(re.findall(r"(?<=_)\d+$", name))
    told = own | _words(doc)
    best, best_score = None, (0, 0)
    for key in _config_keys(config):
        if not WIDTH_KEY.match(key):
            continue
        words = [w for w in key.split("_") if w not in _PLAIN_WORDS]
        if not words or not all(_uses(told, w) for w in words) or all(w in _WEAK_WORDS for w in words):
            continue
        score = (sum(_uses(own, w) for w in words), len(words))
        v = config_int(config, key)
        if v is not None and score > best_score:
            best, best_score = v, score
    return best


def config_widths(config, name: str) -> list[int]:
    """The widths the config names for an input by the input's own words, however each embeds it
    (`micro_conds`: micro_cond_embed_dim, micro_cond_encode_dim)."""
    own = _words(name)
    out = []
    for key in _config_keys(config):
        words = [w for w in key.split("_") if w not in _PLAIN_WORDS and w not in _HOW_WORDS]
        if WIDTH_KEY.match(key) and words and all(_uses(own, w) for w in words) \
                and (v := config_int(config, key)) is not None:
            out.append(v)
    return out


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z][a-z0-9]*", text.lower().replace("_", " ")) if w not in _PLAIN_WORDS}


def _uses(words: set[str], w: str) -> bool:
    return any(v == w or (min(len(v), len(w)) >= 3 and (v.startswith(w) or w.startswith(v))) for v in words)


def _config_keys(config) -> list[str]:
    keys = []
    for cfg in [config] + [_get(config, s) for s in SUB_CONFIGS]:
        if cfg is None:
            continue
        d = cfg if isinstance(cfg, dict) else getattr(cfg, "to_dict", lambda: vars(cfg))()
        keys += [k for k in d if isinstance(k, str)]
    return list(dict.fromkeys(keys))
