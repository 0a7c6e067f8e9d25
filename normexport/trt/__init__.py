"""normexport's TensorRT code, all of it: which TensorRT is here (runtime), ONNX -> engine builds in
a child process (builder), profiles from a file's dynamic dims (profiles), engine execution on a GPU
(engine), and the `normexport build` command (cli). Works with `tensorrt` (10.x / 11.x) and with
TensorRT for RTX; nothing here imports TensorRT until it is used.

    from normexport import trt
    result = trt.build(trt.BuildSpec("model.onnx", "model.engine", plugin="libnormexport_plugins.so",
                                     profiles={"x": ((1, 1, 64), (2, 16, 64), (8, 128, 64))}))
    eng = trt.build_engine("model.onnx", plugin_lib, input_shapes={"x": (2, 16, 64)})  # GPU: runnable
    outs = trt.run_engine(eng, {"x": x})
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from . import profiles
from .builder import BuildError, BuildResult, BuildSpec, build
from .engine import Engine, deserialize, load_plugin_library, run_engine
from .runtime import TensorRTUnavailable, load


def can_build() -> tuple[bool, str]:
    """(True, "TensorRT for RTX 1.7.1.116") when some TensorRT imports, else (False, reason)."""
    try:
        return True, str(load())
    except TensorRTUnavailable as e:
        return False, str(e)


def is_available() -> tuple[bool, str]:
    """(True, version) when TensorRT imports and a CUDA GPU is visible to torch (engines can run),
    else (False, reason)."""
    ok, what = can_build()
    if not ok:
        return False, what
    import torch

    if not torch.cuda.is_available():
        return False, f"{what} builds engines, but running them needs a CUDA GPU (torch.cuda.is_available() is False)"
    return True, what


def build_engine(onnx_path, plugin_lib: str | os.PathLike | None = None, fp16: bool = False, *,
                 bf16: bool = False, tf32: bool = False, input_shapes: dict[str, tuple[int, ...]] | None = None,
                 workspace_bytes: int = 1 << 30, prefer_plugins: bool = True) -> Engine:
    """Build an engine for `onnx_path` (path or onnx.ModelProto) at fixed `input_shapes`
    (min = opt = max) and deserialise it for run_engine (needs a GPU)."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="normexport-trt-") as tmp:
        if isinstance(onnx_path, onnx.ModelProto):
            path = Path(tmp) / "model.onnx"
            onnx.save(onnx_path, str(path))
            onnx_path = path
        shapes = {k: tuple(int(d) for d in v) for k, v in (input_shapes or {}).items()}
        spec = BuildSpec(str(onnx_path), str(Path(tmp) / "model.engine"),
                         plugin=str(plugin_lib) if plugin_lib else None, prefer_plugins=prefer_plugins,
                         profiles={k: (v, v, v) for k, v in shapes.items()}, fp16=fp16, bf16=bf16, tf32=tf32,
                         workspace_bytes=workspace_bytes)
        try:
            result = build(spec)
        except BuildError as e:
            raise RuntimeError(str(e)) from None
        data = Path(spec.engine_path).read_bytes()
    return Engine(engine=deserialize(data, plugin_lib), serialized=data, plugin_layers=result.plugin_layers,
                  layer_count=result.layers)


__all__ = ["profiles", "BuildError", "BuildResult", "BuildSpec", "Engine", "TensorRTUnavailable", "build", "build_engine",
           "can_build", "deserialize", "is_available", "load", "load_plugin_library", "run_engine"]
