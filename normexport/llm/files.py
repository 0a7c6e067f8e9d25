"""The KV-cache file and its fused copy on disk, for checks by path (issue 31; docs/design.md §8, §10).

A model of any size is run in onnxruntime from a file: `Workdir` is a temporary folder beside the
output holding the decomposed file and the fused one. Their weights are one data file, written
once: the fused copy (onnx-ir `Model.clone()`: its initializers are the decomposed model's tensor
objects) is written as a graph whose shared initializers point into the data file the first
write made; only the tensors the fusion made (the cos / sin caches, a few constants) are inline.
So the weights are streamed to disk once (io.save_ir's writer: tensor by tensor, those over 1 MiB
64 KiB aligned for memory mapping; transposed and packed weights by row slabs, `io.streamed`),
never serialised whole, never held twice.

The checked file then takes the output's place by renames (`place`): the output and
`<output>.data` (the data file is named for the output from the start), no second write.

The first write can run behind the caller (`write_behind`; `write_data_behind` for the weights alone,
started before the graph is final: convert.prewrite), by a forked copy of the process on Linux.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import onnx
import onnx_ir as ir


class Workdir:
    """A temp folder beside `out` (same file system: `place` renames). Use as a context manager,
    or call `close()`; whatever was not placed is removed."""

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out)
        self.dir = Path(tempfile.mkdtemp(prefix=".normexport-llm-", dir=self.out.parent))
        self.data_name = self.out.name + ".data"
        #: the decomposed file's name here: never the output's (the fused file takes that one)
        self.decomposed = "decomposed.onnx" if self.out.name != "decomposed.onnx" else "decomposed.0.onnx"
        #: id(tensor) -> (tensor, TensorProto external_data entries) of what the data file holds
        self._written: dict[int, tuple[object, dict[str, str]]] = {}
        self.files: dict[str, Path] = {}
        #: the weights' write started ahead (`write_data_behind`): its future, until a write waits for it
        self._pending = None
        self._child: int | None = None  # the forked writer's pid while it runs
        #: large tensors a later write found outside the data file and appended to it (normally none)
        self.appended = 0
        self._ahead: set[int] = set()  # id() of the tensors `write_data_behind` writes
        self._planned: list = []  # (weight_plan.Entry, offset) written by `write_planned`

    def __enter__(self) -> "Workdir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove the folder; a forked writer still running is stopped first."""
        pending, self._pending = self._pending, None
        if pending is not None and not pending.done() and self._child is not None:
            import signal

            try:
                os.kill(self._child, signal.SIGKILL)
            except OSError:
                pass
            pending.exception()  # (reaped by the waiter)
        shutil.rmtree(self.dir, ignore_errors=True)

    def write_data_behind(self, model: ir.Model) -> None:
        """Start writing `model`'s weights into the data file now (`write_behind`: a forked process
        on Linux), before its graph is final: the files written later (`write`, any name)
        wait for it and share its tensors, the graph alone. A tensor they hold that this write did not
        (one the graph's later passes made) is appended to the data file then. (convert: the weights
        of a causal LM checked by path are written while the norm rewrite and the fusion passes run.)"""
        if self._written or self._pending is not None:
            raise RuntimeError("the data file is written already")
        self._ahead = {id(v.const_value) for v in model.graph.initializers.values() if v.const_value is not None}
        self._pending = self.write_behind(model, _WEIGHTS)

    def write_planned(self, entries: list) -> None:
        """Start writing the tensors a plan predicts (normexport.llm.weight_plan: before the export, the
        file unknown) into the data file now, by a forked process (`write_behind`'s way), each at an
        offset fixed here (64 KiB aligned, as the first write aligns its large tensors); `adopt` then
        matches them with the file's initializers."""
        if self._written or self._pending is not None:
            raise RuntimeError("the data file is written already")
        from concurrent.futures import Future

        offsets, end = [], 0
        for e in entries:
            end = _aligned(end, e.nbytes)
            offsets.append(end)
            end += e.nbytes
        self._planned = list(zip(entries, offsets))
        path = self.data_path

        def write():
            from ..io import write_parts

            with open(path, "wb") as f:
                for e, offset in self._planned:
                    f.seek(offset)
                    write_parts(f, e.parts)
                f.truncate(end)

        future: Future = Future()
        try:
            pid, err = _fork_call(write) if _FORK and sys.platform.startswith("linux") else (None, None)
        except OSError:
            pid = None
        if pid is None:  # no fork: a thread (numpy's copies release the GIL between tiles)
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(1, thread_name_prefix="normexport-write")
            try:
                self._pending = pool.submit(write)
            finally:
                pool.shutdown(wait=False)
            return
        future.forked = True
        self._child = pid

        def wait():
            try:
                _wait_child(pid, err)
                future.set_result(path)
            except BaseException as e:  # noqa: BLE001 - the caller's future carries it
                future.set_exception(e)

        import threading

        threading.Thread(target=wait, name="normexport-write-wait", daemon=True).start()
        self._pending = future

    def adopt(self, model: ir.Model) -> str | None:
        """The planned write (`write_planned`) taken for `model`: each large initializer whose bytes
        are a planned tensor's (weight_plan.recipe) shares its place in the data file; those the
        plan missed are appended when a file is written. None where taken, else why not (a planned
        tensor no initializer is: the plan is not the file's, and its write is of no use)."""
        from .weight_plan import recipe

        planned = {e.key: (e, offset) for e, offset in self._planned}
        used: set = set()
        written = {}
        for v in model.graph.initializers.values():
            t = v.const_value
            if t is None or t.nbytes <= _INLINE_BYTES:
                continue
            key = recipe(t)
            hit = planned.get(key) if key is not None else None
            if hit is None:
                continue
            e, offset = hit
            used.add(key)
            written[id(t)] = (t, {"location": self.data_name, "offset": str(offset), "length": str(e.nbytes)})
        missed = [e.name for e, _ in self._planned if e.key not in used]
        if missed:
            return f"{len(missed)} of {len(planned)} tensors written ahead are not the file's (first: {missed[0]})"
        self._written.update(written)
        self._ahead = set(written)
        return None

    def covers(self, model: ir.Model) -> bool:
        """Every large initializer of `model` is a tensor the data file holds or is being written
        with (the same object): its files will share them, nothing large appended."""
        have = self._ahead | set(self._written)
        return all(v.const_value is None or v.const_value.nbytes <= _APPEND_CHECK_BYTES or id(v.const_value) in have
                   for v in model.graph.initializers.values())

    def _settle(self) -> None:
        """Wait for the write started by `write_data_behind`; its error raised here (an OSError)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
            scratch = self.files.pop(_WEIGHTS, None)
            if scratch is not None:
                scratch.unlink(missing_ok=True)

    @property
    def writing_in_thread(self) -> bool:
        """The weights' write started ahead runs in a thread of this process (no fork here), not done yet."""
        pending = self._pending
        return pending is not None and not getattr(pending, "forked", False) and not pending.done()

    @property
    def data_path(self) -> Path:
        return self.dir / self.data_name

    def write(self, model: ir.Model, name: str) -> Path:
        """`model` as `name` in the folder (left as it was). The first write streams every weight
        into the data file; a later one writes its graph alone where its initializers are tensors
        the data file already holds (the same objects), appends the other large ones to it and keeps
        the small ones inline."""
        self._settle()
        path = self.dir / name
        if not self._written:
            self._write_first(model, path)
            self._record(path, {v.name: v.const_value for v in model.graph.initializers.values()})
        else:
            self._write_sharing(model, path)
        self.files[name] = path
        return path

    def _write_first(self, model: ir.Model, path: Path) -> None:
        from ..io import streamed

        with streamed(model):  # non-C-order and packed weights streamed, not element by element
            ir.save(model, path, external_data=self.data_name, size_threshold_bytes=_INLINE_BYTES,
                    alignment=_ALIGN, max_workers=2)

    def _record(self, path: Path, tensors: dict) -> None:
        """What the data file holds, from the file at `path` written from initializers `tensors`
        (name -> tensor object): later writes share those tensors' bytes."""
        written = {t.name: {e.key: e.value for e in t.external_data}
                   for t in onnx.load(str(path), load_external_data=False).graph.initializer
                   if t.data_location == onnx.TensorProto.EXTERNAL}
        for vname, t in tensors.items():
            if t is not None and vname in written:
                self._written[id(t)] = (t, written[vname])
        if not self._written:  # nothing external: later writes are whole files too
            self._written[0] = (None, {})

    def write_behind(self, model: ir.Model, name: str):
        """`write` while the caller goes on (a concurrent.futures.Future; its result the path, its
        exception an OSError where the write failed); `files[name]` is set once it is written.

        The first write (the weights) is made by a forked copy of this process on Linux (elsewhere
        fork without exec is not safe with the system's libraries): the copy shares the weights'
        memory (copy-on-write, nothing duplicated) and writes them without this process's GIL. A
        writer thread's numpy copies wait for the GIL once per 64-column tile beside the caller's
        Python work: 0.04 GB/s beside a busy Python thread, against the fork's 0.72 and a plain
        copy's 0.93 (tools/bench_write.py --busy, 2-vCPU VM). Elsewhere (no fork, fork failed, a
        later write) a thread; then the caller must neither change `model` nor read its
        initializers' `const_value` objects meanwhile (io.streamed swaps them)."""
        from concurrent.futures import Future, ThreadPoolExecutor

        if not self._written and self._pending is None and _FORK and sys.platform.startswith("linux"):
            future: Future = Future()
            path = self.dir / name
            tensors = {v.name: v.const_value for v in model.graph.initializers.values()}  # as written
            try:
                pid, err = _fork_call(lambda: self._write_first(model, path))
            except OSError:  # (no memory for the page tables, a process limit): the thread below
                pid = None
            if pid is not None:
                future.forked = True  # (the caller may run its own GIL-bound work meanwhile)
                self._child = pid

                def wait():
                    try:
                        _wait_child(pid, err)
                        self._record(path, tensors)
                        self.files[name] = path
                        future.set_result(path)
                    except BaseException as e:  # noqa: BLE001 - the caller's future carries it
                        future.set_exception(e)

                import threading

                threading.Thread(target=wait, name="normexport-write-wait", daemon=True).start()
                return future
        pool = ThreadPoolExecutor(1, thread_name_prefix="normexport-write")
        try:
            return pool.submit(self.write, model, name)
        finally:
            pool.shutdown(wait=False)

    def _write_sharing(self, model: ir.Model, path: Path) -> None:
        swapped = []
        try:
            for v in model.graph.initializers.values():
                t = v.const_value
                hit = self._written.get(id(t)) if t is not None else None
                if (hit is None or hit[0] is not t) and t is not None and 0 not in self._written \
                        and t.nbytes > _INLINE_BYTES:
                    hit = self._append(t)  # a large tensor the data file lacks: never inline (2 GiB protobuf)
                if hit is None or hit[0] is not t:
                    continue
                info = hit[1]
                ext = ir.ExternalTensor(info["location"], int(info.get("offset", 0) or 0),
                                        int(info["length"]) if info.get("length") else None, t.dtype,
                                        shape=t.shape, name=v.name, base_dir=self.dir)
                swapped.append((v, t))
                v.const_value = ext
            proto = ir.serde.serialize_model(model)
        finally:
            for v, t in swapped:
                v.const_value = t
        tmp = path.with_name(path.name + ".tmp")
        onnx.save_model(proto, str(tmp))
        os.replace(tmp, path)

    def _append(self, t) -> tuple[object, dict[str, str]]:
        """`t`'s bytes appended to the data file (64 KiB aligned), recorded as the first write's are."""
        import numpy as np

        data = np.ascontiguousarray(t.numpy())
        with open(self.data_path, "r+b") as f:
            offset = _aligned(f.seek(0, os.SEEK_END), data.nbytes)
            f.seek(offset)
            f.write(memoryview(data.reshape(-1).view(np.uint8)))
        info = {"location": self.data_name, "offset": str(offset), "length": str(data.nbytes)}
        self._written[id(t)] = (t, info)
        self.appended += 1
        return self._written[id(t)]

    def place(self, name: str, out: str | os.PathLike | None = None, validate=None) -> Path:
        """The file `name` takes `out`'s place (default: the output this folder was made for) with
        the data file beside it as `<out>.data`, by renames; `validate(path)` (e.g.
        io.check_onnx_path) runs on it first. Files get the umask's mode; an old `<out>.data`
        is removed when the placed file has none."""
        from ..io import _umask

        out = Path(out) if out is not None else self.out
        if out.name + ".data" != self.data_name:
            raise ValueError(f"the data file is named for {self.out.name}, not {out.name}")
        path = self.files[name]
        if validate is not None:
            validate(path)
        mode = 0o666 & ~_umask()
        os.chmod(path, mode)
        data = self.data_path
        if data.exists():
            os.chmod(data, mode)
            os.replace(data, out.parent / self.data_name)
            self._written.clear()  # the data file is gone from the folder: nothing more shares it
        elif (out.parent / self.data_name).exists():
            (out.parent / self.data_name).unlink()
        os.replace(path, out)
        del self.files[name]
        return out


#: whether write_behind may fork (tests turn it off to run the thread)
_FORK = True
#: the graph file `write_data_behind` writes beside the data file (removed once recorded)
_WEIGHTS = ".weights.onnx"
#: tensors up to this many bytes stay in the graph (the first write's size_threshold_bytes)
_INLINE_BYTES = 1024
#: `covers` counts tensors over this size (a pass's new constants, the rotary caches, may be appended)
_APPEND_CHECK_BYTES = 64 << 20
_ALIGN = 65536


def _aligned(offset: int, nbytes: int) -> int:
    """Where a tensor of `nbytes` starts after `offset`: 64 KiB aligned over 1 MiB (onnx-ir's save rule
    with alignment=_ALIGN: mapped in place), packed below."""
    return -(-offset // _ALIGN) * _ALIGN if nbytes > _ALIGN_FROM_BYTES else offset


#: tensors over this many bytes start at a multiple of _ALIGN (onnx-ir's default align_threshold)
_ALIGN_FROM_BYTES = 1 << 20


_children_lock = threading.Lock()
_children = 0  # children of _fork_call not reaped yet (the objects frozen while there is one)


def _freeze_for_child() -> None:
    global _children
    with _children_lock:
        gc.freeze()
        _children += 1


def _child_reaped() -> None:
    global _children
    with _children_lock:
        _children -= 1
        if _children == 0:
            gc.unfreeze()


def _fork_call(fn) -> tuple[int, int]:
    """Run `fn()` in a forked child; returns (pid, read end of a pipe carrying the child's error line).
    The child exits at once after `fn` (os._exit: no atexit handlers, no buffers of the parent's
    flushed twice), status 0 where `fn` returned.

    Every object alive now is frozen first, until the last such child is reaped (`_wait_child`): gc.freeze,
    Python's advice before a fork without exec. The parent's collections meanwhile skip them, so they
    do not write to the pages the child still shares (copy-on-write: each page written is copied). On
    a 1.1B LLaMA's convert (the export's and the passes' collections beside the forked writer):
    18.7 -> 17.7 s, mean of 3 alternating runs each, 2-vCPU VM."""
    r, w = os.pipe()
    _freeze_for_child()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        _child_reaped()
        raise
    if pid == 0:  # the child
        code = 1
        try:
            os.close(r)
            gc.disable()  # (a collection would touch every object's page: copies of the parent's memory)
            fn()
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
            try:
                errno = getattr(e, "errno", None) or 0
                text = getattr(e, "strerror", None) or f"{type(e).__name__}: {e}"
                os.write(w, f"{errno}\n{text}".encode("utf-8", "replace")[:4000])
            except BaseException:  # noqa: BLE001
                pass
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _wait_child(pid: int, err: int) -> None:
    """Wait for the child of `_fork_call`; its failure raised here as an OSError (its errno and text)."""
    try:
        chunks = []
        while True:
            b = os.read(err, 4096)
            if not b:
                break
            chunks.append(b)
    finally:
        os.close(err)
    try:
        _, status = os.waitpid(pid, 0)
    finally:
        _child_reaped()
    if os.waitstatus_to_exitcode(status) != 0:
        msg = b"".join(chunks).decode("utf-8", "replace")
        errno, _, text = msg.partition("\n")
        code = int(errno) if errno.strip().isdigit() else 0
        text = text or f"the writing process ended with status {os.waitstatus_to_exitcode(status)}"
        raise OSError(code, text) if code else OSError(text)
