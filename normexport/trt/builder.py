"""ONNX file -> serialized TensorRT engine.

`build()` runs TensorRT's ONNX parser and builder in a child process (`python -m
normexport.trt._worker`): TensorRT aborts its process on some failures (a plugin lookup that cannot
dlopen its library ends in std::terminate), and the child is where the parser finds the library
names the pip wheels lack (runtime.loader_env). A failure comes back as BuildError with TensorRT's
own error text; the parent never dies with the child.

The network is created strongly typed where TensorRT offers it (always in TensorRT for RTX): the
precision of every tensor is the one the ONNX file gives it, so the normexport function bodies,
which cast to float32 for their statistics, keep them in float32 in fp16 / bf16 engines, and the
plugins accumulate in float32 themselves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import runtime


class BuildError(RuntimeError):
    """TensorRT rejected the network or the build (its error text is the message)."""


@dataclasses.dataclass
class BuildSpec:
    onnx_path: str
    engine_path: str
    plugin: str | None = None  # plugin library to register (None: the function bodies run)
    prefer_plugins: bool = True  # mark normexport nodes so the parser uses a registered plugin
    #: {input: (min, opt, max)} for every input with dynamic dims
    profiles: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    fp16: bool = False  # builder flags for weakly typed networks (TensorRT 10/11, float32 files)
    bf16: bool = False
    tf32: bool = False
    workspace_bytes: int = 1 << 30
    timing_cache: str | None = None
    progress: bool = False  # print build phases (TensorRT's progress monitor) on stdout
    strongly_typed: bool | None = None  # None: when the file is not float32 or TensorRT has no FP16 flag


@dataclasses.dataclass
class BuildResult:
    tensorrt: str  # flavour and version
    layers: int
    plugin_layers: list[str]
    normexport_nodes: int
    engine_bytes: int
    build_seconds: float
    strongly_typed: bool
    profiles: dict[str, list[list[int]]]
    engine_path: str

    @property
    def bodies(self) -> int:
        """normexport nodes that ran as their function bodies (not as plugin layers)."""
        return max(self.normexport_nodes - len(self.plugin_layers), 0)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["plugin_layer_count"] = len(self.plugin_layers)
        d["bodies"] = self.bodies
        return d


def build(spec: BuildSpec, *, timeout: float | None = None) -> BuildResult:
    """Build spec.onnx_path into spec.engine_path in a child process; raises BuildError."""
    t = runtime.load()
    with tempfile.TemporaryDirectory(prefix="normexport-build-") as tmp:
        spec_file, result_file, log_file = (Path(tmp) / n for n in ("spec.json", "result.json", "trt.log"))
        spec_file.write_text(json.dumps(dataclasses.asdict(spec)))
        with open(log_file, "w") as log:
            proc = subprocess.run([sys.executable, "-m", "normexport.trt._worker", str(spec_file), str(result_file)],
                                  env=runtime.loader_env(t), stdout=None if spec.progress else subprocess.DEVNULL,
                                  stderr=log, timeout=timeout)
        if result_file.exists():
            result = json.loads(result_file.read_text())
            if "error" in result:
                raise BuildError(result["error"])
            if proc.returncode == 0:
                return BuildResult(**result)
        raise BuildError(_crash_message(proc.returncode, log_file.read_text(errors="replace")))


def _crash_message(code: int, log: str) -> str:
    how = f"signal {-code}" if code < 0 else f"exit code {code}"
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "[E]" in ln or "error" in ln.lower() or "terminate" in ln]
    cause = (errors or lines or ["no output"])[-1][:300]
    return f"TensorRT ended the build process ({how}): {cause}"


# ---- the child's side ------------------------------------------------------------------------
def _logger(trt, sink):
    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg):
            if severity <= trt.ILogger.Severity.ERROR:
                self.errors.append(msg)
            if severity <= trt.ILogger.Severity.WARNING:
                print(f"[TRT] {severity.name}: {msg}", file=sink, flush=True)

    return Logger()


def _progress_monitor(trt):
    if not hasattr(trt, "IProgressMonitor"):
        return None

    class Progress(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.started = time.monotonic()

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None:
                print(f"  [{time.monotonic() - self.started:6.1f}s] {phase_name} ({num_steps} steps)", flush=True)

        def step_complete(self, phase_name, step):
            return True

        def phase_finish(self, phase_name):
            pass

    return Progress()


def build_in_process(spec: BuildSpec) -> BuildResult:
    """Parse and build in this process (the worker calls it). Raises BuildError."""
    import onnx

    from .. import ops

    t = runtime.load()
    trt = t.module
    logger = _logger(trt, sys.stderr)
    model = onnx.load(spec.onnx_path)  # with its external data, beside the file
    n_custom = len(ops.custom_nodes(model))
    if spec.plugin:
        if trt.get_plugin_registry().load_library(str(spec.plugin)) is None:
            raise BuildError(f"TensorRT could not load the plugin library {spec.plugin}")
        if spec.prefer_plugins:
            ops.mark_plugin_nodes(model)

    strongly_typed = spec.strongly_typed
    if strongly_typed is None:
        file_types = {vi.type.tensor_type.elem_type for vi in list(model.graph.input) + list(model.graph.output)}
        strongly_typed = (not hasattr(trt.BuilderFlag, "FP16")) or bool(
            file_types & {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})
    flags = 0
    if strongly_typed and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    else:
        strongly_typed = False
    builder = trt.Builder(logger)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if spec.plugin and spec.prefer_plugins and hasattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE"):
        parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    if not parser.parse(model.SerializeToString(), str(Path(spec.onnx_path).resolve().parent)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)] or logger.errors
        raise BuildError("TensorRT's ONNX parser rejected the file: " + " | ".join(errors)[:2000])

    plugin_types = runtime.plugin_layer_types(trt)
    plugin_layers = [network.get_layer(i).name for i in range(network.num_layers)
                     if network.get_layer(i).type in plugin_types]

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, spec.workspace_bytes)
    if not strongly_typed:
        if not spec.tf32 and hasattr(trt.BuilderFlag, "TF32"):
            config.clear_flag(trt.BuilderFlag.TF32)
        for on, name in ((spec.fp16, "FP16"), (spec.bf16, "BF16")):
            if on and hasattr(trt.BuilderFlag, name):
                config.set_flag(getattr(trt.BuilderFlag, name))
    monitor = _progress_monitor(trt) if spec.progress else None
    if monitor is not None:
        config.progress_monitor = monitor

    dynamic = {}
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        if any(d < 0 for d in tensor.shape):
            dynamic[tensor.name] = tuple(tensor.shape)
    missing = [n for n in dynamic if n not in spec.profiles]
    if missing:
        raise BuildError(f"no optimisation profile for the dynamic input(s) {', '.join(missing)}")
    profiles = {}
    if dynamic:
        profile = builder.create_optimization_profile()
        for name in dynamic:
            lo, opt, hi = (tuple(int(d) for d in s) for s in spec.profiles[name])
            profile.set_shape(name, lo, opt, hi)
            profiles[name] = [list(lo), list(opt), list(hi)]
        config.add_optimization_profile(profile)

    cache = None
    if spec.timing_cache and hasattr(config, "create_timing_cache"):
        data = Path(spec.timing_cache).read_bytes() if Path(spec.timing_cache).exists() else b""
        cache = config.create_timing_cache(data)
        config.set_timing_cache(cache, ignore_mismatch=False)

    start = time.monotonic()
    serialized = builder.build_serialized_network(network, config)
    seconds = time.monotonic() - start
    if serialized is None:
        raise BuildError("TensorRT could not build the engine: " + (" | ".join(logger.errors) or "no error logged")[:2000])
    data = bytes(serialized)
    Path(spec.engine_path).write_bytes(data)
    if cache is not None:
        Path(spec.timing_cache).write_bytes(bytes(config.get_timing_cache().serialize()))
    return BuildResult(tensorrt=str(t), layers=network.num_layers, plugin_layers=plugin_layers,
                       normexport_nodes=n_custom, engine_bytes=len(data), build_seconds=round(seconds, 3),
                       strongly_typed=bool(strongly_typed), profiles=profiles, engine_path=spec.engine_path)
