"""Atomic, external-data-aware ONNX writing: a failed write leaves no partial file behind."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx

from . import validate as _validate
from .errors import UsageError, first_line

#: protobuf cannot serialise a message of 2 GiB or more: larger models keep weights outside.
PROTOBUF_LIMIT = 2**31 - 1


def check_writable(path: str | os.PathLike, flag: str = "-o") -> Path:
    """Fail early, before any work, when `path` cannot be written (`flag` names the option to fix)."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        example = path / ("model.onnx" if flag == "-o" else "report.json")
        raise UsageError(f"output path '{path}' is a directory: give a file name, e.g. {flag} {example}")
    if not parent.is_dir():
        blocker = next((p for p in (parent, *parent.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise UsageError(f"cannot write '{path}': '{blocker}' is a file, not a folder: choose another {flag} path")
        raise UsageError(f"output folder '{parent}' does not exist: create it or choose another {flag} path")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"cannot write '{path}': permission denied; choose another {flag} path")
    try:  # os.access is not the truth for root, read-only mounts or /proc: try it
        fd, probe = tempfile.mkstemp(prefix=".normexport-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"cannot write in '{parent}' ({e.strerror or type(e).__name__}): choose another {flag} path") from None
    return path


def save_onnx(model: onnx.ModelProto, path: str | os.PathLike, external_data: bool | None = None,
              flag: str = "-o") -> Path:
    """Write a ModelProto to `path` as save_ir does (atomically, umask permissions; weights in
    `<name>.data` beside it when too large for one protobuf or when external_data=True). `model` is
    left as it was (onnx-ir reads its tensor bytes in place)."""
    import onnx_ir as ir

    if external_data is None:
        external_data = _too_large(model)
    return save_ir(ir.serde.deserialize_model(model), path, external_data=external_data, flag=flag)


def check_onnx_path(path: str | os.PathLike) -> None:
    """onnx.checker (full check) on a written file, by path: the weights stay on disk
    (validate.run_checker: a shapeless graph input / output is not damage)."""
    _validate.run_checker(str(path))


def save_ir(model, path: str | os.PathLike, external_data: bool | None = None, flag: str = "-o",
            validate=None) -> Path:
    """Write an onnx_ir model to `path` atomically, its weights streamed tensor by tensor into
    `<name>.data` beside it (never one protobuf) when `external_data` or when they exceed
    EXTERNAL_BYTES; large tensors aligned to 64 KiB so that runtimes can memory-map them. Files
    get the umask's permissions, an existing output (and its .data) is replaced, and on failure
    nothing is left behind. `model` is left as it was (its lazy weights included). `validate`,
    when given, is called with the written temporary file before it replaces `path`."""
    import onnx_ir as ir

    path = check_writable(path, flag)
    if external_data is None:
        external_data = _ir_weight_bytes(model) > EXTERNAL_BYTES
    data_name = path.name + ".data"
    try:
        tmpdir = tempfile.mkdtemp(prefix=".normexport-", dir=path.parent)
        try:
            tmp = Path(tmpdir) / path.name
            if external_data:
                with streamed(model):
                    ir.save(model, tmp, external_data=data_name, size_threshold_bytes=1024, alignment=65536,
                            max_workers=2)
            else:
                ir.save(model, tmp)
            if validate is not None:  # e.g. the checker, by path, before the file takes its place
                validate(tmp)
            written = [tmp] + ([Path(tmpdir) / data_name] if (Path(tmpdir) / data_name).exists() else [])
            mode = 0o666 & ~_umask()
            for f in written:
                os.chmod(f, mode)
            if len(written) > 1:
                os.replace(written[1], path.parent / data_name)
            elif (path.parent / data_name).exists() and path.exists():
                (path.parent / data_name).unlink()  # the old output's weights: this one has none outside
            os.replace(tmp, path)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
    except OSError as e:
        raise UsageError(f"cannot write '{path}' ({e.strerror or first_line(e, 160)}): free some space or choose another {flag} path") from None
    return path


#: an onnx_ir model with more weight bytes than this is written with external data
EXTERNAL_BYTES = 1 << 30


def _ir_weight_bytes(model) -> int:
    total = 0
    for v in model.graph.initializers.values():
        t = v.const_value
        if t is not None:
            total += t.nbytes
    return total


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: element types packed several to a byte: elements per byte
_PACKED = {getattr(onnx.TensorProto, n): k for n, k in (("INT4", 2), ("UINT4", 2), ("FLOAT4E2M1", 2), ("INT2", 4),
                                                        ("UINT2", 4)) if hasattr(onnx.TensorProto, n)}


def _needed_bytes(t: onnx.TensorProto) -> int | None:
    """Bytes a tensor's data takes (None when its type's size is not known here: the length
    field decides alone)."""
    n = int(np.prod(list(t.dims), dtype=np.int64))
    if t.data_type in _PACKED:
        return -(-n // _PACKED[t.data_type])
    if t.data_type == onnx.TensorProto.STRING:
        return None
    try:
        return n * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except Exception:  # noqa: BLE001 - types numpy does not know
        return None


def check_external_data(path: str | os.PathLike, model: onnx.ModelProto | None = None) -> None:
    """Refuse (UsageError, one line) an ONNX file whose external data lies outside its own folder —
    an absolute location, one that climbs out with '..', or a symlink in the folder that points out —
    however the file's path is spelled (a bare name in the current folder included): reading it would
    copy any file the user can read into the outputs (as onnx.load and onnx_ir refuse them too: a
    Hugging Face cache snapshot, whose files link into ../../blobs, is read after `cp -L` of its
    folder). Also refuse data files shorter than their
    tensors need (a truncated download is bad input, said so). `model`: the file's proto without
    its external data, when the caller has it (else it is read, weights left on disk)."""
    path = Path(path)
    if model is None:
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"cannot read '{path}' as ONNX ({first_line(e, 160)}): pass a valid .onnx file") from None
    folder = os.path.dirname(os.path.abspath(path))
    real_folder = os.path.realpath(folder)
    sizes: dict[str, int] = {}
    for t in _validate.tensors(model):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        if not loc or os.path.isabs(loc) or loc.startswith(("/", "\\")) or (len(loc) > 1 and loc[1] == ":"):
            raise UsageError(f"'{path}': tensor '{t.name}' keeps its data at the absolute path '{loc}', outside the "
                             "model's folder: refusing to read it (external data must lie beside the model)")
        target = os.path.realpath(os.path.join(folder, loc))
        if os.path.commonpath([target, real_folder]) != real_folder:
            raise UsageError(f"'{path}': tensor '{t.name}' keeps its data at '{loc}', which leads outside the model's "
                             f"folder ('{target}'): refusing to read it (external data must lie beside the model: "
                             "copy the folder with `cp -L` if its files are links)")
        if target not in sizes:
            try:
                sizes[target] = os.stat(target).st_size
            except OSError:
                raise UsageError(f"'{path}': external data file '{loc}' of tensor '{t.name}' not found beside the "
                                 "model: copy it there") from None
        offset = int(info.get("offset", 0) or 0)
        need = int(info["length"]) if info.get("length") else _needed_bytes(t)
        if need is not None and offset + need > sizes[target]:
            raise UsageError(f"'{path}': external data file '{os.path.join(folder, loc)}' is shorter than its tensors "
                             f"need ({sizes[target]} bytes; tensor '{t.name}' needs {need} from offset {offset}): the "
                             "weights are truncated or corrupt: pass a complete copy of the model")


def load_ir(path: str | os.PathLike):
    """An ONNX file as an onnx_ir model, its external data memory-mapped (read lazily, never
    copied); UsageError when it is missing or not ONNX, its external data is unsafe or short
    (check_external_data), or it is damaged or invalid (normexport.validate)."""
    import onnx_ir as ir


    path = Path(path)
    fixes = _read_checked(path)[1]  # docs/design.md §14: a damaged file is one line here, not an error later
    try:
        model = ir.load(str(path))
    except Exception as e:
        raise UsageError(f"cannot read '{path}' as ONNX ({first_line(e, 160)}): pass a valid .onnx file") from None
    if fixes:  # declared shapes the graph does not compute (validate.check_file): corrected here too
        values = {v.name: v for v in model.graph.outputs}
        for node in model.graph:
            values.update({v.name: v for v in node.outputs if v.name in fixes and v.name not in values})
        for name, dims in fixes.items():
            if name in values:
                values[name].shape = None if dims is None or name not in {v.name for v in model.graph.outputs} \
                    else ir.Shape(dims)
    return model


def check_onnx(model: onnx.ModelProto, workdir: str | os.PathLike | None = None) -> None:
    """onnx.checker.check_model(full_check=True), also for models over protobuf's 2 GiB limit (which
    the checker only takes by path: they are saved with external data to a temp folder in `workdir`)."""
    if not _too_large(model):
        onnx.checker.check_model(model, full_check=True)
        return
    tmpdir = tempfile.mkdtemp(prefix=".normexport-check-", dir=workdir)
    try:
        tmp = Path(tmpdir) / "model.onnx"
        _save_external(model, tmp, "model.onnx.data")
        onnx.checker.check_model(str(tmp), full_check=True)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _save_external(model: onnx.ModelProto, path: Path, data_name: str) -> None:
    """Save with all weights in `data_name` beside `path`; onnx moves the weights out of the proto
    in place while saving, so they are read back into it afterwards."""
    from onnx.external_data_helper import load_external_data_for_model

    try:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_name, size_threshold=1024)
    finally:
        load_external_data_for_model(model, str(path.parent))


def write_atomic(path: Path, write, flag: str = "output") -> None:
    """`write(tmp_path)` into a temporary file beside `path`, given the umask's mode, then renamed to
    `path`: no partial file is ever left behind; an OSError is a usage error naming `flag`."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".normexport-", suffix="-" + path.name, dir=path.parent)
    except OSError as e:
        raise UsageError(f"cannot write '{path}' ({e.strerror or first_line(e, 160)}): choose another {flag} path") from None
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600: the file gets the umask's mode, as any file
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise UsageError(f"cannot write '{path}' ({e.strerror or first_line(e, 160)}): choose another {flag} path") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(obj, path: str | os.PathLike, flag: str = "output") -> Path:
    path = check_writable(path, flag)
    write_atomic(path, lambda p: p.write_text(json.dumps(obj, indent=2, default=str) + "\n"), flag)
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


def read_checked(path: str | os.PathLike) -> onnx.ModelProto:
    """An ONNX file's proto without its external data, after the checks every command makes
    before working on a file (docs/design.md §14): it exists and parses, its external data is safe
    and complete (check_external_data), and it is not damaged or invalid (normexport.validate).
    Each refusal is a one-line UsageError naming the problem and the fix."""
    path = Path(path)
    return _read_checked(path)[0]


_said: set = set()


def _read_checked(path: Path) -> tuple[onnx.ModelProto, dict]:
    """read_checked's proto and the declared shapes it corrected (validate.check_file), said once."""
    if not path.is_file():
        raise UsageError(f"ONNX file not found: '{path}': check the path")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf's parse errors: not ONNX, truncated or corrupt
        raise UsageError(f"cannot read '{path}' as ONNX ({first_line(e, 160)}): pass a valid .onnx file") from None
    check_external_data(path, proto)
    fixes = _validate.check_file(path, proto)
    if fixes:
        key = (str(path.resolve()), path.stat().st_mtime_ns)
        if key not in _said:
            _said.add(key)
            print(_validate.annotation_line(path, proto, fixes), file=sys.stderr)
    return proto, fixes


def load_onnx(path: str | os.PathLike) -> onnx.ModelProto:
    """Load an ONNX file (with its external data) after read_checked's checks."""
    path = Path(path)
    fixes = _read_checked(path)[1]
    try:
        model = onnx.load(str(path), load_external_data=True)
        _validate.apply_annotation_fixes(model, fixes)
        return model
    except Exception as e:
        msg = first_line(e, 160)
        raise UsageError(f"cannot read '{path}' as ONNX ({msg}): pass a valid .onnx file") from None


# --- writing the weights: every tensor's bytes streamed in C order without numpy's slow path ----
#
# onnx-ir writes a tensor with `tensor.tofile(file)`; for an ir.Tensor over a numpy array that is
# `array.tofile(file)`, and numpy writes an array that is not C-contiguous one element at a time
# (an fwrite per element: ~30 MB/s). The exporter's weights are such arrays: the folded
# Transpose of each Linear weight is a transposed numpy view of the torch parameter, and the
# packed projections (llm.packing: np.concatenate of those views) come out in Fortran order,
# since np.concatenate keeps its inputs' memory order. `streamed` swaps them, for the time of one
# ir.save, for tensors writing the same bytes row slab by row slab (64 x 64 tiles copied into a
# small C-order buffer, then one write per slab; the members of a packed projection read in place,
# never concatenated first): the same offsets and bytes, ~10x faster (tools/bench_write.py).
# Arrays of other ranks that are not C-contiguous are copied whole in C order, then written.

_TILE = 64  # 16 KiB of float32 per tile, read and written within L1: ~20 % faster than 128 (2.6 vs 2.2 GB/s, 2-vCPU VM)
_SLAB_BYTES = 8 << 20


def _uint_view(a: np.ndarray) -> np.ndarray | None:
    """`a` as unsigned integers of its item size (the same bytes; copies of it are exact)."""
    kind = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(a.dtype.itemsize)
    if kind is None or a.dtype.hasobject or not np.little_endian or a.dtype.byteorder == ">":
        return None
    try:
        return a.view(kind)
    except ValueError:  # a view that cannot change dtype (last axis strided): not streamed
        return None


def _matrix(t, ndim: int | None = 2) -> np.ndarray | None:
    """The array (of `ndim` dimensions, any when None) whose C-order bytes are `t`'s bytes as
    onnx-ir writes them, or None."""
    import onnx_ir as ir

    if t is None or t.nbytes == 0 or (ndim is not None and len(t.shape) != ndim):
        return None  # (ExternalTensor, LazyTensor: no array raw below)
    if t.dtype.itemsize not in (1, 2, 4, 8) or t.dtype in (ir.DataType.STRING,):
        return None
    raw = getattr(t, "raw", None)
    if isinstance(raw, np.ndarray) and type(t) is ir.Tensor:
        a = raw
    else:
        try:
            import torch
        except ImportError:
            return None
        if not isinstance(raw, torch.Tensor) or raw.device.type != "cpu" or raw.is_conj() or raw.is_neg():
            return None
        if type(raw).__name__ == "FakeTensor" or raw.layout != torch.strided:
            return None
        kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[raw.element_size()]
        try:
            a = raw.detach().view(kind).numpy()
        except (RuntimeError, TypeError):
            return None
    a = _uint_view(a)
    if a is None or a.shape != tuple(t.shape) or a.nbytes != t.nbytes:
        return None
    return a


#: attribute of an onnx-ir LazyTensor that is the concatenation of 2-D tensors along axis 1 (llm.packing):
#: the tensors, which the writer streams in place instead of building the concatenation
CONCAT_MEMBERS = "normexport_concat_members"


def _parts(t) -> list[np.ndarray] | None:
    """The matrices whose concatenation along axis 1 is `t`, when streaming helps; else None.
    A packed projection (a LazyTensor with CONCAT_MEMBERS, llm.packing) gives its members, read in place."""
    import onnx_ir as ir

    if isinstance(t, ir.LazyTensor):
        members = getattr(t, CONCAT_MEMBERS, None)  # set by llm.packing on the weights it concatenates
        if members is None or len(t.shape) != 2:
            return None
        if not members:
            return None
        parts = [_matrix(m) for m in members]
        if any(p is None for p in parts) or any(m.dtype != t.dtype for m in members):
            return None
        k, n = t.shape
        if any(p.shape[0] != k or p.dtype != parts[0].dtype for p in parts) or sum(p.shape[1] for p in parts) != n:
            return None
        if sum(p.nbytes for p in parts) != t.nbytes:
            return None
        return parts
    a = _matrix(t, None)
    if a is None or a.flags.c_contiguous:  # C order: onnx-ir's own write is one big write already
        return None
    return [a]


def _write_rows(file, parts: list[np.ndarray]) -> None:
    """Write the concatenation of `parts` along axis 1, in C order, one row slab at a time."""
    rows = parts[0].shape[0]
    cols = sum(p.shape[1] for p in parts)
    item = parts[0].dtype.itemsize
    slab_rows = min(rows, max(_TILE, _SLAB_BYTES // max(1, cols * item) // _TILE * _TILE))
    buf = np.empty((slab_rows, cols), parts[0].dtype)
    for i in range(0, rows, slab_rows):
        r = min(slab_rows, rows - i)
        slab = buf[:r]
        off = 0
        for p in parts:
            src = p[i:i + r]
            n = p.shape[1]
            if src.flags.c_contiguous or src.strides[1] == item:  # rows contiguous: a copy per row
                slab[:, off:off + n] = src
            else:  # strided (a transposed view): tiles, so that reads and writes stay in cache
                for j in range(0, n, _TILE):
                    e = min(j + _TILE, n)  # never past this part's columns (the next part's)
                    slab[:, off + j:off + e] = src[:, j:e]
            off += n
        file.write(memoryview(slab).cast("B"))


def write_parts(file, parts: list[np.ndarray]) -> None:
    """Write the C-order bytes of `parts` concatenated along axis 1 (one part: its own C-order bytes),
    without building the concatenation: a C-contiguous part or one of another rank in one write, 2-D
    parts by row slabs (`_write_rows`)."""
    if len(parts) == 1 and (parts[0].ndim != 2 or parts[0].flags.c_contiguous):
        file.write(memoryview(np.ascontiguousarray(parts[0]).reshape(-1)).cast("B"))
    else:
        _write_rows(file, parts)


def _streaming_class():
    import onnx_ir as ir

    class Streamed(ir.LazyTensor):
        """Stands for `original` during one ir.save: the same name, type, shape and bytes;
        `tofile` streams them (`_write_rows`), anything else reads the original."""

        __slots__ = ("original", "parts")

        def __init__(self, original, parts):
            super().__init__(lambda: original, dtype=original.dtype, shape=original.shape, name=original.name,
                             doc_string=original.doc_string, metadata_props=dict(original.metadata_props))
            self.original = original
            self.parts = parts

        def tofile(self, file) -> None:
            write_parts(file, self.parts)

    return Streamed


_STREAMED = None


@contextlib.contextmanager
def streamed(model, size_threshold_bytes: int = 1024):
    """For the time of an ir.save(model, ..., external_data=...): each initializer written to the
    data file whose bytes numpy would write element by element (non-C-order arrays, packed
    projections) is swapped for a tensor streaming the same bytes; the originals are back after."""
    global _STREAMED
    if _STREAMED is None:
        _STREAMED = _streaming_class()
    swapped = []
    made: dict[int, object] = {}
    try:
        for graph in model.graphs():
            for v in graph.initializers.values():
                t = v.const_value
                if t is None or t.nbytes <= size_threshold_bytes:
                    continue
                s = made.get(id(t))
                if s is None:
                    parts = _parts(t)
                    if parts is None:
                        continue
                    s = made[id(t)] = _STREAMED(t, parts)
                if s.nbytes != t.nbytes:
                    continue
                swapped.append((v, t))
                v.const_value = s
        yield
    finally:
        for v, t in swapped:
            v.const_value = t
