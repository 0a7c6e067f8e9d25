"""`check` of a file with a KV cache after normexport.parity stopped importing normexport.llm (issue 39
item 4): parity's command takes the check by generation as a parameter (`with_past`), which
normexport.llm.checking.run passes and `normexport check` calls."""

from __future__ import annotations

import argparse

import onnx
import pytest

from normexport.errors import UsageError


def _kv_file(path):
    h = onnx.helper
    ins = [h.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["b", "s"]),
           h.make_tensor_value_info("past_key_values.0.key", onnx.TensorProto.FLOAT, ["b", 1, "p", 4])]
    g = h.make_graph([h.make_node("Identity", ["input_ids"], ["logits"])], "g", ins,
                     [h.make_tensor_value_info("logits", onnx.TensorProto.INT64, ["b", "s"])])
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), str(path))
    return path


def _args(*argv):
    from normexport.parity import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args([str(a) for a in argv])


def test_parity_hands_a_kv_cache_file_to_the_check_it_is_given(tmp_path):
    from normexport.parity import cli

    path = _kv_file(tmp_path / "kv.onnx")
    seen = []
    assert cli.run(_args(path, "--reference", "x:y"), with_past=lambda a, s: seen.append((a, s.label)) or 7) == 7
    assert seen and seen[0][1] == str(path)
    with pytest.raises(UsageError, match="takes a KV cache: its check by generation is normexport.llm.checking.run"):
        cli.run(_args(path, "--reference", "x:y"))


def test_llm_checking_passes_the_generation_check(tmp_path, monkeypatch):
    """normexport.llm.checking.run is parity's command with run_generation; its own argument checks
    answer before any model is loaded."""
    from normexport import cli as normexport_cli
    from normexport.llm import checking

    path = _kv_file(tmp_path / "kv.onnx")
    with pytest.raises(UsageError, match="--tokens must be >= 1"):
        checking.run(_args(path, "--reference", "x:y", "--tokens", "0"))
    with pytest.raises(UsageError, match="its generation check runs in onnxruntime"):
        normexport_cli._check(_args(path, "--reference", "x:y", "--backend", "trt"))


def test_steps_of_a_single_file_check_is_refused(tmp_path, cli):
    """--steps is an exported pipeline folder's option; a single file's check refuses it in one line
    instead of ignoring it."""
    path = _kv_file(tmp_path / "kv.onnx")
    code, _, err = cli("check", path, "--reference", "x:y", "--steps", "2")
    assert code == 2 and "--steps 2: denoising steps are an exported pipeline folder's check" in err, err
    assert len(err.strip().splitlines()) == 1
