"""What a model file is, by its content, not its name (docs/design.md §9): a TorchScript archive (`.pt`,
silero's `model.jit`, `.ts`, ultralytics' `.torchscript`), a torch.export archive (`.pt2`), a
torch.save file (zip or legacy pickle), or something else, said by name (an ONNX file, safetensors
weights, text ...) so the refusal tells the user what they passed.

TorchScript archives, torch.export archives and torch.save files are all zip files; their members
tell them apart (checked on files written by torch.jit.save, torch.export.save and torch.save):
  TorchScript   <root>/constants.pkl, <root>/code/...
  torch.export  <root>/archive_format ("pt2"), <root>/models/*.json; older:
                <root>/serialized_exported_program.json
  torch.save    <root>/data.pkl (and no code/)
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

#: kinds load() loads; every other kind is refused with its description
TORCHSCRIPT, EXPORTED, TORCH_SAVE, PICKLE = "torchscript", "exported-program", "torch-save", "pickle"


def kind_of(path: Path) -> tuple[str, str]:
    """(kind, what it is in words). kind is one of TORCHSCRIPT, EXPORTED, TORCH_SAVE, PICKLE, or
    "other" (described), or "unknown" (unreadable or damaged: the loader of its extension says why)."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError as e:
        return "unknown", f"unreadable ({e.strerror or e})"
    if not head:
        return "other", "an empty file"
    if head.startswith(b"PK"):
        return _zip_kind(path)
    if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
        return PICKLE, "a pickle (legacy torch.save)"
    return "other", _describe(path, head)


def _zip_kind(path: Path) -> tuple[str, str]:
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            fmt = next((n for n in names if n.endswith("/archive_format") or n == "archive_format"), None)
            fmt_text = zf.read(fmt)[:16].decode("ascii", "replace").strip() if fmt else ""
    except (zipfile.BadZipFile, OSError, ValueError, KeyError, EOFError):
        return "unknown", "a damaged zip archive"
    if fmt_text == "pt2" or any(n.endswith("serialized_exported_program.json") for n in names):
        return EXPORTED, "a torch.export archive"
    if any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names):
        return TORCHSCRIPT, "a TorchScript archive"
    if any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
        return TORCH_SAVE, "a torch.save file"
    if names and all(n.endswith(".npy") for n in names):
        return "other", "a NumPy .npz archive"
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return "other", f"a zip archive of {len(names)} file(s) ({shown}) that is no TorchScript or torch.export archive"


def _describe(path: Path, head: bytes) -> str:
    """What a file that is no PyTorch model is, from its first bytes."""
    if head.startswith(b"GGUF"):
        return "a GGUF file (llama.cpp weights)"
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return "an HDF5 file (Keras weights?)"
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy .npy array"
    if head[4:8] == b"TFL3":
        return "a TensorFlow Lite model"
    if head.startswith(b"\x1f\x8b"):
        return "a gzip archive"
    if len(head) > 262 and head[257:262] == b"ustar":
        return "a tar archive"
    if len(head) >= 10:
        n = struct.unpack("<Q", head[:8])[0]
        if 2 <= n < 100_000_000 and head[8:10] == b'{"':
            return "a safetensors file (weights only, no model code)"
    if _looks_like_onnx(path, head):
        return "an ONNX model"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c.isprintable() or c in "\r\n\t" for c in text[:256]):
        stripped = text.lstrip()
        if stripped[:1] in "{[":
            return "a JSON / text file"
        return "a text file"
    return f"binary data of no known model format (first bytes {head[:4].hex(' ')})"


def _looks_like_onnx(path: Path, head: bytes) -> bool:
    """An ONNX ModelProto: field 1 (ir_version, varint) first, and onnx parses it."""
    if head[:1] != b"\x08" or path.stat().st_size > (2 << 30):
        return False
    try:
        import onnx

        model = onnx.load_model(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - then it is not ONNX
        return False
    return model.ir_version > 0 and len(model.graph.node) > 0
