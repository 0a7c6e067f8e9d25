"""Issue 40: optimum's `ORTDiffusionPipeline.from_pretrained(OUT)` loads a folder written by
`normexport convert PIPELINE_DIR -o OUT/` and generates what the eager pipeline does.

optimum-onnx 0.1.0 pins transformers<4.58 (and so diffusers 0.39), which cannot share .venv: the
check runs tools/optimum_check.py in .venv-optimum (`make optimum-env`), on a tiny Stable Diffusion
pipeline (tests/_pipelines.py) converted here with this normexport. Skipped, with the reason, where
.venv-optimum is absent (unless NORMEXPORT_OPTIMUM_ENV=1 lets the test make it) or cannot install.
Both ways optimum runs a session: plain `session.run` (its CPU default) and io binding (its CUDA
default, which infers each output's shape from the file's dim names).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from _shared_export import converted

pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-optimum"
PYTHON = VENV / "bin" / "python"
TOOL = ROOT / "tools" / "optimum_check.py"
UNSUPPORTED = 3  # tools/optimum_check.py: optimum has no ORT pipeline for the folder's class


@pytest.fixture(scope="module")
def optimum_python() -> Path:
    """.venv-optimum's python: made (or finished) with `make optimum-env` where the venv exists or
    NORMEXPORT_OPTIMUM_ENV=1; skipped with the reason otherwise, or with pip's error where it fails."""
    if not VENV.is_dir() and os.environ.get("NORMEXPORT_OPTIMUM_ENV") != "1":
        pytest.skip("optimum's environment .venv-optimum is absent: `make optimum-env` makes it (optimum-onnx pins "
                    "transformers<4.58, so it cannot share .venv); or set NORMEXPORT_OPTIMUM_ENV=1 to let this test "
                    "make it")
    if not (VENV / ".installed").is_file():
        if shutil.which("make") is None:
            pytest.skip("`make` not found: cannot run `make optimum-env` to make .venv-optimum")
        done = subprocess.run(["make", "optimum-env"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            log = (done.stderr + done.stdout).splitlines()
            errors = [line for line in log if line.startswith("ERROR")] or log[-1:] or ["no output"]
            pytest.skip(f"`make optimum-env` could not install optimum's environment: {errors[0]}")
    return PYTHON


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The SD pipeline converted once per run, shared with tests/test_pipeline_out.py (tests/_shared_export.py)."""
    folder, out, _ = converted("sd", tmp_path_factory)
    return folder, out


@pytest.mark.parametrize("io_binding", [False, True], ids=["session_run", "io_binding"])
def test_optimum_loads_and_generates_like_eager(optimum_python, exported, io_binding):
    folder, out = exported
    cmd = [str(optimum_python), str(TOOL), str(out), str(folder), "--steps", "4"] + (["--io-binding"] if io_binding
                                                                                      else [])
    env = {**os.environ, "PYTHONPATH": "", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    report = done.stdout.strip()
    if done.returncode == UNSUPPORTED:
        pytest.skip(report.splitlines()[-1])
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{report}\n{done.stderr[-3000:]}"
    assert "PASS: StableDiffusionPipeline" in report
