"""Causal LMs exported with their KV cache (`convert --task text-generation-with-past`, the default
for causal-LM folders; docs/design.md §10), on real transformers classes with tiny random configs: LLaMA,
Qwen 3 (q/k norms), Gemma 3 (sliding window + sandwich norms, (1 + w) scales), Mistral (sliding
window), Qwen 3 MoE; grouped-query attention in all (2 KV heads for 4 query heads).

Per family: convert's generation check passes over 16 greedy tokens (16 steps: prefill + 15
decodes), every norm is fused, and, independently of normexport's check, onnxruntime generating
from the file on its own (its own tokens and cache fed back, one graph for prefill at past 0 and
decode) gives the tokens of transformers' own `generate` (its DynamicCache, sliding layers cut to
the window), over a prompt longer than the window.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _llm_models  # noqa: E402
from _norm_counts import norm_ops  # noqa: E402

FAMILIES = ["llama", "qwen3", "gemma3", "mistral", "qwen3_moe", "phi3", "olmo2"]
TOKENS = 16


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("llm")


def _convert(cli, folder: Path, out: Path, *extra):
    code, stdout, err = cli("convert", folder, "-o", out, "--report", out.with_suffix(".json"), *extra)
    return code, stdout, err, (json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else None)


def _ort_greedy(path: Path, prompt: np.ndarray, tokens: int) -> list[list[int]]:
    """onnxruntime on its own: prefill with an empty past, then one token at a time, each step's
    present.* fed back as past_key_values.* (written here, not normexport's check)."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    past_in = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    batch = prompt.shape[0]
    past = {i.name: np.zeros((batch, i.shape[1], 0, i.shape[3]), np.float32) for i in past_in}
    ids, n, out = prompt, 0, []
    for _ in range(tokens):
        s = ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((batch, n + s), np.int64),
                 "position_ids": np.broadcast_to(np.arange(n, n + s), (batch, s)).copy(), **past}
        res = sess.run(None, feeds)
        names = [o.name for o in sess.get_outputs()]
        nxt = res[0][:, -1].argmax(-1)
        out.append(nxt.tolist())
        past = {nm.replace("present.", "past_key_values."): r for nm, r in zip(names[1:], res[1:])}
        ids, n = nxt[:, None].astype(np.int64), n + s
    return out


def _norm_modules(folder: Path) -> int:
    import transformers

    cls, _ = _llm_models.config(folder.name)
    model = cls.from_pretrained(folder)
    return sum(1 for m in model.modules() if type(m).__name__.endswith("RMSNorm"))


@pytest.mark.parametrize("family", FAMILIES)
def test_family_generates_with_cache(family, root, cli):
    if family == "qwen3_moe":  # its experts need the exportable implementations switched in by prepare
        pytest.importorskip("normexport.prepare.implementations", reason="MoE experts not yet made exportable")
    folder = _llm_models.make_folder(family, root)
    out = root / f"{family}.onnx"
    code, stdout, err, report = _convert(cli, folder, out)
    assert code == 0, stdout + err
    first = stdout.splitlines()[0]
    assert first.startswith("task text-generation-with-past (default for causal-LM folders"), first

    # the generation check convert ran: 16 steps, all within the verdict, tokens where the margin says
    steps = report["steps"]
    assert [s["step"] for s in steps] == ["prefill"] + [f"decode {i}" for i in range(1, TOKENS)]
    assert report["passed"] and all(s["passed"] for s in steps)
    assert steps[0]["past"] == 0 and steps[1]["past"] == report["prompt_length"]
    required = [s for s in steps if s["tokens_must_match"]]
    assert len(required) >= TOKENS - 2, "the margin rule must bind (else the token check proves nothing)"
    assert all(s["runtime_tokens"] == s["eager_tokens"] for s in required)
    assert report["fp64_reference"]["available"]

    # the file: names, named dynamic dims, every norm fused
    m = onnx.load(str(out), load_external_data=False)
    layers = len([i for i in m.graph.input if i.name.endswith(".key")])
    assert [i.name for i in m.graph.input] == ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    assert [o.name for o in m.graph.output] == ["logits"] + [
        f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in m.graph.input}
    assert dims["input_ids"] == ["batch", "sequence"] and dims["attention_mask"] == ["batch", "total_sequence"]
    assert dims["past_key_values.0.key"][0] == "batch" and dims["past_key_values.0.key"][2] == "past_sequence"
    assert dims["past_key_values.0.key"][1] == 2  # grouped-query attention: 2 KV heads for 4 query heads
    fused = norm_ops(m, "normexport")  # RMSNorm modules fused, a SkipRMSNorm (residual Add fused in) counted as one
    assert fused["RMSNorm"] == _norm_modules(folder) > 0
    assert any(n.op_type == "SkipRMSNorm" for n in m.graph.node), "no residual Add fused (--target trt default)"

    # independent: onnxruntime alone vs transformers' own generate (its own cache semantics)
    import transformers  # noqa: F401

    cls, _ = _llm_models.config(family)
    model = cls.from_pretrained(folder).eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=TOKENS, do_sample=False,
                            min_new_tokens=TOKENS, pad_token_id=0)[:, prompt.shape[1]:]
    got = np.array(_ort_greedy(out, prompt.numpy(), TOKENS)).T
    assert got.tolist() == hf.tolist(), f"{family}: onnxruntime {got.tolist()} vs generate {hf.tolist()}"


def test_plain_task_keeps_input_ids_to_logits(root, cli):
    folder = _llm_models.make_folder("llama", root / "plain")
    out = root / "plain.onnx"
    code, stdout, err = cli("convert", folder, "-o", out, "--task", "text-generation", "--no-check")
    assert code == 0, err
    assert stdout.splitlines()[0] == "task text-generation"
    m = onnx.load(str(out), load_external_data=False)
    assert not any(i.name.startswith("past_key_values") for i in m.graph.input)
    assert [o.name for o in m.graph.output] == ["logits"]


def test_task_errors(root, cli, tmp_path):
    folder = _llm_models.make_folder("llama", root / "errors")
    code, out, err = cli("convert", folder, "-o", tmp_path / "x.onnx", "--module", "model.layers.0",
                         "--task", "text-generation-with-past")
    assert code == 2 and "--module exports one block" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.onnx").exists()
    code, out, err = cli("convert", folder, "-o", tmp_path / "x.onnx", "--input", "input_ids:2x1", "--no-check")
    assert code == 2 and "sequence >= 2" in err
    code, out, err = cli("convert", "tests._cli_models:rms_block", "-o", tmp_path / "y.onnx", "--task",
                         "text-generation-with-past")
    assert code == 2 and "applies to a transformers causal-LM folder" in err


def _with_past_file(root: Path, cli) -> Path:
    out = root / "llama.onnx"
    if not out.exists():  # the family test wrote it when it ran first
        folder = _llm_models.make_folder("llama", root)
        code, stdout, err = cli("convert", folder, "-o", out, "--no-check")
        assert code == 0, err
    return out


def test_profiles_over_past_length(root, cli):
    """One profile for prefill and decode: past from 0, total_sequence = past + sequence; --shapes by dim name."""
    from normexport.errors import UsageError
    from normexport.trt import profiles

    m = onnx.load(str(_with_past_file(root, cli)), load_external_data=False)
    shapes, how = profiles.profiles_for(m, {})
    b, s, p = (profiles.LLM_DIMS[k] for k in ("batch", "sequence", "past_sequence"))
    assert shapes["input_ids"] == ((b[0], s[0]), (b[1], s[1]), (b[2], s[2]))
    assert shapes["past_key_values.1.value"] == ((b[0], 2, 0, 8), (b[1], 2, p[1], 8), (b[2], 2, p[2], 8))
    assert shapes["attention_mask"][2] == (b[2], p[2] + s[2])
    assert "a file with a KV cache" in how
    shapes, how = profiles.profiles_for(m, profiles.parse_shapes(["past_sequence:0/8/64", "batch:2/2/2"]))
    assert shapes["past_key_values.0.key"] == ((2, 2, 0, 8), (2, 2, 8, 8), (2, 2, 64, 8))
    assert shapes["attention_mask"] == ((2, 1), (2, 24), (2, 576))
    with pytest.raises(UsageError, match="neither an input nor a dim"):
        profiles.profiles_for(m, profiles.parse_shapes(["past:0/8/64"]))


def test_build_with_plugin(root, cli, plugin_lib, tmp_path):
    """`normexport build` of the file: every normexport node a plugin layer, past length 0 in the profile."""
    from normexport import trt

    ok, why = trt.can_build()
    if not ok:
        pytest.skip(f"no TensorRT: {why}")
    path = _with_past_file(root, cli)
    m = onnx.load(str(path), load_external_data=False)
    nodes = sum(1 for n in m.graph.node if n.domain == "normexport")
    code, stdout, err = cli("build", path, "-o", tmp_path / "m.engine", "--plugin", plugin_lib,
                            "--shapes", "past_sequence:0/16/128", "--report", tmp_path / "b.json")
    assert code == 0, stdout + err
    assert "profile past_key_values.0.key: min 1x2x0x8, opt 1x2x16x8, max 4x2x128x8" in stdout
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["normexport_nodes"] == nodes > 0
    assert len(report["plugin_layers"]) == nodes and report["bodies"] == 0
    assert (tmp_path / "m.engine").stat().st_size > 0


def test_a_model_with_a_cache_of_its_own_is_pointed_to_the_plain_task(root, cli, tmp_path):
    """MiniMax (lightning-attention layers beside full attention) takes only its own cache class, not the
    DynamicCache the KV-cache task feeds: the refusal names --task text-generation, which exports it."""
    import transformers

    if not hasattr(transformers, "MiniMaxForCausalLM"):
        pytest.skip("this transformers has no MiniMax")
    cfg = transformers.MiniMaxConfig(**_llm_models.COMMON, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                     pad_token_id=0)
    folder = _llm_models.save_random(transformers.MiniMaxForCausalLM, cfg, root / "minimax")
    code, out, err = cli("convert", folder, "-o", tmp_path / "x.onnx")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "uses cache of its own" in err and "export it without the KV cache: --task text-generation" in err
    assert not (tmp_path / "x.onnx").exists()
    code, out, err = cli("convert", folder, "-o", tmp_path / "y.onnx", "--task", "text-generation", "--no-check")
    assert code == 0, err
    assert [o.name for o in onnx.load(str(tmp_path / "y.onnx"), load_external_data=False).graph.output] == ["logits"]
