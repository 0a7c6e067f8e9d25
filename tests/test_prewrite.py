"""convert.prewrite (issue 31 item 3, issue 47 item 2): a causal LM checked by path has its weights
written into the check's data file by a forked process from before the export (the layout predicted
from the eager model, llm.weight_plan, taken by the file the ladder judges where its tensors are the
plan's), else from the ladder's judge on (its projections packed), while the export, the norm
rewrite and the fusion passes run. The file must be the one convert wrote before: the same
checks passing, eager's numbers, every weight written once (no second copy appended), no temp
folder or writer process left, also when the grown file is refused and exported again."""

from __future__ import annotations

import time

import onnx
import pytest

pytest.importorskip("transformers")

from normexport.convert import prewrite, record  # noqa: E402
from normexport.llm import files, verify, weight_plan  # noqa: E402

from test_depth import _convert, _file_vs_eager, _folder, plant_wrong_mapping  # noqa: E402


@pytest.fixture
def by_path(monkeypatch):
    """The tiny LLaMA checked from files, as a model over 2 GiB is, its weights planned as a large
    model's are (llm.weight_plan); the plans, prewrites and Workdirs made, the plans' outcomes."""
    monkeypatch.setattr(record, "PARITY_LIMIT", 1 << 10)
    monkeypatch.setattr(weight_plan, "PLAN_MIN_BYTES", files._INLINE_BYTES)
    made = {"ahead": [], "workdirs": [], "first_writes_here": 0, "planned": [], "adopted": []}
    real_init, real_ahead, real_first = files.Workdir.__init__, files.Workdir.write_data_behind, files.Workdir._write_first
    real_planned, real_adopt, real_fork = files.Workdir.write_planned, files.Workdir.adopt, files._fork_call

    def planned(self, entries):
        made["planned"].append(self)
        return real_planned(self, entries)

    def adopt(self, model):
        why = real_adopt(self, model)
        made["adopted"].append(why)
        return why

    def fork(fn):  # a writer slower than the export and the passes (as on a large model): the files wait for it
        return real_fork(lambda: (time.sleep(1.0), fn())[1])

    monkeypatch.setattr(files.Workdir, "write_planned", planned)
    monkeypatch.setattr(files.Workdir, "adopt", adopt)
    monkeypatch.setattr(files, "_fork_call", fork)

    def first(self, *a, **k):  # in this process: a forked writer's call is not counted
        made["first_writes_here"] += 1
        time.sleep(1.0)  # a writer slower than the passes (as on a large model): the files must wait for it
        return real_first(self, *a, **k)

    monkeypatch.setattr(files.Workdir, "_write_first", first)

    def init(self, *a, **k):
        real_init(self, *a, **k)
        made["workdirs"].append(self)

    def ahead(self, model):
        made["ahead"].append(self)
        return real_ahead(self, model)

    monkeypatch.setattr(files.Workdir, "__init__", init)
    monkeypatch.setattr(files.Workdir, "write_data_behind", ahead)
    made["eager"] = []  # (started, whose result the local check took) per verify.EagerForked
    real_eager_init, real_result = verify.EagerForked.__init__, verify.EagerForked.result

    def eager_init(self, *a, **k):
        real_eager_init(self, *a, **k)
        made["eager"].append([self, False])

    def result(self, *a, **k):
        out = real_result(self, *a, **k)
        for e in made["eager"]:
            e[1] = e[1] or (e[0] is self and out is not None)
        return out

    monkeypatch.setattr(verify.EagerForked, "__init__", eager_init)
    monkeypatch.setattr(verify.EagerForked, "result", result)
    made["eager_ahead"] = []  # those prewrite started
    real_eager_ahead = prewrite._eager_ahead
    monkeypatch.setattr(prewrite, "_eager_ahead", lambda rec: made["eager_ahead"].append(real_eager_ahead(rec))
                        or made["eager_ahead"][-1])
    return made


def _weight_bytes(folder) -> int:
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in m.parameters())


def _external_bytes(path) -> int:
    return sum(int({e.key: e.value for e in t.external_data}["length"])
               for t in onnx.load(str(path), load_external_data=False).graph.initializer
               if t.data_location == onnx.TensorProto.EXTERNAL)


def test_weights_written_ahead_once_and_checked_by_generation(tmp_path, by_path):
    """One convert with its generation check (docs/design.md §16: one convert for what were two tests, the
    weights written ahead once and the generation check on the prewritten files)."""
    import contextlib
    import io

    from normexport.cli import main

    folder = _folder(tmp_path)
    out = tmp_path / "out"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["convert", str(folder), "-o", f"{out}/", "--target", "ort"])
    text = buf.getvalue()
    assert code == 0, text
    # the weights' write started before the export from the eager model's layout (llm.weight_plan) and taken
    # by the file the ladder judged: no write from the file
    assert by_path["adopted"] == [None] and by_path["ahead"] == [], by_path
    assert len(by_path["planned"]) == 1 and by_path["workdirs"] == by_path["planned"], by_path
    wd = by_path["planned"][0]
    assert wd._pending is None and not wd.dir.exists()  # waited for, folder removed
    assert by_path["first_writes_here"] == 0  # the weights written by the forked writer alone, once
    # the local check's eager steps: started once, from the exported file at the judge (convert.prewrite), taken
    assert [used for _, used in by_path["eager"]] == [True], by_path["eager"]
    assert by_path["eager_ahead"] == [by_path["eager"][0][0]], by_path
    # appended: the norms' weights (64 floats: under PLAN_MIN_BYTES), the rotary's cos / sin caches the fusion made
    assert 0 < wd.appended <= 2 * 2 + 1 + 2, wd.appended
    assert "projections: 16 group(s) of MatMuls" in text and "8 com.microsoft.GroupQueryAttention" in text, text
    assert "local check PASSED (the fused file in onnxruntime against eager" in text, text
    assert "generation check PASSED on the fused file" in text and "PASSED: 16/16 steps" in text, text
    assert _file_vs_eager(folder, out / "model.onnx") < 1e-4
    # every weight once: the data file holds the weights (tied embedding: once) and what the fusion made
    # (the rotary caches, appended), no second copy of a weight
    weights = _weight_bytes(folder)
    data = (out / "model.onnx.data").stat().st_size
    assert _external_bytes(out / "model.onnx") == data < 1.2 * weights, (data, weights)  # (no tensor over 1 MiB:
    # none aligned; every byte of the data file is an initializer's)
    assert not list(out.glob(".normexport-*")) and not list(tmp_path.glob("**/.weights.onnx"))


def test_refused_grown_file_closes_its_prewrite(tmp_path, monkeypatch, by_path):
    """The grown file wrong (a planted weight mapping): the local check's eager comparison fails, convert
    says so and exports the whole decoder (test_depth's case, merged here: one convert); the first file's
    prewrite goes with its folder, the file exported whole gets its own, and the file written is eager's."""
    folder = _folder(tmp_path)
    plant_wrong_mapping(monkeypatch)
    code, text = _convert(folder, tmp_path / "out")
    assert code == 0, text
    assert "depth: the grown file FAILED against eager" in text and "exporting the whole decoder instead" in text, text
    assert "8 com.microsoft.GroupQueryAttention" in text, text
    # the grown file reads other blocks' weights (planted): the write planned before the export is not its own
    # (refused, dropped); it and the file exported whole each have their own, written from the file
    assert len(by_path["adopted"]) == 1 and "are not the file's" in by_path["adopted"][0], by_path
    assert len(by_path["planned"]) == 1 and len(by_path["ahead"]) == 2 and len(by_path["workdirs"]) == 3, by_path
    assert all(not wd.dir.exists() and wd._pending is None for wd in by_path["workdirs"])
    assert _file_vs_eager(folder, tmp_path / "out" / "model.onnx") < 1e-4


def test_a_file_whose_weights_a_pass_rebuilt_is_written_again(tmp_path, monkeypatch, by_path):
    """Where the plan's layout is not the file's (planted: the Linear weights predicted untransposed), the
    write started before the export is dropped, said on the terminal, and the weights are written from
    the file; where the file the attention stage then gets does not hold those tensors either (planted:
    a pass rebuilt them), that folder is dropped too and the weights are written from the final file:
    never half shared, every byte of the data file an initializer's."""
    from normexport.llm.files import Workdir

    monkeypatch.setattr(weight_plan, "_transposed", lambda w: weight_plan._array(w))
    monkeypatch.setattr(Workdir, "covers", lambda self, model: False)
    folder = _folder(tmp_path)
    code, text = _convert(folder, tmp_path / "out")
    assert code == 0, text
    assert len(by_path["adopted"]) == 1 and "are not the file's" in by_path["adopted"][0], by_path
    assert "weights: the write started before the export is not this file's" in text, text
    assert len(by_path["planned"]) == 1 and len(by_path["ahead"]) == 1 and len(by_path["workdirs"]) == 3, by_path
    assert all(not wd.dir.exists() for wd in by_path["workdirs"])
    out = tmp_path / "out" / "model.onnx"
    assert _file_vs_eager(folder, out) < 1e-4
    assert _external_bytes(out) == (tmp_path / "out" / "model.onnx.data").stat().st_size
