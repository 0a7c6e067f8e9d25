"""`normexport convert` as one pass of stages over one record (issue 28, Structure): each stage a
module of normexport/convert/ that takes the record and returns it, none calling back up; the
exporter ladder gets its judge as an argument and hands it one record per exported file."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types

import numpy as np
import onnxruntime as ort
import pytest
import torch

import normexport
from normexport import convert
from normexport.convert import checking, exporting, inputs, loading, preparing, record, rewriting, writing

from test_import_cycles import ROOT, import_graph

STAGES = ("loading", "inputs", "preparing", "exporting", "rewriting", "attention", "checking", "writing")


def test_stages_never_call_back_up():
    """A stage imports no other stage (only the record, the terminal summary and the weights written
    ahead, convert.prewrite, which imports no stage either), and nothing outside normexport.convert
    imports it except the CLI and the pipeline-folder export (normexport.pipeline.exporting: each component
    of a pipeline goes through the same stages, normexport.convert.convert; .stepped_export: each kind of a
    looped child call of a cut method, pipeline/stepping.py, does too): the pass is run by
    normexport/convert/__init__.py alone."""
    graph = import_graph(ROOT)
    shared = {"normexport.convert.record", "normexport.convert.summary", "normexport.convert.prewrite"}
    for s in STAGES:
        deps = {d for d in graph[f"normexport.convert.{s}"] if d.startswith("normexport.convert")}
        assert deps <= shared, (s, deps)
    assert {d for d in graph["normexport.convert.prewrite"] if d.startswith("normexport.convert")} <= {
        "normexport.convert.record"}
    users = sorted(m for m, deps in graph.items() if not m.startswith("normexport.convert")
                   and any(d.startswith("normexport.convert") for d in deps))
    assert users == ["normexport.cli", "normexport.pipeline.cli", "normexport.pipeline.exporting",
                     "normexport.pipeline.stepped_export"], users
    # the exporter and the checks never reach convert (no judge is imported: it is given)
    for m, deps in graph.items():
        if m.startswith(("normexport.exporter", "normexport.export", "normexport.rewriter", "normexport.parity")):
            assert not any(d.startswith("normexport.convert") for d in deps), (m, deps)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    convert.add_arguments(p)
    return p.parse_args(list(argv))


def _ln_model():
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8, eps=1e-3)).eval()
    with torch.no_grad():
        m[1].weight.uniform_(0.5, 1.5)
        m[1].bias.uniform_(-0.5, 0.5)
    return m


def test_the_ladder_hands_each_file_to_the_judge_it_is_given(tmp_path, monkeypatch):
    """Stage by stage on one record: a judge that refuses the first (dynamic) file makes the ladder
    keep the next rung's record; each file came as a record of its own (the record the stage was
    given is left as it was), rewritten by the rewrite stage, and the written file computes the
    LayerNorm formula in float64."""
    factories = types.ModuleType("stage_models")  # a factory module, MODEL = stage_models:ln
    factories.ln = _ln_model
    monkeypatch.setitem(sys.modules, "stage_models", factories)
    out = tmp_path / "m.onnx"
    rec = record.Record(args=_args("stage_models:ln", "--input", "x:3x5x8", "--dynamic", "x:0,1", "--target", "ort",
                                   "-o", str(out)))
    for stage in (loading.run, inputs.run, preparing.run):
        rec = stage(rec)
    assert rec.model_ir is None and rec.names == ["x"] and rec.dynamic == {"x": [0, 1]}
    seen = []

    def judge(cand):
        seen.append(cand)
        cand = checking.judge(rewriting.run(cand))
        cand.passed = cand.passed and not cand.kept  # planted: refuse any file with a dynamic axis
        return cand

    given = rec
    rec = exporting.run(rec, judge)
    assert given.model_ir is None and given.rewrite is None, "the stage's own record was changed"
    assert len(seen) == 2 and seen[0] is not seen[1] and rec is seen[1]
    assert seen[0].kept == {"x": [0, 1]} and seen[1].kept == {}
    assert rec.sections["exporter"]["rung"] == "static"
    assert rec.sections["exporter"]["attempts"][0]["parity"] == "failed"
    assert rec.rewrite is not None and seen[0].result is not None and seen[0].result.passed
    rec = writing.run(checking.run(rec))
    assert rec.exit_code == 0 and out.exists()
    m = _ln_model()
    x = np.random.default_rng(0).standard_normal((3, 5, 8))
    h = x @ m[0].weight.detach().double().numpy().T + m[0].bias.detach().double().numpy()
    ref = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-3)
    ref = ref * m[1].weight.detach().double().numpy() + m[1].bias.detach().double().numpy()
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"x": x.astype(np.float32)})
    assert np.abs(got - ref).max() < 1e-5


@pytest.mark.parametrize("no_check, task, expected", [(False, None, True), (True, None, False),
                                                      (False, "text-generation-with-past", False)])
def test_the_ladder_judges_parity_except_for_no_check_and_the_kv_cache(no_check, task, expected):
    rec = record.Record(args=argparse.Namespace(no_check=no_check), task=task)
    assert rec.ladder_check is expected


def test_a_retried_attempt_starts_from_the_record_before_the_stage(tmp_path, monkeypatch, capsys):
    """Issue 39 item 2: the grown file failing against eager (planted here: the first attempt's
    attention stage says so) makes convert export again from a copy of the record as the exporting
    stage found it, the shallow trace off, no field reset by hand: a field added to the record
    (planted: `planted`, set by the failed attempt) is not seen by the retry, nor is anything else
    the failed attempt set (its depth and exporter sections, its fusion)."""
    from normexport.convert import attention

    @dataclasses.dataclass
    class Planted(record.Record):
        planted: str | None = None  # a field added after convert was written

    monkeypatch.setattr(convert, "Record", Planted)
    factories = types.ModuleType("stage_models")
    factories.ln = _ln_model
    monkeypatch.setitem(sys.modules, "stage_models", factories)
    entered = []  # each exporting stage's record as it was given, its fields copied
    real_export, real_attention = exporting.run, attention.run

    def export(rec, judge):
        entered.append({f.name: record._fresh(getattr(rec, f.name)) for f in dataclasses.fields(rec)})
        return real_export(rec, judge)

    def attend(rec):
        rec = real_attention(rec)
        if len(entered) == 1:  # the first attempt: its file "grown" and found unlike eager
            rec.sections["depth"] = {"grown": True, "stack": "planted", "traced": 1, "blocks": 2}
            rec.fused = types.SimpleNamespace(local={"eager_failed": True, "reason": "planted"})
            rec.planted = "set by the failed attempt"
        return rec

    monkeypatch.setattr(exporting, "run", export)
    monkeypatch.setattr(attention, "run", attend)
    out, rep = tmp_path / "m.onnx", tmp_path / "r.json"
    rec = convert.convert(_args("stage_models:ln", "--input", "x:3x5x8", "--target", "ort", "-o", str(out),
                                "--report", str(rep)))
    text = capsys.readouterr().out
    assert rec.exit_code == 0 and out.exists(), text
    assert "depth: the grown file FAILED against eager (planted): exporting the whole decoder instead" in text, text
    assert len(entered) == 2
    first, retry = entered
    assert retry["planted"] is None and rec.planted is None
    assert retry["off"] == {**first["off"], "depth": "the grown file failed against eager"}
    for name in first:
        if name != "off":
            assert retry[name] is first[name] or retry[name] == first[name], name
    report = json.loads(rep.read_text())
    assert "depth" not in report and "attention" not in report and report["exporter"]["rung"] == "dynamic"


def test_the_weights_written_ahead_have_one_owner(monkeypatch):
    """Issue 39 item 2: convert.prewrite.Prewrite owns every folder written ahead in a run: `drop`
    closes only the refused file's, `take` hands the attention stage the one for its file (another
    file's closed), and leaving the `with` closes what is open, also on an error."""
    from normexport.convert import prewrite
    from normexport.llm import files, packing

    made = []

    class Folder:  # a Workdir whose weights' write is started and closed, nothing else
        writing_in_thread = False

        def __init__(self, out):
            self.closed = 0
            made.append(self)

        def write_data_behind(self, model):
            pass

        def covers(self, model):
            return True

        def close(self):
            self.closed += 1

    monkeypatch.setattr(files, "Workdir", Folder)
    monkeypatch.setattr(packing, "pack_siblings", lambda model: [])
    monkeypatch.setattr(prewrite, "wanted", lambda rec: True)
    a, b, c = (record.Record(args=argparse.Namespace(), model_ir=object()) for _ in range(3))
    with prewrite.Prewrite() as owner:
        for rec in (a, b, c):
            rec.prewrite = owner
        prewrite.start(a)
        owner.drop(b.model_ir)  # another file refused: a's folder stays
        assert made[0].closed == 0
        owner.drop(a.model_ir)
        assert made[0].closed == 1
        prewrite.start(b)
        assert prewrite.take(c) is None and made[1].closed == 1  # written for b, asked for c
        prewrite.start(c)
        assert prewrite.take(c).workdir is made[2] and made[2].closed == 0
    assert made[2].closed == 1  # taken, still closed by its owner on leaving
    with pytest.raises(RuntimeError):
        with prewrite.Prewrite() as owner:
            a.prewrite = owner
            prewrite.start(a)
            raise RuntimeError("a stage failed")
    assert made[3].closed == 1
    assert prewrite.take(record.Record(args=argparse.Namespace())) is None  # no owner: nothing written ahead


def test_the_api_runs_the_stages_convert_runs(tmp_path, monkeypatch):
    """Issue 39 item 2.3: normexport.export.convert_module_ir and `normexport convert` run the same
    prepare / ladder / rewrite steps (normexport.export.prepare_module, run_ladder, rewrite_model):
    for one module and call, the API's report sections are convert's record's and the files agree."""
    from normexport.export import convert_module_ir, op_counts

    factories = types.ModuleType("stage_models")
    factories.ln = _ln_model
    monkeypatch.setitem(sys.modules, "stage_models", factories)
    rec = record.Record(args=_args("stage_models:ln", "--input", "x:3x5x8", "--dynamic", "x:0,1", "--target", "ort",
                                   "--no-check", "-o", str(tmp_path / "m.onnx")))
    for stage in (loading.run, inputs.run, preparing.run):
        rec = stage(rec)
    rec = exporting.run(rec, rewriting.run)
    report: dict = {}
    model = convert_module_ir(_ln_model(), rec.inputs, target="ort", input_names=["x"], dynamic_axes={"x": [0, 1]},
                              output_names=rec.output_names, report=report, rewrite_off=rec.off)
    assert set(report) == {"implementations", "fold_batchnorm", "exporter", "rewrite"}
    for name in ("implementations", "fold_batchnorm", "exporter"):
        assert report[name] == rec.sections[name], name
    assert report["rewrite"] == rec.rewrite
    assert op_counts(model) == op_counts(rec.model_ir) and op_counts(model)["LayerNormalization"] == 1
