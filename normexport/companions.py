"""The files a runtime loads beside a model's ONNX file, for `convert FOLDER -o DIR/` of a transformers
folder that is not a causal LM with its cache (those get llm.deploy's folder): the folder's `config.json`,
its tokenizer and processor files, and sentence-transformers' module files (modules.json, the pooling /
normalize / dense modules' folders), copied as they are. DIR then loads as a model folder: optimum's
`ORTModelForFeatureExtraction.from_pretrained(DIR)` (model.onnx + config.json), transformers'
`AutoTokenizer.from_pretrained(DIR)`, and a sentence-transformers folder's pooling beside the file.

Each file is copied to a temporary name and renamed into place; a file of another content already in
DIR is left alone and named (no folder of two models); one line lists what was copied.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .llm import deploy

#: a folder's processor files (image processors, feature extractors, processors, chat templates)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json", "chat_template.jinja")
#: sentence-transformers' files at the folder's top
SENTENCE_FILES = ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json")


def files(folder: Path) -> list[tuple[Path, Path]]:
    """(source, path relative to DIR) of every companion file of `folder`."""
    out = [(folder / n, Path(n)) for n in ("config.json", *PROCESSOR_FILES, *SENTENCE_FILES) if (folder / n).is_file()]
    out += [(p, Path(p.name)) for p in deploy.tokenizer_files(folder)]
    for path in _module_folders(folder):
        out += [(p, p.relative_to(folder)) for p in sorted(path.rglob("*")) if p.is_file()]
    return list(dict.fromkeys(out))


def _module_folders(folder: Path) -> list[Path]:
    """The sentence-transformers modules' folders after the transformer (modules.json entries with a
    path of their own: 1_Pooling, 2_Normalize, 2_Dense); not the transformer's own (an older layout's
    0_Transformer: its weights are what model.onnx replaces)."""
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError):
        return []
    out = []
    for m in modules if isinstance(modules, list) else []:
        if not isinstance(m, dict) or str(m.get("type", "")).endswith(".Transformer"):
            continue
        sub = m.get("path")
        if isinstance(sub, str) and sub and (folder / sub).is_dir() \
                and (folder / sub).resolve().is_relative_to(folder.resolve()):
            out.append(folder / sub)
    return out


def write(out: Path, source: str) -> list[str]:
    """Copy the companion files of the folder `source` beside `out` (DIR/model.onnx); the lines to print."""
    folder = Path(source)
    if not folder.is_dir() or not (folder / "config.json").is_file():
        return []
    where = out.parent
    copied, kept, clash = [], [], []
    for src, rel in files(folder):
        dest = where / rel
        if dest.exists():  # the same file, or a copy of it from an earlier run: kept; another model's: left alone
            same = os.path.samefile(src, dest) or dest.read_bytes() == src.read_bytes()
            (kept if same else clash).append(str(rel))
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        deploy._copy(src, dest)
        copied.append(str(rel))
    lines = []
    if copied or kept:
        lines.append(f"model folder '{where}': copied {', '.join(copied) or 'nothing'} beside {out.name}"
                     + (f" ({', '.join(kept)} already there)" if kept else ""))
    if clash:
        lines.append(f"  note: not copied, '{where}' holds another file of the same name: {', '.join(clash)}")
    return lines
