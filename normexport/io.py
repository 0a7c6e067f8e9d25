"""Atomic, external-data-aware ONNX writing: a failed write leaves no partial file behind."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import onnx

from .errors import UsageError

#: protobuf cannot serialise a message of 2 GiB or more: larger models keep weights outside.
PROTOBUF_LIMIT = 2**31 - 1


def check_writable(path: str | os.PathLike) -> Path:
    """Fail early, before any work, when `path` cannot be written."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"output path '{path}' is a directory: give a file name, e.g. -o {path / 'model.onnx'}")
    if not parent.is_dir():
        raise UsageError(f"output folder '{parent}' does not exist: create it or choose another -o path")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"cannot write '{path}': permission denied; choose another -o path")
    return path


def save_onnx(model: onnx.ModelProto, path: str | os.PathLike, external_data: bool | None = None) -> Path:
    """Write `model` to `path` atomically. Weights go to `<name>.data` beside it when the model is
    too large for one protobuf (or when external_data=True)."""
    path = check_writable(path)
    if external_data is None:
        external_data = _too_large(model)
    tmpdir = tempfile.mkdtemp(prefix=".normexport-", dir=path.parent)
    try:
        tmp = Path(tmpdir) / path.name
        data_name = path.name + ".data"
        if external_data:
            onnx.save_model(model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name, size_threshold=1024)
            os.replace(Path(tmpdir) / data_name, path.parent / data_name)
        else:
            onnx.save_model(model, str(tmp))
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return path


def write_json(obj, path: str | os.PathLike) -> Path:
    path = check_writable(path)
    fd, tmp = tempfile.mkstemp(prefix=".normexport-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _too_large(model: onnx.ModelProto) -> bool:
    total = 0
    for t in model.graph.initializer:
        total += len(t.raw_data) or 0
        if total >= PROTOBUF_LIMIT // 2:
            return True
    try:
        return model.ByteSize() >= PROTOBUF_LIMIT
    except ValueError:
        return True


def load_onnx(path: str | os.PathLike) -> onnx.ModelProto:
    """Load an ONNX file (with its external data); UsageError when it is missing or corrupt."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"ONNX file not found: '{path}': check the path")
    try:
        return onnx.load(str(path), load_external_data=True)
    except Exception as e:
        msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise UsageError(f"cannot read '{path}' as ONNX ({msg}): pass a valid .onnx file") from None
