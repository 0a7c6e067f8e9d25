"""The GroupQueryAttention fusion, its local check and the generation check run from files, for
models of any size (issue 31 part B: normexport/llm/files.py Workdir, attention.fuse(workdir=...),
parity.generate.check_generation_ir).

A tiny LLaMA (head size 16, 4 query heads over 2 KV heads) exported decomposed by convert; the
by-path route must give what the in-memory route gives (the same local-check numbers: the files
are the same graphs), its files must share one data file written once, no protobuf holding the
weights may be made on the way, and the generation check by path must PASS on the fused file
against eager / float64 / transformers' generate (independent references) and FAIL on planted
bugs (GroupQueryAttention's scale off by 10 %; a shared weight read from the wrong offset).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from test_llm_attention import COMMON, _lm


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(folder, the decomposed file as convert writes it: --no-fuse attention; the conversion
    test_llm_attention's --no-fuse test reads too, made once per run)"""
    from test_llm_attention import decomposed_by_convert

    folder, out, code, stdout = decomposed_by_convert(tmp_path_factory)
    assert code == 0, stdout
    return folder, out / "model.onnx"


def _weights(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


@pytest.fixture
def no_weight_protobuf(monkeypatch):
    """Fails a test that serialises a protobuf holding at least half the model's weights."""
    real = ir.serde.serialize_model
    seen = []

    def watched(model):
        proto = real(model)
        seen.append(proto.ByteSize())
        return proto

    monkeypatch.setattr(ir.serde, "serialize_model", watched)
    return seen


def test_fuse_by_path_matches_in_memory(exported, tmp_path, no_weight_protobuf):
    from normexport.llm import attention
    from normexport.llm.files import Workdir
    from normexport.llm.share_buffer import SHARE_BUFFER_KEY

    _, path = exported
    model_ir = ir.load(str(path))
    weights = _weights(model_ir)
    out = tmp_path / "model.onnx"
    with Workdir(out) as wd:
        f = attention.fuse(model_ir, max_positions=COMMON["max_position_embeddings"], workdir=wd)
        assert f.model is not None, f.reason
        by_path = list(no_weight_protobuf)
        assert max(by_path) < weights / 2, (by_path, weights)  # never a protobuf of the weights
        assert f.path == wd.dir / "model.onnx" and f.decomposed_path == wd.dir / wd.decomposed == wd.dir / attention.DECOMPOSED
        assert f.local["passed"] and f.share_buffer, (f.local, f.share_buffer_reason)
        # one data file: the fused file's graph refers to the decomposed file's data for every shared weight
        fused_proto = onnx.load(str(f.path), load_external_data=False)
        ext = [t for t in fused_proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        assert ext and {e.value for t in ext for e in t.external_data if e.key == "location"} == {"model.onnx.data"}
        assert sorted(p.name for p in wd.dir.iterdir()) == ["decomposed.onnx", "model.onnx", "model.onnx.data"]
        assert f.path.stat().st_size < weights / 2  # the graph file alone: the weights are not written twice
        assert fused_proto.metadata_props and any(p.key == SHARE_BUFFER_KEY for p in fused_proto.metadata_props)
        # the in-memory route on the same model: the same fused graph, the same local-check numbers
        mem = attention.fuse(model_ir, max_positions=COMMON["max_position_embeddings"])
        assert mem.local["max_abs_err"] == f.local["max_abs_err"] and mem.nodes_after == f.nodes_after
        # the file as onnxruntime loads it computes what the in-memory fused model computes
        import onnxruntime as ort

        feeds = {"input_ids": np.array([[5, 7, 9]], np.int64), "attention_mask": np.ones((1, 3), np.int64),
                 "position_ids": np.arange(3, dtype=np.int64)[None]}
        feeds.update({v.name: np.zeros((1, 2, 0, 16), np.float32) for v in model_ir.graph.inputs
                      if v.name.startswith("past_key_values.")})
        a = ort.InferenceSession(str(f.path), providers=["CPUExecutionProvider"]).run(None, feeds)
        b = ort.InferenceSession(real_bytes(mem.model), providers=["CPUExecutionProvider"]).run(None, feeds)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        # placed: renamed into the output, checked first; the temp folder leaves nothing else
        from normexport.io import check_onnx_path

        placed = wd.place("model.onnx", validate=check_onnx_path)
        assert placed == out and (tmp_path / "model.onnx.data").is_file()
        assert onnx.load(str(out)).graph.initializer  # loads with its data beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]


def test_fused_file_written_once_and_flag_only_where_verified(exported, tmp_path, monkeypatch):
    """The fused file is written once, with the share-buffer flag (issue 47 item 2: no second write of it
    after the share-buffer check); where that check fails the file is written again without the flag;
    the local check's eager steps made ahead (while the weights are written) are the ones it compares
    with: the same numbers as without the workdir."""
    from normexport.llm import attention, files, verify
    from normexport.llm.share_buffer import SHARE_BUFFER_KEY

    folder, path = exported
    model_ir = ir.load(str(path))
    lm = _lm(folder)
    writes = []
    real_write = files.Workdir.write
    monkeypatch.setattr(files.Workdir, "write", lambda self, m, name: writes.append(name) or real_write(self, m, name))
    ahead = []  # the eager outputs from the forked child (verify.EagerForked), not made again here
    real_forked = verify.EagerForked

    class Forked(real_forked):
        def result(self, *a, **k):
            out = super().result(*a, **k)
            ahead.append(out is not None)
            return out

    monkeypatch.setattr(attention, "EagerForked", Forked)
    monkeypatch.setattr(attention, "eager_ahead", lambda *a, **k: pytest.fail("eager steps run here"))

    def flag(p):
        return {e.key: e.value for e in onnx.load(str(p), load_external_data=False).metadata_props}.get(SHARE_BUFFER_KEY)

    with files.Workdir(tmp_path / "model.onnx") as wd:
        f = attention.fuse(model_ir, max_positions=COMMON["max_position_embeddings"], workdir=wd, reference=lm)
        assert f.model is not None and f.share_buffer and f.local["against"] == "eager", (f.reason, f.local)
        assert writes.count("model.onnx") == 1 and ahead == [True] and flag(f.path) == "true", writes  # (the
        # decomposed file: by a forked writer, not Workdir.write)
    mem = attention.fuse(model_ir, max_positions=COMMON["max_position_embeddings"], reference=lm)
    assert mem.local["max_abs_err"] == f.local["max_abs_err"]
    writes.clear()
    monkeypatch.setattr(attention, "share_buffer_check", lambda *a, **k: (False, "planted"))
    with files.Workdir(tmp_path / "model.onnx") as wd:
        f = attention.fuse(model_ir, max_positions=COMMON["max_position_embeddings"], workdir=wd, reference=lm)
        assert f.model is not None and not f.share_buffer and f.share_buffer_reason == "planted"
        assert writes.count("model.onnx") == 2 and flag(f.path) is None, writes
        assert SHARE_BUFFER_KEY not in f.model.metadata_props


def test_eager_steps_forked_are_eager_steps_here(exported, monkeypatch):
    """verify.EagerForked (the local check's eager steps in a forked copy of the process, beside the fusion
    passes) gives eager_ahead's outputs in this process (one torch thread there: equal to float rounding);
    a child that fails gives None (the steps then run here), said by the planted failure."""
    from normexport.llm import verify

    folder, path = exported
    model_ir = ir.load(str(path))
    lm = _lm(folder)
    here = verify.eager_ahead(model_ir, lm)
    there = verify.EagerForked(model_ir, lm).result()
    assert there is not None and len(there) == len(here) == 1 + verify.LOCAL_DECODE
    for a_step, b_step in zip(here, there, strict=True):
        assert len(a_step) == len(b_step) > 1
        for a, b in zip(a_step, b_step, strict=True):
            assert a.dtype == b.dtype == np.float64 and a.shape == b.shape
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6 * float(np.abs(a).max()))
    other = verify.eager_ahead(model_ir, lm, seed=1)  # other feeds: not what the check compares with
    assert float(np.abs(other[0][0] - there[0][0]).max()) > 1e-3
    # started earlier (convert.prewrite), it serves the local check of this file and eager model only
    started = verify.EagerForked(model_ir, lm)
    assert started.serves(model_ir, lm) and not started.serves(model_ir, _lm(folder))
    assert not started.serves(model_ir, lm, seed=1)
    started.stop()
    monkeypatch.setattr(verify.np, "savez", lambda *a, **k: 1 / 0)  # planted: the child fails
    assert verify.EagerForked(model_ir, lm).result() is None


def real_bytes(model: ir.Model) -> bytes:
    return ir.to_proto(model).SerializeToString()


def test_generation_check_by_path_passes_and_fails_on_planted_bug(exported, tmp_path, no_weight_protobuf):
    from normexport.llm import attention
    from normexport.llm.files import Workdir
    from normexport.parity.generate import check_generation_ir

    folder, path = exported
    model_ir = ir.load(str(path))
    lm = _lm(folder)
    with Workdir(tmp_path / "model.onnx") as wd:
        f = attention.fuse(model_ir, max_positions=COMMON["max_position_embeddings"], workdir=wd)
        assert f.model is not None, f.reason
        result = check_generation_ir(f.model, lm, wd, command="convert")
        assert result.passed, result.table()
        assert result.onnx_model == "model.onnx" and len(result.steps) == 16 and result.fp64_reference["available"]
        assert result.library.get("passed"), result.library  # eager vs transformers' own generate
        # the decomposed file, by path, passes too (convert's fallback when the fused one fails)
        assert check_generation_ir(model_ir, lm, wd, name=wd.decomposed, command="convert").passed
        # planted: GroupQueryAttention's scale off by 10 %: written beside (sharing the data file), it fails
        for node in f.model.graph:
            if node.op_type == "GroupQueryAttention":
                node.attributes["scale"] = ir.AttrFloat32("scale", node.attributes["scale"].as_float() * 1.1)
        bad = check_generation_ir(f.model, lm, wd, name="planted.onnx", command="convert")
        assert not bad.passed and not any(s.row.passed for s in bad.steps), bad.table()
    assert max(no_weight_protobuf) < _weights(model_ir) / 2


def test_shared_weights_at_a_wrong_offset_fail_the_local_check(exported, tmp_path, monkeypatch):
    """A planted bug in the sharing (the fused file's weights read 64 bytes off): the local check
    (decomposed vs fused, both by path) fails and the fusion is not kept."""
    from normexport.llm import attention, files
    from normexport.llm.files import Workdir

    real = ir.ExternalTensor

    def shifted(location, offset, length, dtype, **kw):
        return real(location, (offset or 0) + 64, length, dtype, **kw)

    monkeypatch.setattr(files.ir, "ExternalTensor", shifted)
    model_ir = ir.load(str(exported[1]))
    with Workdir(tmp_path / "model.onnx") as wd:
        f = attention.fuse(model_ir, max_positions=COMMON["max_position_embeddings"], workdir=wd)
    assert f.model is None and f.reason.startswith("local check failed"), f.reason


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "thread"])
def test_a_failed_background_write_is_said_not_lost(exported, tmp_path, monkeypatch, fork):
    """The decomposed file is written by a forked process (or a thread) while the fusion passes run
    (Workdir.write_behind): its error (a full disk) reaches the fusion's reason; nothing is kept
    half-written as checked."""
    from normexport.llm import attention, files
    from normexport.llm.files import Workdir

    def full(self, model, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "_FORK", fork)
    monkeypatch.setattr(files.Workdir, "_write_first", full)
    model_ir = ir.load(str(exported[1]))
    with Workdir(tmp_path / "model.onnx") as wd:
        f = attention.fuse(model_ir, max_positions=COMMON["max_position_embeddings"], workdir=wd)
        assert f.model is None and f.reason == "cannot write the files to check (No space left on device)", f.reason
        assert wd.decomposed not in wd.files
    # the initializers io.streamed swapped during a write are the model's own again
    assert all(type(v.const_value).__name__ != "Streamed" for v in model_ir.graph.initializers.values())


def test_float64_one_pass_equals_per_step(exported, monkeypatch):
    """The float64 reference of a model too large for a float64 copy runs once over the whole path
    (parity.generate._float64_one_pass): its per-step logits equal the per-step run's (float64, the
    cache fed back) to 1e-9, and the generation check passes with it; a planted bug in the slicing
    (each decode step given its neighbour's position) breaks that equality."""
    from normexport.parity import generate, reference

    folder, path = exported
    lm = _lm(folder)
    import torch

    torch_prompt = torch.randint(0, COMMON["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(3))
    path_ids, _, _ = generate._eager(lm, torch_prompt, 5, torch.float32)
    stepwise, why = generate._float64(lm, path_ids, 6)  # a float64 copy: per step
    assert why is None and len(stepwise) == 5
    monkeypatch.setattr(reference, "FP64_COPY_LIMIT_BYTES", 1)
    called = []
    real = generate._float64_one_pass
    monkeypatch.setattr(generate, "_float64_one_pass", lambda *a: called.append(1) or real(*a))
    once, why = generate._float64(lm, path_ids, 6)
    assert why is None and called and len(once) == 5
    for a, b in zip(stepwise, once):
        assert a.shape == b.shape and float(np.abs(a - b).max()) < 1e-9
    result = generate.check_generation(path, lm, command="convert")
    assert result.passed and result.fp64_reference["available"], result.table()
    # planted: decode step k given the float64 logits of position n + k instead of n + k - 1: not equal
    # to the per-step run (the comparison above is the check of the one pass; the generation check's
    # verdict scales its limit with eager's own error, so it is not where a wrong reference shows)
    monkeypatch.setattr(generate, "_float64_one_pass", lambda run, lm, p, n: (lambda r: r and [r[0]] + r[2:] + [r[-1]])(
        real(run, lm, p, n)))
    shifted, _ = generate._float64(lm, path_ids, 6)
    assert any(float(np.abs(a - b).max()) > 1e-3 for a, b in zip(stepwise, shifted))


def test_fuse_and_check_places_the_fused_file(exported, tmp_path, capsys, monkeypatch):
    """bypath.fuse_and_check (what convert calls for a file of any size): fused, verified by
    generation (on the session the local check made of the fused file: one session per file),
    placed by renames as the output; onnxruntime on the output gives the in-memory fused model's
    logits."""
    from normexport.io import check_onnx_path
    from normexport.llm import attention, bypath

    import onnxruntime as ort

    folder, path = exported
    model_ir = ir.load(str(path))
    out = tmp_path / "model.onnx"
    made = []  # the sessions made from files: the fused one, once (checked against eager: the decomposed file
    # runs only where the fused one fails)
    real_session = ort.InferenceSession

    def counted(source, *a, **k):
        if isinstance(source, str):
            made.append(Path(source).name)
        return real_session(source, *a, **k)

    monkeypatch.setattr(ort, "InferenceSession", counted)
    checked = bypath.fuse_and_check(model_ir, _lm(folder), out)
    monkeypatch.setattr(ort, "InferenceSession", real_session)
    try:
        assert made == ["model.onnx"], made
        assert checked.passed and checked.name == "model.onnx" and checked.fusion.model is checked.model_ir
        printed = capsys.readouterr().out
        assert "2 com.microsoft.GroupQueryAttention" in printed and "generation check PASSED on the fused file" in printed
        assert "PASSED: 16/16 steps' logits within limits" in printed, printed
        checked.place(validate=check_onnx_path)
    finally:
        checked.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    ops = [n.op_type for n in onnx.load(str(out)).graph.node]
    assert ops.count("GroupQueryAttention") == 2 and "Softmax" not in ops
    mem = attention.fuse(model_ir, max_positions=COMMON["max_position_embeddings"])
    import onnxruntime as ort

    feeds = {"input_ids": np.array([[5, 7, 9, 11]], np.int64), "attention_mask": np.ones((1, 4), np.int64),
             "position_ids": np.arange(4, dtype=np.int64)[None]}
    feeds.update({v.name: np.zeros((1, 2, 0, 16), np.float32) for v in model_ir.graph.inputs
                  if v.name.startswith("past_key_values.")})
    a = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feeds)
    b = ort.InferenceSession(real_bytes(mem.model), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(a[0], b[0])


def test_fuse_and_check_keeps_decomposed_when_generation_fails(exported, tmp_path, capsys, monkeypatch):
    """A fused file that passes the local check but fails the generation check (planted: its scale
    changed after the local check, the file rewritten): the decomposed file is checked and kept."""
    from normexport.llm import attention, bypath

    real = attention.for_convert

    def planted(model_ir, lm, workdir=None, sessions=None, eager=None):
        f = real(model_ir, lm, workdir=workdir, sessions=sessions, eager=eager)
        for node in f.model.graph:
            if node.op_type == "GroupQueryAttention":
                node.attributes["scale"] = ir.AttrFloat32("scale", 0.5)
        workdir.write(f.model, workdir.out.name)
        sessions.pop("fused")  # the session of the file before the plant
        return f

    monkeypatch.setattr(attention, "for_convert", planted)
    folder, path = exported
    model_ir = ir.load(str(path))
    out = tmp_path / "model.onnx"
    checked = bypath.fuse_and_check(model_ir, _lm(folder), out)
    try:
        printed = capsys.readouterr().out
        assert checked.passed and checked.name == checked.workdir.decomposed and checked.model_ir is model_ir
        assert checked.fusion.model is None and "FAILED the generation check" in checked.fusion.reason
        assert printed.count("generation check:") == 2 and "FAILED: " in printed and "PASSED: 16/16" in printed
        checked.place()
    finally:
        checked.close()
    ops = [n.op_type for n in onnx.load(str(out)).graph.node]
    assert "GroupQueryAttention" not in ops and ops.count("Softmax") == 2


def test_output_named_like_the_decomposed_file(exported, tmp_path):
    """-o decomposed.onnx: the fused file (the output's name) must not overwrite the decomposed one,
    or the local check would compare the fused file with itself (planted: Workdir.decomposed the
    output's name -> the same file, a zero error, and this test fails)."""
    from normexport.llm import attention
    from normexport.llm.files import Workdir

    model_ir = ir.load(str(exported[1]))
    with Workdir(tmp_path / "decomposed.onnx") as wd:
        f = attention.fuse(model_ir, max_positions=COMMON["max_position_embeddings"], workdir=wd)
        assert f.model is not None and f.path != f.decomposed_path and f.decomposed_path.exists()
        assert [n.op_type for n in onnx.load(str(f.decomposed_path), load_external_data=False).graph.node].count(
            "GroupQueryAttention") == 0
    mem = attention.fuse(model_ir, max_positions=COMMON["max_position_embeddings"])
    assert f.local["max_abs_err"] == mem.local["max_abs_err"] > 0
