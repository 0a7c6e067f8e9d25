"""Running a built engine (needs an NVIDIA GPU; torch's CUDA tensors hold the buffers)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np

from . import runtime

_loaded_libraries: dict[str, Any] = {}


def load_plugin_library(path: str | os.PathLike) -> Any:
    """Register the plugin creators of a plugin library in this process once; returns the handle."""
    trt = runtime.load().module
    path = str(Path(path).resolve())
    if path not in _loaded_libraries:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"plugin library not found: {path}")
        handle = trt.get_plugin_registry().load_library(path)
        if handle is None:
            raise RuntimeError(f"TensorRT could not load plugin library {path}")
        _loaded_libraries[path] = handle
    return _loaded_libraries[path]


@dataclasses.dataclass
class Engine:
    """A deserialised engine plus what the build saw."""

    engine: Any  # ICudaEngine
    serialized: bytes
    plugin_layers: list[str]  # names of the plugin layers in the parsed network
    layer_count: int


def _recording_logger(trt) -> Any:
    """A TensorRT logger that keeps the error messages (TensorRT's own reason when a call fails,
    e.g. TensorRT for RTX's "engine cannot run on this GPU, which has compute capability 9.0")."""

    class _Recorder(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg) -> None:  # noqa: D401 - TensorRT's callback
            if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                self.errors.append(str(msg).strip())

    return _Recorder()


def deserialize(serialized: bytes, plugin: str | os.PathLike | None = None) -> Any:
    t = runtime.load()
    if plugin is not None:
        load_plugin_library(plugin)
    logger = _recording_logger(t.module)
    trt_runtime = t.module.Runtime(logger)
    engine = trt_runtime.deserialize_cuda_engine(serialized) if trt_runtime is not None else None
    if engine is None:
        why = logger.errors[-1] if logger.errors else "no reason logged (is there a CUDA GPU?)"
        raise RuntimeError(f"TensorRT could not deserialize the engine: {why}")
    return engine


def _torch_dtype(trt, dtype):
    import torch  # noqa: PLC0415

    table = {
        trt.float32: torch.float32,
        trt.float16: torch.float16,
        trt.int32: torch.int32,
        trt.int8: torch.int8,
        trt.bool: torch.bool,
    }
    for name, tdt in (("bfloat16", torch.bfloat16), ("int64", torch.int64), ("uint8", torch.uint8)):
        if hasattr(trt, name):
            table[getattr(trt, name)] = tdt
    if dtype not in table:
        raise RuntimeError(f"unsupported TensorRT tensor dtype {dtype}")
    return table[dtype]


def run_engine(engine, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run an engine (Engine or tensorrt.ICudaEngine) once; returns the outputs in engine order.

    Inputs are numpy arrays (converted to the engine's input dtypes); bfloat16 outputs come back
    as float32 arrays (numpy has no bfloat16)."""
    import torch  # noqa: PLC0415

    trt = runtime.load().module
    eng = engine.engine if isinstance(engine, Engine) else engine
    context = eng.create_execution_context()
    if context is None:
        raise RuntimeError("could not create a TensorRT execution context")
    names = [eng.get_tensor_name(i) for i in range(eng.num_io_tensors)]
    input_names = [n for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    output_names = [n for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
    missing = set(input_names) - set(inputs)
    if missing:
        raise ValueError(f"missing engine inputs: {', '.join(sorted(missing))}")

    keep = []  # device buffers must outlive the launch
    for name in input_names:
        arr = np.ascontiguousarray(inputs[name])
        t = torch.from_numpy(arr).to(device="cuda", dtype=_torch_dtype(trt, eng.get_tensor_dtype(name))).contiguous()
        keep.append(t)
        if not context.set_input_shape(name, tuple(t.shape)):
            raise RuntimeError(f"invalid shape {tuple(t.shape)} for input {name}")
        context.set_tensor_address(name, t.data_ptr())
    outputs = []
    for name in output_names:
        shape = tuple(context.get_tensor_shape(name))
        if any(d < 0 for d in shape):
            raise RuntimeError(f"output {name} has unresolved shape {shape}")
        t = torch.empty(shape, device="cuda", dtype=_torch_dtype(trt, eng.get_tensor_dtype(name)))
        outputs.append(t)
        context.set_tensor_address(name, t.data_ptr())

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    if not context.execute_async_v3(stream.cuda_stream):
        raise RuntimeError("TensorRT execute_async_v3 failed")
    stream.synchronize()
    return [(t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy() for t in outputs]
