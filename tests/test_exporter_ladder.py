"""The exporter ladder (docs/design.md §9): dynamo with the dynamic axes -> dynamo with the axes that
broke made static -> dynamo fully static -> TorchScript; the first file whose parity passes is kept.

ChromaTransformer2DModel builds a tensor from the batch size in python
(`torch.tensor([0] * batch_size)`): the dynamic-batch dynamo export fails; the TorchScript
exporter bakes batch 2 into a file that says its batch is dynamic, and parity fails at batch 3/4.
The ladder must keep the static-axes dynamo file, never the TorchScript one."""

from __future__ import annotations

import pytest
import torch

import normexport
from normexport import export as nexport

from _new_families import convert, norm_calls, ops, tiny_chroma

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def chroma_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chroma") / "chroma"
    tiny_chroma().save_pretrained(folder)
    return folder


def test_chroma_folder_keeps_the_static_axes_dynamo_file(cli, chroma_folder, tmp_path):
    out = tmp_path / "chroma.onnx"
    stdout, rep, errs = convert(cli, chroma_folder, out)
    first = stdout.splitlines()[0]
    ex = rep["exporter"]
    assert ex["name"] == "dynamo" and ex["rung"] == "static axes", ex
    assert ex["static_axes"] == {"hidden_states": [0], "encoder_hidden_states": [0], "timestep": [0]}, ex
    assert "dynamo exporter, static axes hidden_states:0, encoder_hidden_states:0, timestep:0" in first, first
    assert "STATIC SHAPES" in stdout and "hidden_states: 2x8x8" in stdout, stdout
    model = __import__("onnx").load(str(out))
    assert all(d.HasField("dim_value") for i in model.graph.input for d in i.type.tensor_type.shape.dim)
    loaded = normexport.load(str(chroma_folder))
    calls = norm_calls(loaded.module, loaded.example_inputs)
    got = ops(out)
    assert got["RMSNorm"] == calls["rms"] == 7, (got, calls)
    assert got["AdaLNZero"] + got["LayerNormalization"] == calls["ln"] and got["ReduceMean"] == 0, (got, calls)
    assert max(errs) < 1e-5, errs


def test_ladder_order_and_what_each_rung_is_given(monkeypatch):
    """Rungs in order, each with the axes it should get: a dynamo export that refuses any dynamic
    axis (a planted failure) makes the second rung run with the axes torch.export can keep (here
    none: the model is a plain MLP, so keepable = all -> skipped) and the third fully static."""
    calls = []
    from normexport.exporter import rungs

    real = rungs._torch_onnx_export

    def spy(module, args, names, output_names, dynamic_axes, opset, auto=False):
        calls.append(dynamic_axes)
        if dynamic_axes:
            raise RuntimeError("planted: no dynamic axis")
        return real(module, args, names, output_names, dynamic_axes, opset, auto)

    monkeypatch.setattr(rungs, "_torch_onnx_export", spy)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).eval()
    report: dict = {}
    nexport.convert_module(m, (torch.randn(3, 8),), input_names=["x"], dynamic_axes={"x": [0]}, report=report)
    assert calls == [{"x": [0]}, None], calls  # dynamic, (static axes skipped: torch.export keeps x:0), static
    assert report["exporter"]["rung"] == "static" and report["exporter"]["static_axes"] == {"x": [0]}
    assert [a["rung"] for a in report["exporter"]["attempts"]] == ["dynamic", "static axes"]


def test_parity_refusal_moves_down_the_ladder():
    """`accept` (convert's parity check) refusing the first file: the next rung's file is kept,
    and the report says which and why."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).eval()
    seen = []

    def accept(model, kept):
        seen.append(kept)
        return not kept  # refuse any file with a dynamic axis

    report: dict = {}
    nexport.convert_module(m, (torch.randn(3, 8),), input_names=["x"], dynamic_axes={"x": [0]}, report=report,
                           accept=accept)
    assert seen == [{"x": [0]}, {}], seen
    assert report["exporter"]["rung"] == "static" and report["exporter"]["name"] == "dynamo"
    assert report["exporter"]["attempts"][0] == {"rung": "dynamic", "parity": "failed", "kept": {"x": [0]}}


def test_pixart_batch_kept_where_torch_onnx_capture_finds_its_guards_inconsistent(monkeypatch):
    """torch.onnx captures with backed_size_oblivious=True, under which torch's shape solver refuses the
    guards of PixArt's attention-mask view ('Eq((s26//s42), 16) is inconsistent!'): every axis of the real
    PixArtTransformer2DModel fell to static shapes (three whole exports per pipeline convert, a file that
    serves one batch). The capture is retried as torch.export does it by default (rungs._torch_onnx_export):
    the batch stays dynamic and parity holds at batches 2, 3, 4 against float64. Planted: the retry off ->
    rung 'static', this test fails. torch.onnx's own second capture (strict) of guards found inconsistent is not
    made (rungs.no_strict_retry_of_inconsistent_guards: it fails the same way, in as long again); planted: that
    context manager a no-op -> a strict capture is counted, this test fails."""
    from _pipelines import _perturb

    from normexport.load.call import CallAdapter

    torch.manual_seed(0)
    t = _perturb(diffusers.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=1, sample_size=8,
        patch_size=2, cross_attention_dim=16, caption_channels=16)).eval()
    kw = dict(hidden_states=torch.randn(2, 4, 8, 8), encoder_hidden_states=torch.randn(2, 12, 16),
              encoder_attention_mask=torch.ones(2, 12), timestep=torch.tensor([999, 999]),
              added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)
    call = CallAdapter(t, (), kw)
    axes = {n: [0] for n in call.input_names}
    report = {}
    captures = []
    export = torch.export.export

    def counted(*args, **kwargs):
        captures.append(kwargs.get("strict", False))
        return export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    model = normexport.convert_module(call, call.example_inputs, target="trt", input_names=call.input_names,
                                      dynamic_axes=axes, report=report)
    assert report["exporter"]["rung"] == "dynamic" and not report["exporter"].get("static_axes"), report["exporter"]
    assert captures and True not in captures, captures  # the oblivious capture, then the default one; never strict
    assert ops(model).get("AdaLNZero", 0) >= 1, ops(model)
    for i in model.graph.input:
        assert not i.type.tensor_type.shape.dim[0].HasField("dim_value"), i  # the batch symbolic in the file
    from normexport.testing import assert_parity

    checked = assert_parity(call, model, call.example_inputs, dynamic_axes=axes, extra_shapes=2, plain_export=None)
    assert sorted(s["inputs"]["hidden_states"][0] for s in checked.shapes if not s.get("skipped")) == [2, 3, 4]


def test_fewer_axes_tried_before_static(monkeypatch):
    """A caller's narrower axis sets (a pipeline component: the sizes that vary at one image size, then
    the batch) are tried in order after the requested axes and before a fully static file, in the same
    ladder: the file keeps the batch where the sequence axis cannot stay dynamic (planted refusal)."""
    from normexport.exporter import ladder, rungs

    calls = []
    real = rungs._torch_onnx_export

    def spy(module, args, names, output_names, dynamic_axes, opset, auto=False):
        calls.append(dynamic_axes)
        if dynamic_axes and 1 in dynamic_axes.get("x", []):
            raise RuntimeError("planted: the sequence axis cannot stay dynamic")
        return real(module, args, names, output_names, dynamic_axes, opset, auto)

    monkeypatch.setattr(rungs, "_torch_onnx_export", spy)
    monkeypatch.setattr(rungs, "keepable_axes", lambda m, a, n, wanted: wanted)  # Dim.AUTO: keeps them all

    class Two(torch.nn.Module):
        def forward(self, x, y):
            return x.mean(1) + y

    report: dict = {}
    kept = ladder.run(Two(), Two(), (torch.randn(2, 5, 8), torch.randn(2, 8)), names=["x", "y"], output_names=["z"],
                      dynamic_axes={"x": [0, 1], "y": [0]}, opset=18, ts_opset=17, target="onnx", auto_dynamic=False,
                      judge=lambda model, kept: (True, kept), report=report,
                      fewer=[{"x": [0, 1]}, {"x": [0], "y": [0], "w": [0]}, {"y": [0]}])
    assert calls == [{"x": [0, 1], "y": [0]}, {"x": [0, 1]}, {"x": [0], "y": [0]}], calls  # no static rung
    assert kept == {"x": [0], "y": [0]}
    ex = report["exporter"]
    assert ex["rung"] == "fewer axes" and ex["static_axes"] == {"x": [1]}, ex
    assert [(a["rung"], a.get("axes")) for a in ex["attempts"]] == [
        ("dynamic", None), ("static axes", None), ("fewer axes", {"x": [0, 1]})], ex["attempts"]


class _FixesWidth(torch.nn.Module):
    """Its code branches on y's width in python: torch.export specialises that axis and names it in its
    "conflicts between user-specified ranges and inferred ranges" error."""

    def forward(self, x, y):
        return x.sum(-1, keepdim=True) * y + (1.0 if y.shape[1] == 3 else 2.0)


@pytest.mark.parametrize("adapter", [False, True], ids=["module", "call_adapter"])
def test_axes_the_model_fixes_are_read_from_the_export_error(monkeypatch, adapter):
    """The dynamic rung's conflict error names the axes the model fixes (inputs['y'].shape[1], or
    inputs['tensors'][1].shape[1] through a CallAdapter): the static-axes rung drops exactly those
    without another torch.export trace (Dim.AUTO), and a narrower axis set that holds only fixed axes, or
    that asks again for a set already refused, is not exported. Planted: keepable_axes raising (it is not
    called) and the export counted."""
    from normexport.exporter import ladder, rungs
    from normexport.load.call import CallAdapter

    calls = []
    real = rungs._torch_onnx_export

    def spy(module, args, names, output_names, dynamic_axes, opset, auto=False):
        calls.append(dynamic_axes)
        return real(module, args, names, output_names, dynamic_axes, opset, auto)

    def no_trace(*a, **k):
        raise AssertionError("keepable_axes traced again")

    monkeypatch.setattr(rungs, "_torch_onnx_export", spy)
    monkeypatch.setattr(rungs, "keepable_axes", no_trace)
    x, y = torch.randn(2, 5), torch.randn(2, 3)
    module = CallAdapter(_FixesWidth(), (x, y), {}) if adapter else _FixesWidth()
    report: dict = {}
    seen = []

    def judge(model, kept):
        seen.append(kept)
        return len(seen) > 1, kept  # the first file refused (as parity would): the ladder goes on

    kept = ladder.run(module, module, (x, y), names=["x", "y"], output_names=["z"],
                      dynamic_axes={"x": [0], "y": [0, 1]}, opset=18, ts_opset=17, target="onnx", auto_dynamic=False,
                      judge=judge, report=report, fewer=[{"y": [1]}, {"x": [0], "y": [0]}])
    attempts = report["exporter"]["attempts"]
    assert attempts[0]["rung"] == "dynamic" and attempts[0]["error"] == "torch.export: the model fixes y:1", attempts
    assert calls[:2] == [{"x": [0], "y": [0, 1]}, {"x": [0], "y": [0]}], calls
    assert [(a["rung"], a.get("skipped")) for a in attempts[1:4]] == [
        ("static axes", None), ("fewer axes", "the model fixes y:1"),
        ("fewer axes", "the same axes as a file already refused")], attempts
    assert kept == {} and calls[2:] == [None], calls  # then the static rung, whose file the judge takes
