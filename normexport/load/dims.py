"""A documented shape made concrete (DESIGN §9): the dim names a library writes in its docstrings
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
}


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
    documented with `text_seq_len` agree)."""

    def __init__(self, config, folder: dict | None, batch: int, known: dict | None = None, free_size: int = 8):
        self.config, self.folder, self.batch = config, dict(folder or {}), batch
        self.known = dict(known or {})
        self.free_size = free_size
        self.free: dict[str, int] = {}

    def dim(self, name: str) -> tuple[int | None, bool]:
        """(size, free) for one documented dim name; (None, False) when nothing gives it."""
        raw = name.strip()
        key = re.sub(r"^(self\.)?(config\.)", "", raw.lower()).strip()
        if raw.isdigit():
            return int(raw), False
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
        if _counts(key):
            return self.free.setdefault(key, self.free_size if "target" not in key else max(2, self.free_size // 2)), True
        return None, False

    def shape(self, dims: list[str]) -> tuple[tuple[int, ...] | None, set[int], list[str]]:
        """(shape, free axes, unresolved names) of a documented shape; a repeated name (`image_size,
        image_size`) is one size. A new free dim takes a size no other axis of the shape has, so an
        error that names a size says which axis it is about."""
        keys = [re.sub(r"^(self\.)?(config\.)", "", d.strip().lower()).strip() for d in dims]
        counted = [k not in BATCH_NAMES and _counts(k) and k not in self.known and k not in self.folder
                   and k not in ALIASES and config_int(self.config, k) is None for k in keys]
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
