"""Real sizes (docs/design.md §8): a model whose weights cross protobuf's 2 GiB goes through convert,
rewrite, check and build; the float64 reference of a model too large to copy in float64 is
computed module by module."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from bench_scale import make_folder  # noqa: E402
from _norm_counts import norm_ops  # noqa: E402


def test_streamed_float64_reference_equals_the_float64_copy(monkeypatch):
    """Above the copy limit the reference upcasts each module's own weights while it runs: the
    same float64 outputs, bit for bit, as the float64 copy; the model is left in its dtype."""
    transformers = pytest.importorskip("transformers")
    from normexport.parity import reference as R

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100)
    m = transformers.LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    ids = torch.randint(0, 100, (2, 8))
    copied, why = R._Float64Reference(m)((ids,))
    assert why is None
    monkeypatch.setattr(R, "FP64_COPY_LIMIT_BYTES", 0)
    ref = R._Float64Reference(m)
    assert ref.streamed and ref.module is m
    streamed, why = ref((ids,))
    assert why is None and streamed[0].dtype == torch.float64
    assert torch.equal(streamed[0], copied[0])
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    # and it is float64 indeed: eager bf16 differs from it by far more than float64 rounding
    with torch.no_grad():
        eager = m(ids).logits.double()
    assert (eager - streamed[0]).abs().max() > 1e-4


#: a LLaMA whose weights cross 2 GiB (2.13 GiB), mostly in its vocabulary: 2 layers, 5 RMSNorms. float32, so
#: that the bytes past protobuf's limit are half the elements of a bfloat16 model's (every step's eager and
#: float64 runs cost half; the float64 reference is still streamed: 4.3 GiB in float64) and onnxruntime runs the
#: file as it is: a bfloat16 model this size is widened piece by piece on every run of the generation check (17
#: runs, each widening and loading every piece again), which test_bf16_model_too_large_to_widen_runs_piece_by_piece
#: below tests with the limits lowered (docs/design.md §8; §16, the CI budget). Measured on the 2-core machine
#: (loaded): the whole test 146 CPU s (convert 44, rewrite 5, check 21, build 16), against more than 190 CPU s
#: for bfloat16 at 560_000 tokens before its plain export had finished (rewrite, check and build still to run)
BIG = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
           num_key_value_heads=4, vocab_size=270_000)
BIG_DTYPE = "float32"


#: peak RSS (GiB) and CPU seconds (user + sys) of each CLI step of the last _cli calls, from
#: /usr/bin/time -v where it exists (the CPU seconds: where the test's time goes, shown by -s)
PEAKS: dict[str, float] = {}
CPU: dict[str, float] = {}


def _cli(*args, timeout=900):
    exe = str(Path(sys.executable).with_name("normexport"))
    timer = ["/usr/bin/time", "-v"] if os.path.exists("/usr/bin/time") else []
    r = subprocess.run([*timer, exe, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    if m:
        PEAKS[str(args[0])] = int(m.group(1)) / 2**20
    cpu = re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", r.stderr)
    if cpu:
        CPU[str(args[0])] = sum(map(float, cpu))
        print(f"{args[0]}: {CPU[str(args[0])]:.1f} CPU s, peak {PEAKS.get(str(args[0]), 0):.2f} GiB")
    err = "\n".join(ln for ln in r.stderr.splitlines() if not ln.startswith(("\t", "Command exited")))
    return r.returncode, r.stdout, err


def gib_of(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**30


def _rmsnorms(path: Path) -> int:
    """RMSNorm modules fused: normexport::RMSNorm nodes plus SkipRMSNorm (the residual Add fused in too)."""
    return norm_ops(path, "normexport")["RMSNorm"]


def _residual_fused(path: Path) -> int:
    return sum(1 for n in onnx.load(str(path), load_external_data=False).graph.node
               if n.domain == "normexport" and n.op_type == "SkipRMSNorm")


@pytest.fixture(scope="module")
def big_folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("big") / "folder"
    gib = make_folder(BIG, d, dtype=BIG_DTYPE)
    assert gib > 2.0, gib
    return d


def test_over_2gib_convert_rewrite_check_build(big_folder, tmp_path):
    """convert (streamed to external data; a causal LM within the memory rule is checked by greedy
    generation from its files, normexport.llm.bypath),
    rewrite of the plain torch.onnx export (5 of 5 RMSNorms fused, 4 with their residual Add, each verified locally), check of
    the converted file against the folder (float64 reference module by module: the model is too large
    for a float64 copy), build in TensorRT (for RTX, CPU build) from the function bodies."""
    conv = tmp_path / "conv.onnx"
    code, out, err = _cli("convert", big_folder, "-o", conv)
    assert code == 0, err
    assert "parity: not run here" not in out and "generation check: conv.onnx vs LlamaForCausalLM" in out, out
    assert "PASSED: 16/16 steps" in out and _rmsnorms(conv) == 5 and _residual_fused(conv) == 4, out
    assert not list(tmp_path.glob(".normexport-*")), list(tmp_path.iterdir())  # the check's temp folder removed
    data = conv.with_name("conv.onnx.data")
    assert data.stat().st_size > 2 << 30 and conv.stat().st_size < 1 << 20
    onnx.checker.check_model(str(conv), full_check=True)

    # the plain export of the same folder, saved with external data as torch.onnx does (in its own
    # process, so that this one holds no copy of the weights while the CLI runs)
    from bench_scale import _PLAIN

    plain = tmp_path / "plain.onnx"
    r = subprocess.run([sys.executable, "-c", _PLAIN, str(big_folder), str(plain)], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    rw = tmp_path / "rw.onnx"
    code, out, err = _cli("rewrite", plain, "-o", rw)
    assert code == 0, err
    if "rewrite" in PEAKS:  # docs/design.md §8: the weights memory-mapped, never all in RAM twice
        assert PEAKS["rewrite"] <= 1.2 * gib_of(big_folder), PEAKS
    # 5 RMSNorm fusions and 4 residual Adds fused into them (all but the first norm's, on the embedding)
    assert _rmsnorms(rw) == 5 and _residual_fused(rw) == 4 and "local verification: 9 of 9 fusion(s) verified" in out, out
    assert "whole-model comparison: not run" in out, out
    assert (tmp_path / "rw.onnx.data").stat().st_size > 2 << 30
    assert (os.stat(rw).st_mode & 0o077) == (0o666 & ~_umask() & 0o077)

    code, out, err = _cli("check", conv, "--reference", big_folder, "--input", "input_ids:1x16")
    assert code == 0, out + err
    assert "PASS" in out, out

    if importlib.util.find_spec("tensorrt_rtx_bindings") is None and importlib.util.find_spec("tensorrt") is None:
        pytest.skip("no TensorRT here (pip install '.[trt-rtx]')")
    engine = tmp_path / "conv.engine"
    code, out, err = _cli("build", conv, "-o", engine, "--no-plugin")
    assert code == 0, out + err
    assert engine.stat().st_size > 2 << 30, out


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_bf16_model_too_large_to_widen_runs_piece_by_piece(tmp_path, monkeypatch):
    """A bfloat16 model whose float32 widening would not fit runs in onnxruntime one piece of
    weights at a time: the same outputs, bit for bit, as the whole model widened; and `check`
    passes through it (docs/design.md §8)."""
    transformers = pytest.importorskip("transformers")
    from normexport.parity import check
    from normexport.parity import runners as R
    from normexport.parity import widen

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=1000)
    m = transformers.LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    m.config.use_cache = False
    ids = torch.randint(0, 1000, (1, 16))
    path = tmp_path / "m.onnx"
    torch.onnx.export(m, (ids,), dynamo=True, opset_version=22, verbose=False).save(str(path), external_data=True)
    source = R._ModelSource(path)
    whole = R.OrtRunner(source)
    whole.activate()
    assert whole.chunked is None and whole.widened
    monkeypatch.setattr(R, "WIDEN_WHOLE_LIMIT", 0)
    monkeypatch.setattr(widen, "CHUNK_BYTES", 50_000)
    pieces = R.OrtRunner(source)
    pieces.activate()
    assert pieces.chunked is not None and len(pieces.chunked.chunks) >= 5
    a, b = whole.infer([ids])[0], pieces.infer([ids])[0]
    np.testing.assert_array_equal(a, b)

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids).logits

    rep = check(str(path), Logits(m), (ids,))
    assert rep.passed, rep.table()
    assert all(R.WIDENED in (r.warning or "") for r in rep.rows)
