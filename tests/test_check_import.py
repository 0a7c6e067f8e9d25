"""`normexport check --import MODULE` (issue 19): a .pt2 reference whose output type only an
installed module registers with torch's pytree needs that module imported before the reference
loads. Without --import: one line naming the type and the flag, exit 2; with it: the check runs
and passes. (convert's --import: tests/test_real_models.py::test_unknown_pytree_type_needs_import.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _cli_models  # noqa: E402


def _run(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    return subprocess.run([sys.executable, "-m", "normexport", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=tmp_path)


def test_check_import_loads_the_pytree_type(tmp_path):
    x, y = torch.randn(2, 5, 24), torch.randn(2, 5, 24)
    pt2, onnx_file, rep = tmp_path / "p.pt2", tmp_path / "p.onnx", tmp_path / "r.json"
    torch.export.save(torch.export.export(_cli_models.PairBlock().eval(), (x, y)), pt2)
    r = _run(["convert", pt2, "-o", onnx_file, "--no-check", "--import", "_cli_models"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr

    r = _run(["check", onnx_file, "--reference", pt2], tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        f"normexport: error: '{pt2}' uses the pytree type _cli_models.PairOutput, which no imported "
        "module registers: pass --import _cli_models (the module that defines and registers it)"]

    r = _run(["check", onnx_file, "--reference", pt2, "--import", "_cli_models", "--json", rep], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASSED" in r.stdout
    report = json.loads(rep.read_text())
    rows = [row for per in report["results"]["ort"].values() for row in per]
    assert len({name for name in report["results"]["ort"]}) == 2 and all(row["passed"] for row in rows), rows

    r = _run(["check", onnx_file, "--reference", pt2, "--import", "no_such_module_xyz"], tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--import no_such_module_xyz: cannot import it" in r.stderr
