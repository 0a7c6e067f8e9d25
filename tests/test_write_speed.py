"""The weights' writer (io.streamed inside io.save_ir and llm.files.Workdir.write): transposed,
strided and packed weights are streamed by row slabs instead of numpy's element-by-element tofile;
the files must stay exact: tensor by tensor equal to the source, the same bytes as onnx-ir's own
ir.save, 64 KiB-aligned offsets for tensors over 1 MiB, loadable by onnx and onnxruntime."""

from __future__ import annotations

import filecmp

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import numpy_helper
from onnx_ir.tensor_adapters import TorchTensor

from normexport import io
from normexport.llm import packing
from normexport.llm.files import Workdir


def _sources():
    """name -> ir tensor of every kind the exporter leaves (and a few more), shapes not multiples of
    the 128 tile, several slabs each when io._SLAB_BYTES is small."""
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)

    def w(*shape, dtype=torch.float32):
        return (torch.randn(*shape, generator=g) * 0.1).to(dtype)

    s = {}
    s["torch_contig"] = TorchTensor(w(300, 70))
    s["torch_param_t"] = TorchTensor(torch.nn.Parameter(w(130, 257)).t())  # requires_grad, transposed
    s["torch_bf16_t"] = TorchTensor(w(200, 129, dtype=torch.bfloat16).t())
    s["torch_f16_sliced"] = TorchTensor(w(260, 300, dtype=torch.float16)[5:, ::3])
    s["np_t"] = ir.Tensor(w(513, 300).numpy().T)  # the exporter's folded Transpose of a Linear weight
    s["np_big_t"] = ir.Tensor(w(600, 520).numpy().T)  # over 1 MiB: aligned
    s["np_int64_t"] = ir.Tensor(rng.integers(-2**40, 2**40, (140, 150)).T)
    s["np_int8_cols"] = ir.Tensor(rng.integers(-128, 127, (131, 400), dtype=np.int8)[:, 1::2])
    s["np_bool_t"] = ir.Tensor((rng.random((300, 129)) > 0.5).T)
    s["np_f64_t"] = ir.Tensor(rng.standard_normal((129, 131)).T)
    s["np_3d_t"] = ir.Tensor(rng.standard_normal((20, 30, 40)).astype(np.float32).transpose(2, 0, 1))
    s["np_1d_strided"] = ir.Tensor(rng.standard_normal(3000).astype(np.float32)[::2])
    s["np_contig"] = ir.Tensor(rng.standard_normal((64, 33)).astype(np.float32))
    s["packed_qkv"] = packing._concat([ir.Tensor(w(n, 260).numpy().T) for n in (256, 64, 64)])
    s["packed_gate_up"] = packing._concat([ir.Tensor(w(300, 130).numpy().T), ir.Tensor(w(300, 130).numpy().T)])
    s["packed_mixed"] = packing._concat([TorchTensor(w(70, 150).t()), ir.Tensor(w(150, 90).numpy()),
                                         ir.Tensor(w(40, 150).numpy().T)])
    s["small_inline"] = ir.Tensor(w(4, 8).numpy().T)  # 128 bytes: stays in the graph
    return s


def _expected(t) -> np.ndarray:
    """The source tensor's values, computed without the writers (C order)."""
    raw = getattr(t, "raw", None)
    if isinstance(raw, torch.Tensor):
        if raw.dtype == torch.bfloat16:
            return raw.detach().contiguous().view(torch.uint16).numpy()
        return raw.detach().contiguous().numpy()
    return np.ascontiguousarray(t.numpy())


def _model(sources, shared=True):
    inits, outs, nodes = [], [], []
    for name, t in sources.items():
        t.name = name
        v = ir.Value(name=name, shape=ir.Shape(t.shape), type=ir.TensorType(t.dtype), const_value=t)
        inits.append(v)
        o = ir.Value(name=name + "_out", shape=ir.Shape(t.shape), type=ir.TensorType(t.dtype))
        nodes.append(ir.Node("", "Identity", [v], outputs=[o]))
        outs.append(o)
    if shared:  # one tensor object behind two initializers: written twice, like onnx-ir does
        t = sources["np_t"]
        v = ir.Value(name="np_t_again", shape=ir.Shape(t.shape), type=ir.TensorType(t.dtype), const_value=t)
        inits.append(v)
        o = ir.Value(name="np_t_again_out", shape=ir.Shape(t.shape), type=ir.TensorType(t.dtype))
        nodes.append(ir.Node("", "Identity", [v], outputs=[o]))
        outs.append(o)
    graph = ir.Graph([], outs, nodes=nodes, initializers=inits, opset_imports={"": 21}, name="w")
    return ir.Model(graph, ir_version=10)


@pytest.fixture
def small_slabs(monkeypatch):
    monkeypatch.setattr(io, "_SLAB_BYTES", 4096)  # many slabs per tensor, partial last slabs


def _check_file(path, sources):
    """Every initializer of the file at `path` (external data loaded by onnx) equals its source;
    external ones over 1 MiB sit at 64 KiB-aligned offsets."""
    proto = onnx.load(str(path))
    got = {t.name: t for t in proto.graph.initializer}
    assert set(got) >= set(sources)
    external = 0
    for t in onnx.load(str(path), load_external_data=False).graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            external += 1
            e = {x.key: x.value for x in t.external_data}
            if int(e["length"]) > (1 << 20):
                assert int(e.get("offset", 0)) % 65536 == 0, t.name
    assert external == sum(1 for t in sources.values() if t.nbytes > 1024) + 1  # + the shared one again
    for name, src in sources.items():
        want = _expected(src)
        arr = numpy_helper.to_array(got[name])
        if src.dtype == ir.DataType.BFLOAT16:
            arr = np.frombuffer(got[name].raw_data, np.uint16).reshape(arr.shape)
        assert arr.shape == want.shape, name
        assert arr.dtype.itemsize == want.dtype.itemsize, name
        assert arr.tobytes() == want.tobytes(), f"{name}: written values differ from the source"
    return proto


def test_save_ir_exact_and_same_bytes_as_ir_save(tmp_path, small_slabs):
    sources = _sources()
    m = _model(sources)
    before = {v.name: v.const_value for v in m.graph.initializers.values()}
    ref = tmp_path / "ref"
    ref.mkdir()
    ir.save(m, ref / "model.onnx", external_data="model.onnx.data", size_threshold_bytes=1024, alignment=65536,
            max_workers=2)  # onnx-ir alone (numpy's slow tofile), the reference bytes
    out = io.save_ir(m, tmp_path / "model.onnx", external_data=True)
    assert {v.name: v.const_value for v in m.graph.initializers.values()} == before  # left as it was
    assert all(before[n] is v.const_value for n, v in m.graph.initializers.items())
    assert filecmp.cmp(ref / "model.onnx.data", tmp_path / "model.onnx.data", shallow=False)
    assert filecmp.cmp(ref / "model.onnx", out, shallow=False)
    _check_file(out, sources)


def test_workdir_first_write_exact(tmp_path, small_slabs):
    sources = _sources()
    m = _model(sources)
    with Workdir(tmp_path / "model.onnx") as wd:
        p = wd.write(m, "decomposed.onnx")
        _check_file(p, sources)
        # the second write shares the data file: the same tensors through the first write's offsets
        p2 = wd.write(m, "again.onnx")
        _check_file(p2, sources)


def test_streamed_used_for_slow_kinds(tmp_path, monkeypatch):
    """Transposed, strided and packed matrices go through the row-slab writer (other ranks: one C-order
    copy); C-order ones, small ones and anything it cannot read in place are left to onnx-ir."""
    sources = _sources()
    m = _model(sources, shared=False)
    seen = []

    real = io._write_rows
    monkeypatch.setattr(io, "_write_rows", lambda f, parts: (seen.append(len(parts)), real(f, parts)))
    with io.streamed(m):
        swapped = {n for n, v in m.graph.initializers.items() if type(v.const_value).__name__ == "Streamed"}
    assert swapped == {"torch_param_t", "torch_bf16_t", "torch_f16_sliced", "np_t", "np_big_t", "np_int64_t",
                       "np_int8_cols", "np_bool_t", "np_f64_t", "packed_qkv", "packed_gate_up", "packed_mixed",
                       "np_3d_t", "np_1d_strided"}  # the last two: copied whole in C order, then written
    assert all(v.const_value is sources[n] for n, v in m.graph.initializers.items())
    io.save_ir(m, tmp_path / "m.onnx", external_data=True)
    assert len(seen) == 12 and sorted(seen)[-3:] == [2, 3, 3]


def test_onnxruntime_reads_the_written_weights(tmp_path, small_slabs):
    ort = pytest.importorskip("onnxruntime")
    sources = {k: v for k, v in _sources().items() if v.dtype in (ir.DataType.FLOAT, ir.DataType.INT64,
                                                                     ir.DataType.FLOAT16, ir.DataType.DOUBLE)}
    out = io.save_ir(_model(sources, shared=False), tmp_path / "model.onnx", external_data=True)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    for name, got in zip(names, sess.run(None, {})):
        want = _expected(sources[name[:-len("_out")]])
        assert got.tobytes() == want.tobytes(), name


def test_write_behind_forked_equals_the_thread(tmp_path, monkeypatch):
    """Workdir.write_behind's first write runs in a forked process (files._FORK; beside the caller's
    Python work it is not slowed by the GIL): the same graph and data files as the thread's write,
    the parent's model untouched, the data file shared by the next write as after a plain write."""
    from normexport.llm import files

    sources = _sources()
    m = _model(sources)
    before = {n: v.const_value for n, v in m.graph.initializers.items()}
    got = {}
    for fork in (True, False):
        monkeypatch.setattr(files, "_FORK", fork)
        out = tmp_path / ("fork" if fork else "thread") / "model.onnx"
        out.parent.mkdir()
        wd = Workdir(out)
        future = wd.write_behind(m, "decomposed.onnx")
        assert getattr(future, "forked", False) is fork
        path = future.result(timeout=120)
        assert wd.files["decomposed.onnx"] == path
        _check_file(path, sources)
        again = wd.write(m, "again.onnx")  # shares the data file: the graph alone
        assert again.stat().st_size < 64 << 10
        _check_file(again, sources)
        got[fork] = (path.read_bytes(), wd.data_path.read_bytes())
        wd.close()
    assert got[True] == got[False]
    assert all(before[n] is v.const_value for n, v in m.graph.initializers.items())


def test_fork_freezes_the_parents_objects_while_a_child_lives():
    """files._fork_call freezes every object alive (gc.freeze) until its last child is reaped: the
    parent's collections meanwhile leave the pages the child shares alone (copy-on-write), and after
    it the objects are collectable again; two children overlapping keep them frozen until both end."""
    import gc
    import os

    from normexport.llm import files

    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    gc.unfreeze()  # (conftest freezes what each test file starts with; this test starts from nothing frozen)
    assert gc.get_freeze_count() == 0
    r1, w1 = os.pipe()
    first = files._fork_call(lambda: os.read(r1, 1))  # (waits until told to end)
    assert gc.get_freeze_count() > 0
    second = files._fork_call(lambda: None)
    files._wait_child(*second)
    assert gc.get_freeze_count() > 0  # the first child still shares the pages
    os.write(w1, b"x")
    files._wait_child(*first)
    os.close(r1)
    os.close(w1)
    assert gc.get_freeze_count() == 0


def test_writing_in_thread_tells_a_thread_from_a_fork(tmp_path):
    """Workdir.writing_in_thread (convert.prewrite forks the eager steps only where it is False: a lock the
    writing thread holds would stay held in the child): a pending write in a thread, not in a forked process,
    not once done."""
    from concurrent.futures import Future

    wd = Workdir(tmp_path / "model.onnx")
    try:
        assert not wd.writing_in_thread
        wd._pending = Future()
        assert wd.writing_in_thread
        wd._pending.forked = True
        assert not wd.writing_in_thread
        wd._pending = Future()
        wd._pending.set_result(None)
        assert not wd.writing_in_thread
    finally:
        wd._pending = None
        wd.close()
