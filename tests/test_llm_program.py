"""A `.pt2` program that takes a KV cache converts with the cache interface and is checked by
generation (issue 23 item 1 "the same for .pt2"; docs/design.md §10; normexport/llm/program.py).

The programs: torch.export of a real LlamaForCausalLM (tiny, random weights) behind a wrapper that
takes the cache as a nested list of (key, value) pairs, as a user writes one; the cache dims
dynamic. What is checked:
- convert: first line `task text-generation-with-past`, the file's inputs / outputs named as for a
  folder, its generation check (eager = the program itself, no guards) PASSES, and the file's
  prefill equals the transformers model's logits (so the program was fed its own inputs right);
- check FILE --reference the .pt2: the generation check, PASS;
- the pairing of past and present is found by content: a program whose "present" is not its past
  with the new positions appended (a planted scale), or whose past length is static, is no KV cache:
  convert says why on a note line and exports the call; --task text-generation-with-past is one
  line, exit 2, with the reason;
- a program whose cache tensors are its own positional parameters (CacheLM under torch.export)
  converts and generates alike;
- planted: ProgramLM feeding back layer 0's value as its key (present slots swapped) -> the check
  FAILS.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _llm_models  # noqa: E402

transformers = pytest.importorskip("transformers")

DYN = torch.export.Dim.DYNAMIC


class NestedCacheLM(nn.Module):
    """forward(input_ids, attention_mask, position_ids, past_key_values=[(k, v), ...]) ->
    (logits, [(k, v), ...]): a causal LM with its cache as plain tensors, for torch.export.
    `grow` scales the returned cache (a planted non-cache: the present no longer starts with the past)."""

    def __init__(self, model, grow: float = 1.0):
        super().__init__()
        self.model, self.grow = model, grow

    def forward(self, input_ids, attention_mask, position_ids, past_key_values):
        cache = transformers.DynamicCache(ddp_cache_data=[tuple(kv) for kv in past_key_values])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         use_cache=True)
        return out.logits, [(layer.keys * self.grow, layer.values * self.grow) for layer in out.cache.layers]


def _example(batch=2, seq=3, past=5, layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (batch, seq), generator=g)
    mask = torch.ones(batch, past + seq, dtype=torch.long)
    pos = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    kv = [(torch.randn(batch, 2, past, 8, generator=g), torch.randn(batch, 2, past, 8, generator=g))
          for _ in range(layers)]
    return ids, mask, pos, kv


def _save(module, path: Path, dynamic_past: bool = True) -> Path:
    ids, mask, pos, kv = _example()
    p = DYN if dynamic_past else None
    shapes = ({0: DYN, 1: DYN}, {0: DYN, 1: DYN}, {0: DYN, 1: DYN},
              [({0: DYN, 2: p} if p else {0: DYN}, {0: DYN, 2: p} if p else {0: DYN}) for _ in kv])
    ep = torch.export.export(module, (ids, mask, pos, kv), dynamic_shapes=shapes, strict=False)
    torch.export.save(ep, path)
    return path


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    root = tmp_path_factory.mktemp("program")
    folder = _llm_models.make_folder("llama", root)
    model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    return root, model, _save(NestedCacheLM(model), root / "lm_cache.pt2")


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def converted(lm):
    """`convert lm_cache.pt2 -o p.onnx --target trt`: (exit code, stdout, stderr, the file), one
    conversion for the tests below (docs/design.md §16)."""
    import contextlib
    import io

    from normexport.cli import main

    root, _, pt2 = lm
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["convert", str(pt2), "-o", str(root / "p.onnx"), "--target", "trt"])
    return code, out.getvalue(), err.getvalue(), root / "p.onnx"


def test_pt2_with_a_cache_converts_and_generates(lm, converted, cli):
    root, model, pt2 = lm
    code, stdout, err, out = converted
    assert code == 0, stdout + err
    lines = stdout.splitlines()
    assert lines[0] == ("task text-generation-with-past (default here: the program takes a KV cache and returns it "
                        "grown, found by running it)"), stdout
    assert "generation check:" in stdout and "PASSED: 16/16 steps' logits within limits" in stdout, stdout
    assert "transformers' generate not compared: the program is no transformers model" in stdout, stdout
    m = onnx.load(str(out), load_external_data=False)
    assert [i.name for i in m.graph.input] == ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key",
                                               "past_key_values.0.value", "past_key_values.1.key",
                                               "past_key_values.1.value"]
    assert [o.name for o in m.graph.output] == ["logits", "present.0.key", "present.0.value", "present.1.key",
                                                "present.1.value"]
    assert m.graph.input[3].type.tensor_type.shape.dim[2].dim_param == "past_sequence"
    norms = sum(1 for n in m.graph.node if n.domain == "normexport")
    assert norms == 5, [n.op_type for n in m.graph.node if n.domain == "normexport"]  # 2 layers x 2 + final

    # the file against the transformers model the program came from (not the program): a prefill (empty
    # cache) and a decode step fed the file's own present, so inputs and cache are fed in the program's order
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(4))
    nxt = torch.tensor([[5]])
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    past_names = [i.name for i in sess.get_inputs()[3:]]
    feeds = {"input_ids": ids.numpy(), "attention_mask": np.ones((1, 7), np.int64),
             "position_ids": np.arange(7)[None].astype(np.int64)}
    feeds.update({n: np.zeros((1, 2, 0, 8), np.float32) for n in past_names})
    got, *present = sess.run(None, feeds)
    feeds = {"input_ids": nxt.numpy(), "attention_mask": np.ones((1, 8), np.int64),
             "position_ids": np.array([[7]], np.int64)} | dict(zip(past_names, present))
    got_next = sess.run(["logits"], feeds)[0]
    with torch.no_grad():
        first = model(input_ids=ids, use_cache=True)
        want = first.logits.numpy()
        want_next = model(input_ids=nxt, cache=first.cache, use_cache=True).logits.numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert np.abs(got_next - want_next).max() <= 1e-4 * np.abs(want_next).max()

    code, stdout, err = cli("check", out, "--reference", pt2, "--tokens", 6)
    assert code == 0, stdout + err
    assert stdout.startswith(f"generation check: {out} vs the program of {pt2.name}: 6 greedy tokens"), stdout
    assert "PASSED: 6/6 steps" in stdout, stdout


def test_swapped_cache_feedback_fails_the_check(lm, converted):
    """Planted: the reference feeds layer 0's value back as its key (and the key as its value); the
    file is convert's of the program (the module fixture's)."""
    from normexport.llm import ProgramLM
    from normexport.load import load
    from normexport.parity.generate import check_generation

    root, model, pt2 = lm
    code, stdout, err, out = converted
    assert code == 0, stdout + err
    good = ProgramLM(load(str(pt2)))
    assert check_generation(str(out), good, tokens=4).passed
    bad = ProgramLM(load(str(pt2)))
    bad.present_slots[0], bad.present_slots[1] = bad.present_slots[1], bad.present_slots[0]
    report = check_generation(str(out), bad, tokens=4)
    assert not report.passed and report.steps[0].passed and not report.steps[1].row.passed, report.table()


def test_what_is_no_kv_cache(lm, cli, tmp_path):
    """A present that does not start with the past, a static past length: the call exported, the reason said."""
    root, model, _ = lm
    cases = {
        "scaled": (_save(NestedCacheLM(model, grow=1.5), tmp_path / "scaled.pt2"),
                   "returns no output that is its cache input past_key_values_0_0 with the 3 new positions appended "
                   "along dim 2"),
        "static": (_save(NestedCacheLM(model), tmp_path / "static.pt2", dynamic_past=False),
                   "was exported with a static past length (5 positions in past_key_values_0_0): a cache that grows "
                   "needs dim 2 dynamic"),
    }
    for name, (pt2, reason) in cases.items():
        out = tmp_path / f"{name}.onnx"
        code, stdout, err = cli("convert", pt2, "-o", out, "--task", "text-generation-with-past")
        line = _one_line(err)
        assert code == 2 and not out.exists() and "Traceback" not in stdout + err, line
        assert line == (f"normexport: error: --task text-generation-with-past does not apply to this .pt2: the "
                        f"program {reason}; export a program that takes the cache with its past length dynamic and "
                        "returns it with the new positions appended, or convert the save_pretrained folder or "
                        "package.module:callable"), line
        code, stdout, err = cli("convert", pt2, "-o", out, "--no-check")
        assert code == 0, stdout + err
        assert not stdout.startswith("task"), stdout
        assert (f"  note: the program takes tensors beside input_ids but not as a KV cache the file can carry "
                f"(the program {reason}): the file is the program's fixed call") in stdout, stdout
        names = [i.name for i in onnx.load(str(out), load_external_data=False).graph.input]
        assert names[3] == "past_key_values_0_0", names  # the program's own call, names as torch.export gave them


def test_flat_cache_program(lm, cli, tmp_path):
    """A program whose cache tensors are its own positional parameters (normexport's CacheLM under
    torch.export: past_key_values_0_key, ...; no nested call to adapt) converts and generates alike."""
    from normexport.llm import CacheLM

    root, model, _ = lm
    cache_lm = CacheLM(model)
    ex = cache_lm.example_inputs()
    dyn = [{0: DYN, 1: DYN}] * 3 + [{0: DYN, 2: DYN}] * (len(ex) - 3)
    pt2 = tmp_path / "flat.pt2"
    torch.export.save(torch.export.export(cache_lm, ex, dynamic_shapes=dyn, strict=False), pt2)
    out = tmp_path / "flat.onnx"
    code, stdout, err = cli("convert", pt2, "-o", out, "--target", "ort")
    assert code == 0, stdout + err
    assert stdout.startswith("task text-generation-with-past (default here:"), stdout
    assert "PASSED: 16/16 steps' logits within limits" in stdout, stdout
    names = [i.name for i in onnx.load(str(out), load_external_data=False).graph.input]
    assert names[3:5] == ["past_key_values.0.key", "past_key_values.0.value"], names
