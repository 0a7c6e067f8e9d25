"""What a save_pretrained folder says about its inputs besides config.json (docs/design.md §9): the
preprocessor / feature-extractor config (image size and channels, mel bins, sampling rate,
frames) and the generation config (decoder start token), as sizes by name.

The names are the ones the libraries document argument shapes with (`num_channels`, `height`,
`width`, `image_size`, `feature_size`, `num_frames`), so examples can resolve a documented shape
`(batch_size, num_channels, height, width)` against them.

transformers >= 5 saves a processor's parts nested in processor_config.json (`{"image_processor":
{...}, "processor_class": ...}`), and its loaders take that nested section before the part's own
file (AutoImageProcessor: "nested config if found -> image processor config"): so do we, so a
stale preprocessor_config.json beside a newer processor_config.json does not win.
"""

from __future__ import annotations

import json
from pathlib import Path

#: the processor files save_pretrained writes beside config.json (an image processor or feature
#: extractor writes preprocessor_config.json; a processor writes processor_config.json, its parts
#: nested in it under their attribute names: image_processor, feature_extractor, video_processor)
PROCESSOR = "processor_config.json"
FILES = ("preprocessor_config.json", "feature_extractor_config.json", "video_preprocessor_config.json",
         PROCESSOR, "generation_config.json")


def folder_sizes(path: Path) -> dict[str, int]:
    """{size name: value} read from the folder's processor and generation configs ({} when it has none).
    Where two say a size, the first in transformers' own loading order wins: the parts nested in
    processor_config.json, then the parts' own files, then the processor's own attributes."""
    out: dict[str, int] = {}
    for section in _sections(path):
        for k, v in _sizes_of(section).items():
            out.setdefault(k, v)
    return out


def _sections(path: Path) -> list[dict]:
    """The folder's processor settings, in the order transformers loads them."""
    processor = _read(path / PROCESSOR) or {}
    nested = [v for k, v in processor.items() if isinstance(v, dict) and k.endswith(("processor", "extractor"))]
    own = []
    for name in FILES:
        data = processor if name == PROCESSOR else _read(path / name)
        if data:
            own.append(data)
            if name != PROCESSOR:
                own += [v for k, v in data.items() if isinstance(v, dict) and k.endswith(("processor", "extractor"))]
    return nested + own


def _read(file: Path) -> dict | None:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _int(v) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


def _sizes_of(cfg: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    # images: the size the processor resizes (or crops) to, the channels its normalization has
    size = cfg.get("crop_size") if cfg.get("do_center_crop") and cfg.get("crop_size") else cfg.get("size")
    hw = _height_width(size)
    if hw:
        out["height"], out["width"] = hw
        out["image_size"] = hw[0]
    mean = cfg.get("image_mean")
    if isinstance(mean, (list, tuple)) and mean:
        out["num_channels"] = len(mean)
    elif _int(cfg.get("num_channels")):
        out["num_channels"] = _int(cfg["num_channels"])
    elif cfg.get("do_convert_rgb") is True:  # converted to RGB, normalized per image (Pix2Struct): 3 channels
        out["num_channels"] = 3
    patch = _height_width(cfg.get("patch_size"))  # 16, or {"height": 16, "width": 16} (Pix2Struct, Pixtral)
    if patch:
        out["patch_height"], out["patch_width"] = patch
        if patch[0] == patch[1]:
            out["patch_size"] = patch[0]
    # patches per image of a processor that cuts images into a padded patch sequence (Siglip2's
    # max_num_patches, Pix2Struct's max_patches): the sequence length of its patchified pixels
    for key in ("max_num_patches", "max_patches"):
        if _int(cfg.get(key)):
            out.setdefault(key, _int(cfg[key]))
    # audio: mel bins / feature size, sampling rate, frames of one chunk
    for key, name in (("feature_size", "feature_size"), ("num_mel_bins", "feature_size"), ("n_mels", "feature_size"),
                      ("sampling_rate", "sampling_rate"), ("nb_max_frames", "num_frames"), ("hop_length", "hop_length"),
                      ("num_frames", "num_frames")):
        if _int(cfg.get(key)) and name not in out:
            out[name] = _int(cfg[key])
    if "num_frames" not in out and _int(cfg.get("chunk_length")) and _int(cfg.get("sampling_rate")) \
            and _int(cfg.get("hop_length")):
        out["num_frames"] = cfg["chunk_length"] * cfg["sampling_rate"] // cfg["hop_length"]
    # generation: the token a decoder starts from
    if isinstance(cfg.get("decoder_start_token_id"), int):
        out["decoder_start_token_id"] = cfg["decoder_start_token_id"]
    return out


def _height_width(size) -> tuple[int, int] | None:
    if _int(size):
        return int(size), int(size)
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(_int(s) for s in size):
        return int(size[0]), int(size[1])
    if isinstance(size, dict):
        if _int(size.get("height")) and _int(size.get("width")):
            return int(size["height"]), int(size["width"])
        side = _int(size.get("shortest_edge")) or _int(size.get("longest_edge"))
        if side:
            return side, side
    return None
