"""What a save_pretrained folder says about its inputs besides config.json (DESIGN §9): the
preprocessor / feature-extractor config (image size and channels, mel bins, sampling rate,
frames) and the generation config (decoder start token), as sizes by name.

The names are the ones the libraries document argument shapes with (`num_channels`, `height`,
`width`, `image_size`, `feature_size`, `num_frames`), so examples can resolve a documented shape
`(batch_size, num_channels, height, width)` against them.
"""

from __future__ import annotations

import json
from pathlib import Path

#: the processor files save_pretrained writes beside config.json (an image processor or feature
#: extractor writes preprocessor_config.json; a processor may nest them in processor_config.json)
FILES = ("preprocessor_config.json", "feature_extractor_config.json", "video_preprocessor_config.json",
         "processor_config.json", "generation_config.json")


def folder_sizes(path: Path) -> dict[str, int]:
    """{size name: value} read from the folder's processor and generation configs ({} when it has none)."""
    out: dict[str, int] = {}
    for name in FILES:
        data = _read(path / name)
        if not data:
            continue
        for section in [data] + [v for k, v in data.items() if isinstance(v, dict) and k.endswith(("processor",
                                                                                                  "extractor"))]:
            for k, v in _sizes_of(section).items():
                out.setdefault(k, v)
    return out


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
    if _int(cfg.get("patch_size")):
        out["patch_size"] = _int(cfg["patch_size"])
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
