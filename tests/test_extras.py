"""Install extras (issue 19): `trt-rtx` installs TensorRT for RTX + Polygraphy from PyPI, and a
build without Polygraphy names the extras to install."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _extras():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_trt_rtx_extra_names_the_pypi_wheels_and_polygraphy():
    names = {req.split(";")[0].split(">")[0].split("=")[0].strip() for req in _extras()["trt-rtx"]}
    assert names == {"tensorrt-rtx-cu13-libs", "tensorrt-rtx-cu13-bindings", "polygraphy"}
    assert any(r.startswith("polygraphy") for r in _extras()["trt"])


def test_missing_polygraphy_names_the_extra(monkeypatch, tmp_path):
    from normexport.trt import builder, runtime

    try:
        runtime.load()
    except runtime.TensorRTUnavailable:
        pytest.skip("no TensorRT importable here: the Polygraphy step is not reached")

    def no_polygraphy(t):
        raise ImportError("No module named 'polygraphy'")

    monkeypatch.setattr(runtime, "polygraphy", no_polygraphy)
    with pytest.raises(builder.BuildError) as e:
        builder.build_in_process(builder.BuildSpec(str(tmp_path / "m.onnx"), str(tmp_path / "m.engine")))
    msg = str(e.value)
    assert "No module named 'polygraphy'" in msg and "pip install 'normexport[trt-rtx]'" in msg, msg
    assert "\n" not in msg
