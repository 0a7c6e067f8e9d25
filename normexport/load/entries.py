"""Dict-typed forward parameters (docs/design.md §9): `added_cond_kwargs: dict[str, Tensor]` of a UNet, a
DiT's size conditioning. Neither the signature nor the documentation says which keys the dict
needs or their shapes, so the eager check (probe) finds out by calling the forward:

- the keys: the parameter starts as a `Keys` dict, which records every key the forward (or a
  module it calls) reads and does not find (`"text_embeds" not in d`, `d["time_ids"]`,
  `d.get("hint")`); a dict unpacked into a callee (`self.emb(t, **d)`) is short of the keyword
  arguments the callee's TypeError names ("missing 2 required positional arguments:
  'resolution' and 'aspect_ratio'"). Each missing key is made (`entry`) and the forward called
  again;
- their shapes: what the key's name says (`entry`: a pooled embedding [batch, width], a vector of
  conditioning values, a hint image), the width of an embedding from the config where a config
  key shares its words, else a first guess that the model's own error corrects (probe: "mat1 and
  mat2 shapes cannot be multiplied (2x40 and 32x16)" gives the width its projection takes).

Once the forward accepts the call, `plain` turns the Keys dicts into plain dicts for export.
"""

from __future__ import annotations

import re

import torch

from .dims import config_int

#: the count of conditioning values an entry's name implies, where its consumer takes any count and
#: only the projection after it fixes the total (the values are embedded one by one): SDXL-style
#: `time_ids` are the pipeline's micro-conditioning (original size, crop corner, target size);
#: PixArt-style `resolution` is (height, width), `aspect_ratio` one value
#: CogView-style `original_size` / `target_size` / `crop_coords` are (height, width) / (top, left) pairs
VALUE_COUNTS = (("time_ids", 6), ("resolution", 2), ("aspect_ratio", 1), ("original_size", 2), ("target_size", 2),
                ("crop_coords", 2), ("crops_coords_top_left", 2))


def value_count(name: str) -> int | None:
    """The count of conditioning values a parameter or entry named `name` holds (VALUE_COUNTS), else None."""
    return next((n for key, n in VALUE_COUNTS if name == key or name.endswith("_" + key)), None)
#: a first width for an embedding no config key names (the eager check corrects it)
GUESS = 8
#: names of entries that are images (a ControlNet-style hint): [batch, 3, 8 x latent side, 8 x latent side]
IMAGE_WORDS = ("hint", "image", "pixel", "cond_image")


class Keys(dict):
    """A dict that records the keys read from it that it does not hold (in reading order)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.absent: list[str] = []
        self.optional: list[str] = []  # read with a default of the forward's own (`d.get("text_embeds", states)`)
        self.free: dict[str, set[int]] = {}  # axes of a made entry that the model's error may resize

    def __bool__(self):  # given, even while empty (`d = d or {"resolution": None}` would drop it)
        return True

    def _note(self, key):
        if isinstance(key, str) and not super().__contains__(key) and key not in self.absent:
            self.absent.append(key)

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        if default is None:
            self._note(key)
        elif isinstance(key, str) and not super().__contains__(key) and key not in self.optional:
            self.optional.append(key)  # made only when nothing else fixes the call (probe)
        return super().get(key, default)

    def grown(self, more: dict) -> "Keys":
        out = Keys({**self, **more})
        out.absent = [k for k in self.absent if k not in more]
        out.optional = [k for k in self.optional if k not in more]
        out.free = dict(self.free)
        return out


def wanted(value: "Keys", error: BaseException) -> list[str]:
    """The keys the failed call read from `value` and did not find, plus those a callee it was
    unpacked into says it misses."""
    keys = list(value.absent)
    if isinstance(error, TypeError):
        m = re.search(r"missing \d+ required (?:positional|keyword-only) arguments?: (.*)$", str(error))
        if m:
            keys += re.findall(r"'(\w+)'", m.group(1))
    return [k for k in dict.fromkeys(keys) if k not in value]


def entry(key: str, config, batch: int, latent_side: int, gen) -> tuple[torch.Tensor, set[int]]:
    """(a tensor for one dict entry, its free axes) from what its name says."""
    words = set(key.lower().split("_"))
    count = value_count(key)
    if count is not None:
        return torch.rand(batch, count, generator=gen) * latent_side * 8, set()
    if words & {"hint"} or (words & set(IMAGE_WORDS) and not words & {"embeds", "embeddings", "embed", "emb"}):
        side = latent_side * 8
        return torch.rand(batch, 3, side, side, generator=gen), set()
    width = _config_width(config, words)
    if width is not None:
        return torch.randn(batch, width, generator=gen), set()
    return torch.randn(batch, GUESS, generator=gen), {1}


def _config_width(config, words: set[str]) -> int | None:
    """A config `<word>_embed_dim` / `<word>_dim` sharing a word with the entry's name (`image_embeds`
    ~ `image_embed_dim`), the name's own words other than embeds / embeddings."""
    own = words - {"embeds", "embeddings", "embed", "emb", "states"}
    for word in sorted(own):
        for key in (f"{word}_embed_dim", f"{word}_embeds_dim", f"{word}_dim", f"{word}_hidden_dim"):
            v = config_int(config, key)
            if v is not None:
                return v
    return None


def plain(kwargs: dict) -> dict:
    """kwargs with each Keys dict a plain dict (what the exporter flattens)."""
    return {k: dict(v) if isinstance(v, Keys) else v for k, v in kwargs.items()}
