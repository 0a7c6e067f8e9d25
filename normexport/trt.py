"""Isolated TensorRT path: build an engine from a normexport ONNX file and run it.

`tensorrt` is imported lazily, so importing this module never needs TensorRT or a GPU.

    ok, why = normexport.trt.is_available()
    eng = build_engine("model.onnx", "build/plugins/libnormexport_plugins.so", fp16=True)
    outs = run_engine(eng, {"input_0": x})

The plugin library is registered with `trt.get_plugin_registry().load_library(path)` (TensorRT 10
calls its `getCreators`). normexport nodes carry `plugin_namespace="normexport"` (files written by
normexport have it; it is added here where missing) and the parser's plugin-override flag is set
where available (TensorRT >= 10.15), so the ONNX parser picks the RMSNorm / AdaLNZero plugins
instead of inlining the ops' function bodies.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np

_NOT_IMPORTABLE = "TensorRT is not importable: pip install tensorrt (needs a CUDA GPU)"
_loaded_libraries: dict[str, Any] = {}


def _trt():
    try:
        import tensorrt as trt  # noqa: PLC0415
    except Exception as exc:  # ImportError, or a broken install raising OSError
        raise RuntimeError(_NOT_IMPORTABLE) from exc
    return trt


def is_available() -> tuple[bool, str]:
    """(True, version) when TensorRT imports and a CUDA GPU is visible to torch, else (False, reason)."""
    try:
        import tensorrt as trt  # noqa: PLC0415
    except Exception as exc:
        return False, f"tensorrt not importable: {exc}"
    try:
        import torch  # noqa: PLC0415
    except Exception as exc:
        return False, f"torch not importable: {exc}"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU: torch.cuda.is_available() is False"
    return True, f"tensorrt {getattr(trt, '__version__', '?')}"


def load_plugin_library(path: str | os.PathLike) -> Any:
    """Register the plugin creators of a plugin library once per process; returns the handle."""
    trt = _trt()
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

    engine: Any  # tensorrt.ICudaEngine
    serialized: bytes
    plugin_layers: list[str]  # names of the plugin layers in the parsed network
    layer_count: int


def build_engine(
    onnx_path,
    plugin_lib: str | os.PathLike | None = None,
    fp16: bool = False,
    *,
    bf16: bool = False,
    tf32: bool = False,
    input_shapes: dict[str, tuple[int, ...]] | None = None,
    workspace_bytes: int = 1 << 30,
    prefer_plugins: bool = True,
    log_level: str = "WARNING",
) -> Engine:
    """Parse an ONNX file (or onnx.ModelProto) with TensorRT's ONNX parser and build an engine.

    plugin_lib: libnormexport_plugins.so to register first (None: the ops' function bodies run).
    input_shapes: concrete shapes for inputs with dynamic dims (min = opt = max).
    tf32: allow TF32 math for float32 layers (TensorRT's default); off by default for fp32 parity.
    prefer_plugins: mark normexport nodes so the parser uses the plugins over function bodies.
    Raises RuntimeError with the parser / builder messages on failure.
    """
    import onnx  # noqa: PLC0415

    trt = _trt()
    logger = trt.Logger(getattr(trt.Logger, log_level))
    if plugin_lib is not None:
        load_plugin_library(plugin_lib)

    model = onnx_path if isinstance(onnx_path, onnx.ModelProto) else onnx.load(str(onnx_path))
    if prefer_plugins and plugin_lib is not None:
        model = onnx.ModelProto.FromString(model.SerializeToString())  # do not touch the caller's
        from normexport import ops  # noqa: PLC0415

        ops.mark_plugin_nodes(model)  # files from normexport have them; older or hand-made ones may not

    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if prefer_plugins and plugin_lib is not None and hasattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE"):
        parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    if not parser.parse(model.SerializeToString()):
        errors = "\n".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT ONNX parser failed:\n{errors}")

    plugin_layers = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type in {getattr(trt.LayerType, n) for n in ("PLUGIN", "PLUGIN_V2", "PLUGIN_V3") if hasattr(trt.LayerType, n)}:
            plugin_layers.append(layer.name)

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if not tf32 and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    if bf16:
        config.set_flag(trt.BuilderFlag.BF16)

    dynamic = []
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        if any(d < 0 for d in tensor.shape):
            dynamic.append(tensor.name)
    if dynamic:
        missing = [n for n in dynamic if not input_shapes or n not in input_shapes]
        if missing:
            raise RuntimeError(f"inputs with dynamic dims need input_shapes: {', '.join(missing)}")
        profile = builder.create_optimization_profile()
        for name in dynamic:
            shape = tuple(int(d) for d in input_shapes[name])
            profile.set_shape(name, shape, shape, shape)
        config.add_optimization_profile(profile)

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError("TensorRT engine build failed (see the TensorRT log above)")
    serialized = bytes(serialized)
    engine = trt.Runtime(logger).deserialize_cuda_engine(serialized)
    if engine is None:
        raise RuntimeError("TensorRT could not deserialize the engine it just built")
    return Engine(engine=engine, serialized=serialized, plugin_layers=plugin_layers, layer_count=network.num_layers)


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

    trt = _trt()
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
