
import gc
import os
import sys

import pytest

if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # `make test` runs one worker per core: each worker's torch and the programs it starts (OpenMP)
    # take their share of the cores instead of all of them (2 workers x 2 threads on 2 cores
    # thrash); set before torch is imported by any test module
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    os.environ.setdefault("MKL_NUM_THREADS", str(_share))
    if "torch" in sys.modules:  # imported already (a plugin): its thread pool is sized at first use, set it too
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))



@pytest.fixture(autouse=True, scope="module")
def _older_objects_out_of_collections():
    """What a test file starts with (the libraries imported, the session's fixtures) is kept out of the full
    collections its tests' code makes (gc.freeze, after one collection): normexport collects in full where
    it releases a model, and in a test worker's heap each such collection walked millions of objects that
    no test frees (py-spy of a whole run: 800 of 3,900 CPU seconds in gc.collect). Objects frozen here are
    still freed when their last reference goes; only cycles among them wait for the worker's end."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture
def cli(capsys):
    """Run `normexport ARGS...` in-process: returns (exit code, stdout, stderr)."""
    from normexport.cli import main

    def run(*argv):
        capsys.readouterr()  # only what this command prints (not a save_pretrained progress bar before it)
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="session")
def plugin_lib():
    """libnormexport_plugins.so for the TensorRT build tests: $NORMEXPORT_PLUGIN_LIB, else built from
    plugins/ against the TensorRT headers find_tensorrt_root finds (headers alone suffice); skipped with
    the reason where nvcc or the headers are missing."""
    try:
        from tests._plugin_build import build_plugins, find_nvcc, find_tensorrt_root
    except ImportError:
        from _plugin_build import build_plugins, find_nvcc, find_tensorrt_root

    path = os.environ.get("NORMEXPORT_PLUGIN_LIB")
    if path:
        return path
    if find_nvcc() is None:
        pytest.skip("nvcc not found: cannot build the plugin library")
    if find_tensorrt_root() is None:
        pytest.skip("TensorRT headers not found (no $TensorRT_ROOT, no TensorRT-10.x / 11.x folder or NVIDIA/TensorRT "
                    "clone in /usr/local, /opt, ~, ~/Downloads or next to this checkout; set TensorRT_ROOT to a folder "
                    "with include/NvInferRuntime.h): cannot build the plugin library")
    # the one build of the plugin tests (test_plugins_build, test_trt_plugin_host, test_kernel_budgets): every
    # architecture, headers alone (tests/_plugin_build.py keeps it once per run for both xdist workers)
    build = build_plugins(trt_headers_only=True)
    if build.plugin_lib is None:
        pytest.skip("CMake did not build the plugin library:\n" + build.configure_output[-500:])
    return str(build.plugin_lib)


#: the files that take minutes (a >2 GiB model through every command; the kernels built and run under
#: ASan / TSan): collected first, so `make test`'s two workers (pytest-xdist, --dist loadfile) start
#: them at once instead of one worker ending alone on them
SLOW_FIRST = ("test_scale.py", "test_kernels_emulated.py", "test_plugins_build.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: the rest keep their order
