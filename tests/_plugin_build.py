"""Build helper shared by the plugin tests (test_plugins_build, test_kernels_gpu, test_trt).

Configures and builds plugins/ with CMake + nvcc once per set of inputs into a folder keyed by their
content (build/test-plugins/<key> of this checkout, or $NORMEXPORT_TEST_BUILD_DIR/<key>), under a file
lock, so that every test module and both pytest-xdist workers share one build; and finds the CUDA
tools (nvcc, cuobjdump) the tests need. Not a test module itself.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PLUGINS_DIR = REPO_ROOT / "plugins"
DEFAULT_ARCHS = "80;86;89;90"


@dataclasses.dataclass(frozen=True)
class PluginBuild:
    build_dir: Path
    kernels_lib: Path
    plugin_lib: Path | None  # libnormexport_plugins.so, only when TensorRT was found
    plugin_host_test: Path | None  # plugins/tests/pluginHostTest.cpp, built with the plugin
    configure_output: str
    build_output: str
    archs: str
    seconds: float


def find_nvcc() -> str | None:
    """nvcc from $CUDACXX, PATH, $CUDA_HOME or /usr/local/cuda."""
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc")]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(os.path.join(os.environ[env], "bin", "nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def find_cmake() -> str | None:
    return shutil.which("cmake")


def find_cuobjdump() -> str | None:
    """cuobjdump from PATH, next to nvcc, or from the pip packages nvidia-cuda-cuobjdump
    (installed as nvidia/cu13/bin/cuobjdump or nvidia/cuda_cuobjdump/bin/cuobjdump)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = find_nvcc()
    if nvcc:
        beside = os.path.join(os.path.dirname(os.path.realpath(nvcc)), "cuobjdump")
        if os.path.isfile(beside):
            return beside
    for entry in sys.path:
        for pattern in ("nvidia/*/bin/cuobjdump", "nvidia/cuda_cuobjdump/bin/cuobjdump"):
            for hit in sorted(glob.glob(os.path.join(entry, pattern))):
                if os.access(hit, os.X_OK):
                    return hit
    return None


_TRT_INCLUDE_SUBDIRS = ("include", "include/x86_64-linux-gnu", "include/aarch64-linux-gnu")


#: folders where users unpack TensorRT tarballs or clone NVIDIA/TensorRT (besides $TensorRT_ROOT and
#: the system folders): /usr/local, /opt, $HOME, $HOME/Downloads, this checkout and the folder above it
def _search_dirs() -> list[str]:
    home = os.path.expanduser("~")
    return ["/usr/local", "/opt", home, os.path.join(home, "Downloads"), str(REPO_ROOT), str(REPO_ROOT.parent)]


#: folder names under those: the 10.x / 11.x tarballs (TensorRT-10.13.3.9, TensorRT-11.0.0.4, also as
#: unpacked with the CUDA / OS suffix), and a clone of NVIDIA/TensorRT (TensorRT, or third_party/TensorRT)
_ROOT_PATTERNS = ("TensorRT-1[0-9].*", "TensorRT-1[0-9]", "TensorRT", "tensorrt", "third_party/TensorRT")


#: NVIDIA's open-source TensorRT headers (include/ + LICENSE of github.com/NVIDIA/TensorRT, Apache-2.0)
#: that every developer machine and CI have beside the checkout; the last place looked (docs/design.md §6),
#: never copied into the project. plugins/CMakeLists.txt falls back to the same folder.
SHARED_TENSORRT = REPO_ROOT.parent / "shared" / "third_party" / "tensorrt"


def tensorrt_root_candidates(search_dirs: list[str] | None = None, shared: Path | None = SHARED_TENSORRT) -> list[str]:
    """Where find_tensorrt_root looks, in order: $TensorRT_ROOT, the system folders, then each of
    `search_dirs` (default _search_dirs()) for _ROOT_PATTERNS, newest version first, then `shared`
    (NVIDIA's headers at ../shared/third_party/tensorrt)."""
    found = [os.environ.get("TensorRT_ROOT"), "/usr", "/usr/local/tensorrt", "/opt/tensorrt"]
    for d in _search_dirs() if search_dirs is None else search_dirs:
        for pattern in _ROOT_PATTERNS:
            hits = glob.glob(os.path.join(d, pattern))
            found += sorted(hits, key=_version_key, reverse=True)
    if shared is not None:
        found.append(str(shared))
    return [c for i, c in enumerate(found) if c and c not in found[:i]]


def _version_key(path: str) -> tuple:
    return tuple(int(n) for n in re.findall(r"\d+", os.path.basename(path))[:4])


def find_tensorrt_root(search_dirs: list[str] | None = None, shared: Path | None = SHARED_TENSORRT) -> str | None:
    """A folder whose include/ holds TensorRT's NvInferRuntime.h, as a user would have it: $TensorRT_ROOT,
    a system install, a TensorRT-10.x / 11.x tarball folder or a clone of NVIDIA/TensorRT, else the
    shared copy of NVIDIA's headers (headers are all the plugin needs); None when there is none."""
    return next((root for root in tensorrt_root_candidates(search_dirs, shared) if tensorrt_include(root)), None)


def tensorrt_include(root: str) -> str | None:
    """The folder under `root` that holds NvInferRuntime.h."""
    return next((os.path.join(root, sub) for sub in _TRT_INCLUDE_SUBDIRS
                 if os.path.isfile(os.path.join(root, sub, "NvInferRuntime.h"))), None)


_CACHE: dict[tuple[str, str | None, bool], PluginBuild] = {}


def build_plugins(archs: str | None = None, tensorrt_root: str | None = None,
                  trt_headers_only: bool = False) -> PluginBuild:
    """Configure + build plugins/ (memoised per process). `archs` defaults to the CMake default
    (80;86;89;90). `trt_headers_only`: build the plugin even where TensorRT's headers come without
    libnvinfer (NORMEXPORT_TRT_HEADERS_ONLY). Raises RuntimeError with the tool output on failure."""
    archs = archs or os.environ.get("NORMEXPORT_TEST_CUDA_ARCHS") or DEFAULT_ARCHS
    tensorrt_root = tensorrt_root or os.environ.get("TensorRT_ROOT") or find_tensorrt_root()
    key = (archs, tensorrt_root, trt_headers_only)
    if key in _CACHE:
        return _CACHE[key]
    nvcc = find_nvcc()
    cmake = find_cmake()
    if nvcc is None or cmake is None:
        raise RuntimeError(f"cannot build plugins: nvcc={nvcc!r} cmake={cmake!r}")
    digest = _inputs_digest(archs, tensorrt_root, trt_headers_only, nvcc, cmake)
    root = Path(os.environ.get("NORMEXPORT_TEST_BUILD_DIR") or REPO_ROOT / "build" / "test-plugins")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other xdist worker waits for this build, then reuses it
        _CACHE[key] = _build_or_reuse(root / digest, archs, tensorrt_root, trt_headers_only, nvcc, cmake)
    return _CACHE[key]


def _inputs_digest(archs: str, tensorrt_root: str | None, trt_headers_only: bool, nvcc: str, cmake: str) -> str:
    """A hash of everything a build_plugins build depends on: the arguments, the tools (path and version),
    every file under plugins/ and the TensorRT headers' names, sizes and times."""
    h = hashlib.sha256(repr((archs, tensorrt_root, trt_headers_only, nvcc, cmake, shutil.which("ninja"))).encode())
    for tool in (nvcc, cmake):
        h.update(subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.encode())
    for path in sorted(p for p in PLUGINS_DIR.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(PLUGINS_DIR)).encode() + b"\0" + path.read_bytes())
    include = tensorrt_include(tensorrt_root) if tensorrt_root else None
    if include:
        for path in sorted(Path(include).iterdir()):
            st = path.stat()
            h.update(f"{path.name} {st.st_size} {st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def _build_or_reuse(build_dir: Path, archs: str, tensorrt_root: str | None, trt_headers_only: bool, nvcc: str,
                    cmake: str) -> PluginBuild:
    """The build in `build_dir` when an earlier process finished it (build.json written last), else a
    fresh configure + build there. Call with the folder's lock held."""
    record = build_dir / "build.json"
    if record.is_file():
        done = json.loads(record.read_text())
        return _plugin_build(build_dir, done["configure_output"], done["build_output"], archs, done["seconds"])
    shutil.rmtree(build_dir, ignore_errors=True)  # a build that stopped half-way
    build_dir.mkdir(parents=True)
    configure = [cmake, "-S", str(PLUGINS_DIR), "-B", str(build_dir), f"-DCMAKE_CUDA_COMPILER={nvcc}"]
    if archs != DEFAULT_ARCHS:
        configure.append(f"-DCMAKE_CUDA_ARCHITECTURES={archs}")
    if tensorrt_root:
        configure.append(f"-DTensorRT_ROOT={tensorrt_root}")
    if trt_headers_only:
        configure.append("-DNORMEXPORT_TRT_HEADERS_ONLY=ON")
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    t0 = time.monotonic()
    cfg = subprocess.run(configure, capture_output=True, text=True)
    cfg_out = cfg.stdout + cfg.stderr
    if cfg.returncode != 0:
        raise RuntimeError(f"cmake configure failed:\n{cfg_out}")
    jobs = str(max(2, min(os.cpu_count() or 2, 16)))
    bld = subprocess.run([cmake, "--build", str(build_dir), "-j", jobs], capture_output=True, text=True)
    bld_out = bld.stdout + bld.stderr
    if bld.returncode != 0:
        raise RuntimeError(f"cmake build failed:\n{bld_out}")
    seconds = time.monotonic() - t0
    tmp = record.with_suffix(".tmp")
    tmp.write_text(json.dumps({"configure_output": cfg_out, "build_output": bld_out, "seconds": seconds}))
    tmp.replace(record)
    return _plugin_build(build_dir, cfg_out, bld_out, archs, seconds)


def _plugin_build(build_dir: Path, cfg_out: str, bld_out: str, archs: str, seconds: float) -> PluginBuild:
    kernels = build_dir / "libnormexport_kernels.so"
    plugin = build_dir / "libnormexport_plugins.so"
    host_test = build_dir / "normexport_plugin_host_test"
    return PluginBuild(
        build_dir=build_dir,
        kernels_lib=kernels,
        plugin_lib=plugin if plugin.exists() else None,
        plugin_host_test=host_test if host_test.exists() else None,
        configure_output=cfg_out,
        build_output=bld_out,
        archs=archs,
        seconds=seconds,
    )


# ------------------------------------------------------------------------------------------
# CPU emulation build (tests/cuda_emu/emu.h): the kernel sources compiled by the host compiler
# ------------------------------------------------------------------------------------------
EMU_DIR = REPO_ROOT / "tests" / "cuda_emu"
KERNEL_SOURCES = ("rms_norm.cu", "layer_norm.cu", "adaln_zero.cu", "skip_rms_norm.cu", "gated_adaln_zero.cu",
                  "launch_config.cu")
#: the TensorRT plugin sources (plugins/tensorrt/), one per op plus the library entry points
PLUGIN_SOURCES = ("rmsNormPlugin.cpp", "adaLNZeroPlugin.cpp", "skipRmsNormPlugin.cpp", "gatedAdaLNZeroPlugin.cpp",
                  "plugins.cpp")
_LAUNCH_RE = re.compile(r"([A-Za-z_]\w*(?:<[^;{}<>]*>)?)\s*<<<(.+?)>>>", re.S)
_EMU_CACHE: dict[tuple, Path] = {}


def find_cuda_include() -> str | None:
    """CUDA's include folder (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h), next to nvcc."""
    candidates = []
    nvcc = find_nvcc()
    if nvcc:
        candidates.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include"))
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(os.path.join(os.environ[env], "include"))
    candidates.append("/usr/local/cuda/include")
    return next((c for c in candidates if os.path.isfile(os.path.join(c, "cuda_runtime.h"))), None)


def emulated_source(replace: tuple[tuple[str, str], ...] = ()) -> str:
    """One translation unit: emu.h, norm_common.cuh with its `k<<<...>>>(p)` launches turned into
    `::emu::launch(k, ...)(p)`, and the three .cu files. `replace`: (old, new) edits of the kernel
    source (a planted bug, to show that the emulated tests catch one)."""
    common = (PLUGINS_DIR / "kernels" / "norm_common.cuh").read_text()
    common, n = _LAUNCH_RE.subn(lambda m: f"::emu::launch({m.group(1)}, {m.group(2)})", common)
    if n == 0:
        raise RuntimeError("no kernel launch found in norm_common.cuh")
    parts = ['#include "emu.h"', common]
    parts += [(PLUGINS_DIR / "kernels" / f).read_text().replace('#include "norm_common.cuh"', "") for f in KERNEL_SOURCES]
    text = "\n".join(parts)
    for old, new in replace:
        if old not in text:
            raise RuntimeError(f"planted edit does not apply: {old!r}")
        text = text.replace(old, new)
    return text


def _host_toolchain() -> tuple[str, str]:
    """(C++ compiler, CUDA include folder) for the emulation builds; RuntimeError when missing."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    include = find_cuda_include()
    if cxx is None or include is None:
        raise RuntimeError(f"cannot build the emulated kernels: C++ compiler={cxx!r}, CUDA include={include!r}")
    return cxx, include


def _compile(cmds: list[list[str]], what: str) -> None:
    for cmd in cmds:
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"{what} failed:\n{' '.join(cmd)}\n{run.stderr[-4000:]}")


def _emulated_build(name: str, source: str, cmd: list[str], what: str) -> Path:
    """`source` written to kernels_emu.cpp and compiled by `cmd` (SRC / OUT stand for the source and
    the output) into `name`, in a folder keyed by the content of everything the build reads (the
    source, the command, the compiler's version, tests/cuda_emu/ and plugins/include/):
    build/test-emu/<key> of this checkout, or $NORMEXPORT_TEST_BUILD_DIR/emu/<key>. Under a file lock,
    so both pytest-xdist workers (test_kernels_emulated, test_trt_plugin_host) share one compile
    (docs/design.md §16); the output is renamed into place when complete, so a compile that stopped
    half-way is redone."""
    h = hashlib.sha256(repr((name, cmd)).encode() + b"\0" + source.encode())
    h.update(subprocess.run([cmd[0], "--version"], capture_output=True, text=True).stdout.encode())
    for folder in (EMU_DIR, PLUGINS_DIR / "include"):
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            h.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes())
    digest = h.hexdigest()[:20]
    base = os.environ.get("NORMEXPORT_TEST_BUILD_DIR")
    root = Path(base) / "emu" if base else REPO_ROOT / "build" / "test-emu"
    out_dir = root / digest
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / name
    with open(root / f"{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other xdist worker waits for this compile, then reuses it
        if not out.is_file():
            src = out_dir / "kernels_emu.cpp"
            src.write_text(source)
            tmp = out_dir / f".{name}.tmp"
            _compile([[str(src) if a == "SRC" else str(tmp) if a == "OUT" else a for a in cmd]], what)
            tmp.replace(out)
    return out


def _emulated_kernels_object(replace: tuple[tuple[str, str], ...], barrier_timeout_ms: int,
                             defines: tuple[str, ...] = ()) -> Path:
    """The emulated kernels compiled once into a position-independent object: linked into the kernel
    library and into the emulated TensorRT plugin (build_emulated_plugin), one compile for both."""
    cxx, include = _host_toolchain()
    return _emulated_build(
        "kernels_emu.o", emulated_source(replace),
        [cxx, "-std=c++20", "-O1", "-g0", "-c", "-fPIC", "-pthread", "-w",
         f"-DNORMEXPORT_EMU_TIMEOUT_MS={int(barrier_timeout_ms)}", *(f"-D{d}" for d in defines), f"-I{include}",
         f"-I{PLUGINS_DIR / 'include'}", f"-I{EMU_DIR}", "SRC", "-o", "OUT"], "emulated kernel build")


def build_emulated_kernels(replace: tuple[tuple[str, str], ...] = (), barrier_timeout_ms: int = 20000,
                           defines: tuple[str, ...] = ()) -> Path:
    """Compile the kernels for the CPU emulation into a shared library with the C ABI of
    normexport_kernels.h (memoised per process, and on disk per content: _emulated_build). A barrier
    some thread never reaches gives up after `barrier_timeout_ms` (normexport_emu_plant changes it at
    run time) and the call returns cudaErrorLaunchTimeout. `defines`: NAME=VALUE switches of
    norm_common.cuh (the variants tools/gpu_compare.sh measures). Raises RuntimeError on failure."""
    key = (replace, barrier_timeout_ms, defines)
    if key not in _EMU_CACHE:
        obj = _emulated_kernels_object(replace, barrier_timeout_ms, defines)
        lib = obj.parent / "libnormexport_kernels_emu.so"
        with open(obj.parent / "link.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not lib.is_file():
                tmp = obj.parent / ".libnormexport_kernels_emu.so.tmp"
                _compile([[_host_toolchain()[0], "-shared", "-pthread", str(obj), "-o", str(tmp)]],
                         "emulated kernel link")
                tmp.replace(lib)
        _EMU_CACHE[key] = lib
    return _EMU_CACHE[key]


def sanitizer_unsupported(sanitize: str) -> str | None:
    """Why the emulation's compiler cannot build and link a `-fsanitize=<sanitize>` program, or None
    when it can."""
    try:
        cxx, _ = _host_toolchain()
    except RuntimeError as exc:
        return str(exc)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "probe.cpp"
        src.write_text("int main() { return 0; }\n")
        probe = subprocess.run([cxx, f"-fsanitize={sanitize}", str(src), "-o", str(Path(d) / "probe")],
                               capture_output=True, text=True)
    return None if probe.returncode == 0 else f"{cxx} cannot build with -fsanitize={sanitize}: {probe.stderr.strip()[:200]}"


def build_emulated_sanitized_driver(sanitize: str, replace: tuple[tuple[str, str], ...] = ()) -> Path:
    """tests/cuda_emu/sanitizer_driver.cpp linked with the emulated kernels, built with
    `-fsanitize=<sanitize>` (e.g. "address,undefined" or "thread"), memoised per process and on disk (the clean and
    the planted sanitizer runs share one build: their planted bugs sit behind emu.h's runtime switch).
    Raises RuntimeError on failure."""
    key = ("sanitize", sanitize, replace)
    if key not in _EMU_CACHE:
        cxx, include = _host_toolchain()
        _EMU_CACHE[key] = _emulated_build(
            "sanitizer_driver", emulated_source(replace),
            # -O0: a quarter of -O1's compile time (27 s of CPU against 100 s for ASan), for a run that
            # the emulation's barriers dominate either way; -g: the reports name the kernels' functions
            [cxx, "-std=c++20", "-O0", "-g", f"-fsanitize={sanitize}", "-fno-sanitize-recover=all", "-pthread", "-w",
             f"-I{include}", f"-I{PLUGINS_DIR / 'include'}", f"-I{EMU_DIR}", "SRC",
             str(EMU_DIR / "sanitizer_driver.cpp"), "-o", "OUT"], f"-fsanitize={sanitize} build")
    return _EMU_CACHE[key]


def build_emulated_plugin(tensorrt_include: str) -> tuple[Path, Path]:
    """The TensorRT plugin library with the CPU-emulated kernels in place of the CUDA ones, and
    plugins/tests/pluginHostTest.cpp built to drive it on host memory
    (NORMEXPORT_HOST_TEST_EMULATED). Returns (library, test program)."""
    kernels = _emulated_kernels_object((), 20000)  # the object of build_emulated_kernels()
    cxx, include = _host_toolchain()
    out = Path(tempfile.mkdtemp(prefix="normexport-emu-plugin-"))  # kernels.parent is shared: read it only
    lib, test = out / "libnormexport_plugins_emu.so", out / "normexport_plugin_host_test_emu"
    trt = PLUGINS_DIR / "tensorrt"
    incs = [f"-I{include}", f"-I{PLUGINS_DIR / 'include'}", f"-I{trt}", f"-isystem{tensorrt_include}", f"-I{EMU_DIR}"]
    _compile([
        [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", *incs,
         *[str(trt / f) for f in PLUGIN_SOURCES],
         str(kernels), "-o", str(lib), "-Wl,--no-undefined",
         f"-Wl,--version-script={trt / 'exports.map'}"],
        [cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-DNORMEXPORT_HOST_TEST_EMULATED", f"-isystem{tensorrt_include}",
         f"-I{include}", str(PLUGINS_DIR / "tests" / "pluginHostTest.cpp"), "-o", str(test), "-ldl"],
    ], "emulated plugin build")
    return lib, test


# ------------------------------------------------------------------------------------------
# SASS helpers
# ------------------------------------------------------------------------------------------
_FUNC_RE = re.compile(r"^\s*Function\s*:\s*(\S+)\s*$")


def sass_by_function(cuobjdump: str, lib: Path, arch: str = "sm_90") -> dict[str, str]:
    """Map mangled kernel name -> its SASS text for one architecture."""
    out = subprocess.run([cuobjdump, "-sass", "-arch", arch, str(lib)], capture_output=True, text=True, check=True)
    funcs: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in out.stdout.splitlines():
        m = _FUNC_RE.match(line)
        if m:
            current = funcs.setdefault(m.group(1), [])
            continue
        if current is not None:
            current.append(line)
    return {k: "\n".join(v) for k, v in funcs.items()}


_RES_FUNC_RE = re.compile(r"^\s*Function\s+(\S+?):\s*$")
_RES_RE = re.compile(r"(REG|STACK|SHARED|LOCAL):(\d+)")


def resource_usage(cuobjdump: str, lib: Path, arch: str = "sm_90") -> dict[str, dict[str, int]]:
    """Map mangled kernel name -> {'REG', 'STACK', 'SHARED', 'LOCAL'} from cuobjdump -res-usage."""
    out = subprocess.run([cuobjdump, "-res-usage", "-arch", arch, str(lib)], capture_output=True, text=True, check=True)
    usage: dict[str, dict[str, int]] = {}
    name = None
    for line in out.stdout.splitlines():
        m = _RES_FUNC_RE.match(line)
        if m:
            name = m.group(1)
            continue
        if name and "REG:" in line:
            usage[name] = {k: int(v) for k, v in _RES_RE.findall(line)}
            name = None
    return usage


def demangle(names: list[str]) -> dict[str, str]:
    """Best-effort demangling with c++filt (identity when it is missing)."""
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    lines = out.stdout.splitlines()
    if out.returncode != 0 or len(lines) != len(names):
        return {n: n for n in names}
    return dict(zip(names, lines))


def load_kernels(path: str | os.PathLike) -> ctypes.CDLL:
    """The kernel library with the C ABI's argument and return types declared
    (plugins/include/normexport_kernels.h)."""
    so = ctypes.CDLL(str(path))
    i64, p, f32, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    so.normexport_rms_norm.argtypes = [p, p, p, i64, i64, c_int, f32, p]
    so.normexport_layer_norm.argtypes = [p, p, p, p, i64, i64, c_int, f32, p]
    so.normexport_adaln_zero.argtypes = [p, p, p, p, p, p, i64, i64, i64, c_int, c_int, f32, p]
    so.normexport_skip_rms_norm.argtypes = [p, p, p, p, p, p, i64, i64, c_int, f32, p]
    so.normexport_gated_adaln_zero.argtypes = [p, p, p, p, p, p, p, p, p, i64, i64, i64, c_int, c_int, f32, p]
    so.normexport_adaln_zero_axis.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, c_int, f32, p]
    so.normexport_gated_adaln_zero_axis.argtypes = [p, p, p, p, p, p, p, p, p, i64, i64, i64, i64, c_int, f32, p]
    for fn in (so.normexport_rms_norm, so.normexport_layer_norm, so.normexport_adaln_zero, so.normexport_skip_rms_norm,
               so.normexport_gated_adaln_zero, so.normexport_adaln_zero_axis, so.normexport_gated_adaln_zero_axis,
               so.normexport_kernels_abi_version):
        fn.restype = c_int
    return so
