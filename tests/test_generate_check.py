"""`normexport check` of a file with a KV cache: greedy generation step by step (docs/design.md §10,
normexport/parity/generate.py). A tiny LLaMA (grouped-query attention) converted with `--target ort
--no-check`, then:

- check passes, with a row for prefill and each decode step, in the table and the JSON;
- planted cache bugs in the runtime loop make it FAIL: the past fed back off by one position (the
  oldest position lost, the newest repeated), and decode position_ids off by one;
- a planted bug in the feeds helper all three runs share (decode position_ids repeat the last
  prompt position) makes it FAIL by eager's logits against transformers' own generate;
- bad input is one line and exit 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _llm_models  # noqa: E402

from normexport.parity import generate  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from normexport.cli import main

    root = tmp_path_factory.mktemp("gen")
    folder = _llm_models.make_folder("llama", root)
    out = root / "llama.onnx"
    assert main(["convert", str(folder), "-o", str(out), "--target", "ort", "--no-check"]) == 0
    return folder, out


def test_check_generates(converted, cli, tmp_path):
    folder, out = converted
    code, stdout, err = cli("check", out, "--reference", folder, "--tokens", 5, "--input", "input_ids:2x6",
                            "--json", tmp_path / "r.json")
    assert code == 0, stdout + err
    lines = stdout.splitlines()
    assert lines[0].startswith(f"generation check: {out} vs LlamaForCausalLM: 5 greedy tokens, batch 2, prompt 6")
    rows = [ln.split()[0] + (" " + ln.split()[1] if ln.startswith("decode") else "") for ln in lines[2:7]]
    assert rows == ["prefill", "decode 1", "decode 2", "decode 3", "decode 4"]
    assert "transformers' generate (its own cache) gives eager's tokens at 5/5 steps" in stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["check"] == "generation" and report["passed"] and report["batch"] == 2
    assert [s["past"] for s in report["steps"]] == [0, 6, 7, 8, 9]
    assert [s["sequence"] for s in report["steps"]] == [6, 1, 1, 1, 1]
    assert all(s["tokens_must_match"] and s["runtime_tokens"] == s["eager_tokens"] for s in report["steps"])
    assert report["fp64_reference"]["available"]


def _plant(monkeypatch, feed):
    """The checked file's runtime gets `feed(inputs)` at each decode step (a planted bug); the plain
    export (run second, when a row asks for it) is left correct."""
    original = generate._run_loop
    calls = []

    def planted(run, proto, path, n, dtype):
        calls.append(1)
        if len(calls) > 1:
            return original(run, proto, path, n, dtype)

        def bad_run(inputs):
            return run(feed(list(inputs)) if inputs[3].shape[2] > 0 else inputs)

        return original(bad_run, proto, path, n, dtype)

    monkeypatch.setattr(generate, "_run_loop", planted)


def _shift_past(out):
    """past fed back off by one position: the oldest position lost, the newest repeated."""
    return out[:3] + [torch.cat([t[:, :, 1:], t[:, :, -1:]], dim=2) for t in out[3:]]


def _positions_off(out):
    return out[:2] + [out[2] + 1] + out[3:]


@pytest.mark.parametrize("bug", [_shift_past, _positions_off], ids=["past-shifted", "positions-off-by-one"])
def test_planted_cache_bug_fails(converted, cli, monkeypatch, bug):
    folder, out = converted
    _plant(monkeypatch, bug)
    code, stdout, err = cli("check", out, "--reference", folder, "--tokens", 4)
    assert code == 1, stdout + err
    lines = {ln.split()[0] + (" " + ln.split()[1] if ln.startswith("decode") else ""): ln for ln in stdout.splitlines()
             if ln.startswith(("prefill", "decode"))}
    assert lines["prefill"].rstrip().endswith("PASS")  # no past at prefill: nothing to feed wrong
    assert lines["decode 1"].rstrip().endswith("FAIL")
    assert "FAIL decode 1 logits: max_abs_err" in stdout
    assert stdout.splitlines()[-1].startswith("FAILED")


def test_bad_input(converted, cli, tmp_path):
    folder, out = converted
    for argv, words in (
        (("--tokens", 0), "--tokens must be >= 1"),
        (("--backend", "trt"), "runs in onnxruntime"),
        (("--input", "attention_mask:1x8"), "takes --input input_ids:BxS"),
    ):
        code, stdout, err = cli("check", out, "--reference", folder, *argv)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (argv, err)
    code, stdout, err = cli("check", out, "--reference", "tests._cli_models:rms_block")
    assert code == 2 and "is not a transformers causal-LM folder" in err


def test_planted_feeds_bug_fails_against_generate(converted, cli, monkeypatch, tmp_path):
    """Issue 31 item 4: eager, the float64 reference and the file all get their inputs from
    `generate._feeds`; a bug there (every decode step's position_ids repeat the last prompt
    position) makes them agree with one another, and here the tokens too: only transformers'
    own `generate` (its logits per step, output_logits=True) sees it."""
    folder, out = converted
    original = generate._feeds
    prompt = []

    def repeat_last_prompt_position(lm_or_none, ids, past_len, seq_len, batch, past):
        feeds = list(original(lm_or_none, ids, past_len, seq_len, batch, past))
        if past_len == 0:  # prefill (eager, the float64 reference and the runtime each start with it)
            prompt[:] = [seq_len]
        else:  # decode: every step at the prompt's last position
            feeds[2] = torch.full_like(feeds[2], prompt[0] - 1)
        return tuple(feeds)

    monkeypatch.setattr(generate, "_feeds", repeat_last_prompt_position)
    code, stdout, err = cli("check", out, "--reference", folder, "--tokens", 4, "--json", tmp_path / "r.json")
    assert code == 1, stdout + err
    report = json.loads((tmp_path / "r.json").read_text())
    lib = report["library_generate"]
    assert lib["tokens"] == [s["eager_tokens"] for s in report["steps"]]  # the tokens alone do not see it
    assert not lib["passed"] and lib["logits_first_difference"].startswith("step 1:"), lib
    assert all(s["passed"] for s in report["steps"])  # eager, float64 and the file share the bug
    assert "FAIL: transformers' generate (its own cache) gives eager's tokens at 4/4 steps" in stdout
    assert "step 1: generate's logits differ from eager's by" in stdout
    assert any(ln.startswith("FAILED: 4/4 steps' logits within limits") for ln in stdout.splitlines()), stdout


def test_model_logits_processors_do_not_count(converted, cli, tmp_path):
    """transformers' generate is compared as plain greedy decoding: the logits processors a folder's
    generation_config.json switches on (BART's forced_eos_token_id, a repetition penalty, no repeated
    n-grams) change its tokens where eager's argmax does not; the cache settings stay the model's."""
    import shutil

    folder, out = converted
    mine = tmp_path / "folder"
    shutil.copytree(folder, mine)
    (mine / "generation_config.json").write_text(json.dumps({
        "forced_eos_token_id": 2, "no_repeat_ngram_size": 1, "repetition_penalty": 5.0, "min_new_tokens": 6,
        "eos_token_id": 2, "pad_token_id": 0}))
    code, stdout, err = cli("check", out, "--reference", mine, "--tokens", 6, "--json", tmp_path / "r.json")
    assert code == 0, stdout + err
    lib = json.loads((tmp_path / "r.json").read_text())["library_generate"]
    assert lib["passed"] and lib["equal"] == 6, lib
