"""One `normexport convert PIPELINE_DIR -o OUT/` per pipeline kind per test run, shared by the test files
that need the same converted folder (tests/test_pipeline_out.py, test_pipeline_optimum.py,
test_pipeline_damaged.py) and by both pytest-xdist workers (docs/design.md §16, the CI budget).

The folder built by tests/_pipelines.py and its conversion are made once into a folder keyed by the
content of what they depend on (the kind, the convert arguments, tests/_pipelines.py, every file of
the normexport package, the versions of torch / diffusers / transformers / onnx / onnxruntime), under
the run's shared temp root and a file lock (as tests/_plugin_build.py shares the plugin build): the
second file (or worker) waits for the first and reuses its folders. Callers must not change them
(copy first: shutil.copytree). Not a test module itself.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the convert arguments every shared conversion gets (--report: test_pipeline_out reads it)
ARGS = ("--report", "{report}")


def _digest(kind: str) -> str:
    h = hashlib.sha256(repr((kind, ARGS)).encode())
    for pkg in ("torch", "diffusers", "transformers", "onnx", "onnxruntime", "onnxscript", "onnx-ir"):
        try:
            h.update(f"{pkg}={importlib.metadata.version(pkg)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{pkg}=-".encode())
    files = [ROOT / "tests" / "_pipelines.py", Path(__file__)]
    files += sorted(p for p in (ROOT / "normexport").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for p in files:
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _shared_root(tmp_path_factory) -> Path:
    """The run's temp root both xdist workers see (each worker's basetemp is a child of it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def converted(kind: str, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(pipeline folder, converted OUT folder, convert's --report JSON) of `kind`, made once per run."""
    from _pipelines import build
    from normexport.cli import main

    root = _shared_root(tmp_path_factory) / "shared-pipeline-exports"
    root.mkdir(parents=True, exist_ok=True)
    d = root / f"{kind}-{_digest(kind)}"
    done = d / "done.json"
    with open(root / f"{d.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits for this conversion, then reuses it
        if not done.is_file():
            shutil.rmtree(d, ignore_errors=True)  # a conversion that failed half-way is made again
            d.mkdir()
            folder = build(kind, d)
            out, report = d / "out", d / "report.json"
            code = main(["convert", str(folder), "-o", f"{out}/", *(a.format(report=report) for a in ARGS)])
            assert code == 0, f"convert of the {kind} pipeline exited {code}"
            done.write_text(json.dumps({"folder": str(folder), "out": str(out), "report": str(report)}))
    made = json.loads(done.read_text())
    return Path(made["folder"]), Path(made["out"]), Path(made["report"])
