"""Which TensorRT is here: `tensorrt` (10.x / 11.x) where importable, else TensorRT for RTX
(`tensorrt_rtx`, or PyPI's `tensorrt_rtx_bindings` + `tensorrt_rtx_libs`). Every other module of
normexport.trt gets its TensorRT from `load()`; nothing imports TensorRT at normexport's import time.

The pip-installed TensorRT for RTX ships `libtensorrt_rtx.so.1` only, but its ONNX parser dlopens the
unversioned `libtensorrt_rtx.so` when it meets a plugin node (and the process aborts when that
fails). `loader_env()` gives a child process a private folder holding that name as a link to the
wheel's library on LD_LIBRARY_PATH; builds run in such a child (see builder.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import tempfile
from pathlib import Path
from typing import Any

INSTALL_HINT = ("pip install tensorrt (TensorRT 10/11; NVIDIA GPU machines) or tensorrt-rtx-cu13-libs "
                "tensorrt-rtx-cu13-bindings (TensorRT for RTX; builds engines without a GPU)")


class TensorRTUnavailable(RuntimeError):
    """No TensorRT could be imported."""


@dataclasses.dataclass(frozen=True)
class TensorRT:
    module: Any  # the tensorrt bindings module
    flavour: str  # "TensorRT" or "TensorRT for RTX"
    version: str
    lib_dir: Path | None  # folder of the wheel's shared libraries (TensorRT for RTX from PyPI)

    def __str__(self) -> str:
        return f"{self.flavour} {self.version}"


_cached: TensorRT | None = None


def _try_rtx() -> TensorRT | None:
    lib_dir = None
    try:
        libs = importlib.import_module("tensorrt_rtx_libs")  # puts the libraries on the loader path
        lib_dir = Path(libs.__file__).resolve().parent
    except ImportError:
        pass
    for name in ("tensorrt_rtx", "tensorrt_rtx_bindings"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        return TensorRT(mod, "TensorRT for RTX", str(getattr(mod, "__version__", "?")), lib_dir)
    return None


def load() -> TensorRT:
    """The TensorRT to use (cached); raises TensorRTUnavailable naming the install commands."""
    global _cached
    if _cached is not None:
        return _cached
    preferred = os.environ.get("NORMEXPORT_TENSORRT", "").strip().lower()  # "tensorrt" or "rtx"
    found = None
    errors = []
    order = ("rtx", "tensorrt") if preferred == "rtx" else ("tensorrt", "rtx")
    for which in order:
        try:
            if which == "tensorrt":
                mod = importlib.import_module("tensorrt")
                found = TensorRT(mod, "TensorRT", str(getattr(mod, "__version__", "?")), None)
            else:
                found = _try_rtx()
        except Exception as e:  # a broken install raises OSError etc.
            errors.append(f"{which}: {type(e).__name__}: {e}")
            found = None
        if found is not None:
            break
    if found is None:
        why = f" ({'; '.join(errors)})" if errors else ""
        raise TensorRTUnavailable(f"no TensorRT is importable{why}: {INSTALL_HINT}")
    _cached = found
    return found


def loader_dir(t: TensorRT) -> Path | None:
    """A private folder with `libtensorrt_rtx.so -> <wheel>/libtensorrt_rtx.so.1` where the wheel
    lacks the unversioned name its parser dlopens for plugin nodes; None where nothing is missing."""
    if t.lib_dir is None:
        return None
    versioned = t.lib_dir / "libtensorrt_rtx.so.1"
    if not versioned.exists() or (t.lib_dir / "libtensorrt_rtx.so").exists():
        return None
    key = hashlib.sha256(str(versioned).encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"normexport-{os.getuid()}" / f"trt-rtx-{key}"
    link = folder / "libtensorrt_rtx.so"
    if link.is_symlink() and Path(os.readlink(link)) == versioned:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".link-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(versioned)
    os.replace(tmp, link)  # atomic: concurrent builds never see a half-made link
    return folder


def loader_env(t: TensorRT) -> dict[str, str]:
    """The environment for a child process that parses plugin nodes with `t`."""
    env = dict(os.environ)
    folder = loader_dir(t)
    if folder is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(folder), env.get("LD_LIBRARY_PATH", "")) if p)
    if t.flavour == "TensorRT for RTX":
        env["NORMEXPORT_TENSORRT"] = "rtx"
    return env


def plugin_layer_types(trt) -> set:
    return {getattr(trt.LayerType, n) for n in ("PLUGIN", "PLUGIN_V2", "PLUGIN_V3") if hasattr(trt.LayerType, n)}


def polygraphy(t: TensorRT):
    """(polygraphy.backend.trt, G_LOGGER, PolygraphyException) driving `t`. Polygraphy picks its
    TensorRT when first imported (POLYGRAPHY_USE_TENSORRT_RTX) and imports TensorRT for RTX as
    `tensorrt_rtx`, which PyPI's wheels name `tensorrt_rtx_bindings`: alias it before."""
    import sys

    rtx = t.flavour == "TensorRT for RTX"
    if "polygraphy" not in sys.modules:
        os.environ["POLYGRAPHY_USE_TENSORRT_RTX"] = "1" if rtx else "0"
    if rtx:
        sys.modules.setdefault("tensorrt_rtx", t.module)
    from polygraphy import config
    from polygraphy.exception import PolygraphyException
    from polygraphy.logger import G_LOGGER

    G_LOGGER.colors = False  # else it warns once that the optional 'colored' module is missing
    if config.USE_TENSORRT_RTX != rtx:
        raise TensorRTUnavailable(f"Polygraphy was imported for {'TensorRT for RTX' if config.USE_TENSORRT_RTX else 'TensorRT'}, "
                                  f"but {t} is in use: set POLYGRAPHY_USE_TENSORRT_RTX={int(rtx)}")
    import polygraphy.backend.trt as pg

    return pg, G_LOGGER, PolygraphyException
