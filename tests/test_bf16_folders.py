"""bfloat16 folders as users bring them (docs/design.md §8): a diffusers DiT saved in bfloat16 loads in
bfloat16 (not as a float32 copy twice the size), exports at opset 22, its unpatchify Einsum
becomes a Transpose (ONNX's Einsum has no bfloat16 form), every modulated LayerNorm is fused and
the parity check passes with the file run widened to float32 in onnxruntime."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from bench_scale import make_dit_folder  # noqa: E402
from _norm_counts import norm_ops  # noqa: E402


def test_sd3_bf16_folder_converts_in_bf16(tmp_path):
    pytest.importorskip("diffusers")
    folder = tmp_path / "sd3"
    _, expected = make_dit_folder("sd3-mini", folder)
    out = tmp_path / "sd3.onnx"
    exe = str(Path(sys.executable).with_name("normexport"))
    r = subprocess.run([exe, "convert", str(folder), "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASSED" in r.stdout and "bfloat16 run widened to float32" in r.stdout, r.stdout
    m = onnx.load(str(out))
    assert next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) == 22
    ops = norm_ops(m)  # a fused residual norm (SkipRMSNorm, GatedAdaLNZero) counted as its norm
    assert not ops["Einsum"] and not ops["LayerNormalization"], sorted(ops)
    assert ops["RMSNorm"] == expected["RMSNorm"] and ops["AdaLNZero"] >= expected["AdaLNZero"]
    assert m.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    onnx.checker.check_model(m, full_check=True)
