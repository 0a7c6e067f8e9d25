"""`normexport.capture(module, FILE)`: record the example inputs a user can always give (docs/design.md §9).

    with normexport.capture(pipe.transformer, "inputs.pt"):
        pipe("a prompt", num_inference_steps=1)
    # normexport convert FOLDER --inputs inputs.pt

A forward pre-hook (with kwargs) on `module` records the args and kwargs of its first call while
the user's real code runs (one denoising step, one prompt); on leaving the block they are saved
with torch.save as `(args, kwargs)` — tensors detached and moved to the CPU, plain values kept —
to a temporary file renamed over FILE (never a half-written file), after checking that
`torch.load(FILE, weights_only=True)` reads them back (what `--inputs` does). `stop=True` ends the
block right after the first call (the rest of the pipeline does not run). The module is not
changed: the hook is removed on leaving the block, also when the block raised.

The module `normexport.capture` is itself callable (`normexport.capture(...)`).
"""

from __future__ import annotations

import os
import sys
import tempfile
import types
from pathlib import Path

import torch
import torch.utils._pytree as pytree

from .errors import UsageError, first_line


class _Stop(Exception):
    """Raised by the hook after the first call when stop=True; swallowed by the context."""


class Capture:
    """Context manager; after the block, `args` / `kwargs` hold what was recorded, `path` the file."""

    def __init__(self, module: torch.nn.Module, path: str | os.PathLike, *, stop: bool = False, quiet: bool = False):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"normexport.capture records a torch.nn.Module's call, not a {type(module).__name__}")
        if isinstance(module, torch.jit.ScriptModule):  # its calls run in C++: no forward hook
            raise UsageError(f"normexport.capture cannot record a TorchScript module's call ({type(module).__name__} refuses "
                             "forward hooks): save the call as normexport.capture.save(args, kwargs, PATH), or capture "
                             "the Python model before torch.jit.script / trace")
        self.module, self.path, self.stop, self.quiet = module, Path(path), stop, quiet
        self.args: tuple | None = None
        self.kwargs: dict | None = None
        self._handle = None

    def _hook(self, _module, args, kwargs):
        if self.args is None:
            self.args, self.kwargs = _to_plain(tuple(args)), _to_plain(dict(kwargs))
            if self.stop:
                raise _Stop()

    def __enter__(self) -> "Capture":
        self._handle = self.module.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._handle.remove()
        stopped = exc_type is not None and issubclass(exc_type, _Stop)
        if self.args is None:
            if exc_type is None:
                raise RuntimeError(f"normexport.capture: {type(self.module).__name__} was not called inside the "
                                   f"block: nothing written to {self.path}; call the pipeline that runs it")
            return False
        if exc_type is not None and not stopped:
            return False  # the user's error, unchanged; nothing written
        save(self.args, self.kwargs, self.path)
        if not self.quiet:
            names = ", ".join(list(self.kwargs)[:8]) + (", ..." if len(self.kwargs) > 8 else "")
            print(f"normexport.capture: saved the first call of {type(self.module).__name__} ({len(self.args)} "
                  f"positional, keyword: {names or 'none'}) to {self.path}: convert it with --inputs {self.path}",
                  file=sys.stderr)
        return stopped


def capture(module: torch.nn.Module, path: str | os.PathLike, *, stop: bool = False, quiet: bool = False) -> Capture:
    """`with capture(module, "inputs.pt"): pipeline(...)` records module's first call (see module doc)."""
    return Capture(module, path, stop=stop, quiet=quiet)


def save(args: tuple, kwargs: dict, path: str | os.PathLike) -> Path:
    """torch.save((args, kwargs)) to `path` atomically, refused unless weights_only=True reads it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent) or ".")
    os.close(fd)
    try:
        try:
            torch.save((tuple(args), dict(kwargs)), tmp)
            torch.load(tmp, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a value torch.save or weights_only refuses: name it
            raise UsageError(f"normexport.capture: the call holds a value torch.load(weights_only=True) cannot read "
                             f"({first_line(e, 160)}): {_odd_values(args, kwargs)}") from None
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _to_plain(x):
    """Tensors detached, cloned and on the CPU (the pipeline may change them in place later)."""
    return pytree.tree_map(lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v, x)


def _odd_values(args, kwargs) -> str:
    plain = (type(None), bool, int, float, str, torch.Tensor, torch.dtype, torch.device)
    odd = [f"{p}: {type(v).__name__}" for p, v in
           [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
           if any(not isinstance(leaf, plain) for leaf in pytree.tree_leaves(v))]
    return ("not plain data: " + ", ".join(odd[:5])) if odd else "see the message"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class _CallableModule(types.ModuleType):
    def __call__(self, module, path, **kwargs) -> Capture:
        return capture(module, path, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["Capture", "capture", "save"]
