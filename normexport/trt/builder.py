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
import logging
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
    normexport_nodes: int | None = None  # counted by build() before the child starts


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
    import onnx

    from .. import ops

    t = runtime.load()
    with tempfile.TemporaryDirectory(prefix="normexport-build-") as tmp:
        spec = dataclasses.replace(spec)
        model = onnx.load(spec.onnx_path, load_external_data=False)
        spec.normexport_nodes = len(ops.custom_nodes(model))
        if spec.plugin and spec.prefer_plugins and ops.mark_plugin_nodes(model):
            # files from normexport name their plugin already; older or hand-made ones may not
            onnx.load_external_data_for_model(model, str(Path(spec.onnx_path).resolve().parent))
            spec.onnx_path = str(Path(tmp) / "marked.onnx")
            onnx.save(model, spec.onnx_path, save_as_external_data=model.ByteSize() > 2**30)
        del model
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
class _Errors(logging.Handler):
    """Polygraphy's log (TensorRT's messages included): warnings and errors to stderr (the parent
    keeps it for a crash message), errors collected for BuildError."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.errors: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if record.levelno >= logging.ERROR:
            self.errors.append(msg)
        print(msg, file=sys.stderr, flush=True)


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


def _error_text(messages: list[str]) -> str:
    """TensorRT's errors on one line: the parser's per-node errors where there are any (they name
    the node and the cause), else every error logged, without Polygraphy's prefixes."""
    lines = [" ".join(m.split()) for m in messages]
    lines = [ln[4:] if ln[:4] in ("[E] ", "[!] ") else ln for ln in lines]
    per_node = [ln for ln in lines if ln.startswith("In node")]
    text = " | ".join(dict.fromkeys(per_node or lines)) or "no error logged"
    return text[:2000]


def build_in_process(spec: BuildSpec) -> BuildResult:
    """Parse and build in this process with Polygraphy (the worker calls it; build() has counted
    and marked the normexport nodes, so no torch is imported here). Raises BuildError."""
    import onnx

    t = runtime.load()
    trt = t.module
    try:
        pg, G_LOGGER, PolygraphyException = runtime.polygraphy(t)
    except (ImportError, runtime.TensorRTUnavailable) as e:
        raise BuildError(f"{e}: normexport builds engines with Polygraphy: pip install 'normexport[trt-rtx]' (TensorRT for RTX + Polygraphy) or 'normexport[trt]' (TensorRT + Polygraphy)") from None
    errors = _Errors()
    G_LOGGER.use_python_logging_system = True
    G_LOGGER.module_severity = G_LOGGER.WARNING
    log = logging.getLogger("Polygraphy")
    log.handlers[:] = [errors]
    log.propagate = False

    def fail(what: str) -> BuildError:
        return BuildError(f"{what}: {_error_text(errors.errors)}")

    if spec.plugin:
        if trt.get_plugin_registry().load_library(str(spec.plugin)) is None:
            raise fail(f"TensorRT could not load the plugin library {spec.plugin}")
    strongly_typed = spec.strongly_typed
    if strongly_typed is None:
        model = onnx.load(spec.onnx_path, load_external_data=False)
        file_types = {vi.type.tensor_type.elem_type for vi in list(model.graph.input) + list(model.graph.output)}
        strongly_typed = (not hasattr(trt.BuilderFlag, "FP16")) or bool(
            file_types & {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})
        del model
    strongly_typed = bool(strongly_typed and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"))
    flags = []
    if spec.plugin and spec.prefer_plugins and hasattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE"):
        flags.append(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    try:
        builder, network, parser = pg.NetworkFromOnnxPath(str(spec.onnx_path), flags=flags, strongly_typed=strongly_typed)()
    except PolygraphyException:
        raise fail("TensorRT's ONNX parser rejected the file") from None

    plugin_types = runtime.plugin_layer_types(trt)
    plugin_layers = [network.get_layer(i).name for i in range(network.num_layers)
                     if network.get_layer(i).type in plugin_types]

    dynamic = [network.get_input(i).name for i in range(network.num_inputs)
               if any(d < 0 for d in network.get_input(i).shape)]
    missing = [n for n in dynamic if n not in spec.profiles]
    if missing:
        raise BuildError(f"no optimisation profile for the dynamic input(s) {', '.join(missing)}")
    profiles = {name: [[int(d) for d in s] for s in spec.profiles[name]] for name in dynamic}
    profile = pg.Profile()
    for name, (lo, opt, hi) in profiles.items():
        profile.add(name, min=lo, opt=opt, max=hi)
    weak = {} if strongly_typed else {"fp16": spec.fp16 or None, "bf16": spec.bf16 or None, "tf32": spec.tf32}
    try:
        config = pg.CreateConfig(profiles=[profile] if profiles else None,
                                 memory_pool_limits={trt.MemoryPoolType.WORKSPACE: spec.workspace_bytes},
                                 progress_monitor=_progress_monitor(trt) if spec.progress else None, **weak)(builder, network)
        if spec.timing_cache and Path(spec.timing_cache).is_file() and hasattr(config, "create_timing_cache"):
            cache = config.create_timing_cache(Path(spec.timing_cache).read_bytes())
            if cache is None or not config.set_timing_cache(cache, ignore_mismatch=False):
                raise fail(f"TensorRT cannot use the timing cache {spec.timing_cache} (another TensorRT's or "
                           "not a timing cache): delete it or pass another --timing-cache")
        start = time.monotonic()
        data = pg.EngineBytesFromNetwork((builder, network, parser), config=config)()
        seconds = time.monotonic() - start
    except PolygraphyException:
        raise fail("TensorRT could not build the engine") from None
    if spec.timing_cache and hasattr(config, "get_timing_cache") and config.get_timing_cache() is not None:
        tmp = Path(spec.timing_cache).with_name(f".{Path(spec.timing_cache).name}.{os.getpid()}.tmp")
        tmp.write_bytes(bytes(config.get_timing_cache().serialize()))
        os.replace(tmp, spec.timing_cache)  # the cache with this build's timings, written whole or not at all
    data = bytes(data)
    Path(spec.engine_path).write_bytes(data)
    return BuildResult(tensorrt=str(t), layers=network.num_layers, plugin_layers=plugin_layers,
                       normexport_nodes=spec.normexport_nodes or 0, engine_bytes=len(data), build_seconds=round(seconds, 3),
                       strongly_typed=strongly_typed, profiles=profiles, engine_path=spec.engine_path)
