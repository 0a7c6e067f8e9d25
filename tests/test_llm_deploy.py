"""The deployable folder of a causal LM converted with its KV cache (docs/design.md §10, issue 31 item 1):
`convert FOLDER -o DIR/` writes DIR/model.onnx with genai_config.json, the tokenizer files,
config.json and generation_config.json, and onnxruntime-genai's generator, given DIR and nothing
else, gives transformers' greedy tokens.

A tiny LLaMA folder (random weights) with a tokenizer this file writes itself (a byte-level BPE
trained by the tokenizers library on a few sentences, saved as a PreTrainedTokenizerFast; no hub
access). Planted mismatches in the written genai_config.json make the comparison fail: an eos that
is a token transformers generates stops the generator early; `past_present_share_buffer` true on
the concatenating graph errors in onnxruntime. optimum's ORTModelForCausalLM is run only where it
imports (optimum-onnx 0.1.0 needs transformers < 4.58).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

og = pytest.importorskip("onnxruntime_genai")

import _llm_models  # noqa: E402

TOKENS = 16
PROMPT = "the quick brown fox jumps over"
CORPUS = ["the quick brown fox jumps over the lazy dog", "a tiny model writes tiny words",
          "hello world from normexport", "onnxruntime genai loads the folder as it is"] * 8
LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_tokenizer(folder: Path):
    """A byte-level BPE tokenizer (GPT-2's scheme, 300 ids; <unk> 0, <s> 1, </s> 2) saved as a
    PreTrainedTokenizerFast (the class name transformers 4.x and 5.x and onnxruntime-genai all read)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   model_input_names=["input_ids", "attention_mask"])  # as LLM tokenizers: no token_type_ids
    fast.save_pretrained(folder)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 5 writes TokenizersBackend
    path.write_text(json.dumps(config, indent=2))
    return fast


def tiny_llama(vocab_size: int = 300):
    """The factory `tests.test_llm_deploy:tiny_llama` (random weights, seed 0)."""
    import transformers as t

    torch.manual_seed(0)
    return t.LlamaForCausalLM(t.LlamaConfig(vocab_size=vocab_size, **LLAMA)).eval()


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """(source folder, DIR, convert's stdout) of `convert FOLDER -o DIR/ --target ort --no-check`."""
    import contextlib
    import io

    from normexport.cli import main

    root = tmp_path_factory.mktemp("deploy")
    folder = root / "llama"
    tok = write_tokenizer(folder)
    tiny_llama(len(tok)).save_pretrained(folder)
    out = root / "dir"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["convert", str(folder), "-o", f"{out}/", "--target", "ort", "--no-check"]) == 0
    return folder, out, buf.getvalue()


def hf_generate(folder: Path, ids: list[int], tokens: int = TOKENS) -> list[int]:
    """transformers' greedy generate from the source folder (its generation_config: eos stops it)."""
    import transformers as t

    model = t.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def genai_generate(folder: Path, ids: list[int], tokens: int = TOKENS) -> list[int]:
    """onnxruntime-genai's greedy generator on the folder as it is (only the length asked for)."""
    return _llm_models.genai_generate(folder, ids, tokens)


def prompt_ids(folder: Path) -> list[int]:
    import transformers as t

    return t.AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"]


def test_folder_holds_what_the_runtimes_load(deployed):
    import onnx

    folder, out, stdout = deployed
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "genai_config.json", "generation_config.json", "model.onnx", "tokenizer.json",
                     "tokenizer_config.json"], files
    line = next(ln for ln in stdout.splitlines() if ln.startswith("deployable folder"))
    assert ("wrote genai_config.json, config.json, generation_config.json, tokenizer.json, tokenizer_config.json "
            "beside model.onnx; past_present_share_buffer false (the graph concatenates its cache); eos 2, "
            "context 128") in line, line
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    cfg = json.loads((out / "genai_config.json").read_text())
    m, dec = cfg["model"], cfg["model"]["decoder"]
    assert (m["type"], m["eos_token_id"], m["bos_token_id"], m["pad_token_id"], m["context_length"], m["vocab_size"]) == (
        "decoder", 2, 1, 0, 128, 300)
    assert (dec["filename"], dec["head_size"], dec["num_key_value_heads"], dec["num_attention_heads"],
            dec["hidden_size"], dec["num_hidden_layers"]) == ("model.onnx", 8, 2, 4, 32, 2)
    assert cfg["search"]["past_present_share_buffer"] is False and cfg["search"]["max_length"] == 128
    graph = onnx.load(out / "model.onnx", load_external_data=False).graph
    names = {i.name for i in graph.input} | {o.name for o in graph.output}
    listed = [v for k, v in dec["inputs"].items() if "%d" not in v] + [v for v in dec["outputs"].values() if "%d" not in v]
    listed += [v % i for v in list(dec["inputs"].values()) + list(dec["outputs"].values()) if "%d" in v for i in range(2)]
    assert set(listed) <= names and len(listed) == len(names), (listed, names)
    assert not list(out.glob(".normexport-*"))  # no temporary file left behind


def test_genai_generates_transformers_tokens(deployed):
    folder, out, _ = deployed
    ids = prompt_ids(folder)
    tok = og.Tokenizer(og.Model(str(out)))
    assert [int(i) for i in tok.encode(PROMPT)] == ids  # the copied tokenizer reads the same in both
    want = hf_generate(folder, ids)
    got = genai_generate(out, ids)
    assert got == want and len(got) >= 4, (got, want)


def _planted(out: Path, tmp_path: Path, **changes) -> Path:
    bad = tmp_path / "planted"
    shutil.copytree(out, bad)
    cfg = json.loads((bad / "genai_config.json").read_text())
    for key, value in changes.items():
        (cfg["search"] if key in cfg["search"] else cfg["model"])[key] = value
    (bad / "genai_config.json").write_text(json.dumps(cfg))
    return bad


def test_planted_wrong_eos_stops_early(deployed, tmp_path):
    folder, out, _ = deployed
    ids = prompt_ids(folder)
    want = hf_generate(folder, ids)
    eos = want[2]  # a token transformers generates at the third step: onnxruntime-genai stops there
    got = genai_generate(_planted(out, tmp_path, eos_token_id=eos), ids)
    assert got != want and len(got) < len(want), (got, want)
    assert got[-1] == eos and got == want[:len(got)]


def test_planted_share_buffer_fails(deployed, tmp_path):
    """past_present_share_buffer true on a graph that concatenates its cache: onnxruntime-genai
    hands present buffers of max_length positions, the graph computes past + sequence. The first node
    to fail depends on onnxruntime's node order: the present output's shape, or the mask's GatherND
    reading past the attention mask (past positions counted from the max_length buffer)."""
    folder, out, _ = deployed
    ids = prompt_ids(folder)
    want = hf_generate(folder, ids)
    bad = _planted(out, tmp_path, past_present_share_buffer=True)
    with pytest.raises(Exception, match=r"present.0.key|GatherND node.*invalid index"):
        got = genai_generate(bad, ids)
        assert got == want  # not reached: the first run fails
    assert json.loads((out / "genai_config.json").read_text())["search"]["past_present_share_buffer"] is False


def test_factory_folder_without_tokenizer(tmp_path, cli):
    """A factory's model: genai_config.json and config.json / generation_config.json from its config
    objects, no tokenizer files (said on a note line); -o names the file, the rest goes beside it."""
    out = tmp_path / "f" / "tiny.onnx"
    out.parent.mkdir()
    code, stdout, err = cli("convert", "tests.test_llm_deploy:tiny_llama", "-o", out, "--target", "ort", "--no-check")
    assert code == 0, stdout + err
    assert sorted(p.name for p in out.parent.iterdir()) == ["config.json", "genai_config.json",
                                                            "generation_config.json", "tiny.onnx"]
    assert "note: no tokenizer files: the model came from a factory, not a folder" in stdout
    cfg = json.loads((out.parent / "genai_config.json").read_text())
    assert cfg["model"]["decoder"]["filename"] == "tiny.onnx" and cfg["model"]["eos_token_id"] == 2
    assert json.loads((out.parent / "config.json").read_text())["use_cache"] is True
    ids = [5, 17, 42, 99, 7, 250]
    model = tiny_llama()
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False)[0, len(ids):].tolist()
    assert genai_generate(out.parent, ids) == want


def test_another_models_files_are_not_overwritten(deployed, tmp_path, cli):
    """Two LLMs converted into one folder: the second writes its ONNX file, but not a genai_config /
    config.json over the first model's (a folder of two models loads neither right); it says so.
    The first model's folder: a copy of the module fixture's (the same `convert FOLDER -o DIR/
    --target ort --no-check`, one conversion fewer, docs/design.md §16)."""
    import shutil

    _, first, _ = deployed
    out = tmp_path / "both"
    shutil.copytree(first, out)
    assert {"genai_config.json", "config.json", "model.onnx"} <= {p.name for p in out.iterdir()}
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, stdout, err = cli("convert", "tests.test_llm_deploy:tiny_llama", "-o", out / "other.onnx", "--target", "ort",
                            "--no-check")
    assert code == 0, stdout + err
    assert (out / "other.onnx").is_file()
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name in before} == before
    assert f"deployable folder not written: '{out}' already holds config.json, " \
           "genai_config.json of another model" in stdout, stdout


def test_optimum_generates_transformers_tokens(deployed):
    """optimum's ORTModelForCausalLM on the folder as it is (only where optimum-onnx imports: its
    0.1.0 needs transformers < 4.58)."""
    import transformers

    try:
        from optimum.onnxruntime import ORTModelForCausalLM
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"optimum.onnxruntime does not import beside transformers {transformers.__version__} "
                    f"({type(e).__name__}: {str(e)[:120]}); optimum-onnx 0.1.0 needs transformers < 4.58")
    folder, out, _ = deployed
    ids = prompt_ids(folder)
    model = ORTModelForCausalLM.from_pretrained(out)
    got = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=TOKENS, do_sample=False)[0, len(ids):].tolist()
    assert got == hf_generate(folder, ids)


def test_share_buffer_only_where_the_graph_writes_into_the_past():
    """past_present_share_buffer follows the graph: true only where present has the past's length
    (a graph that writes into the buffer onnxruntime-genai hands it); the concatenating graph's
    present has past + sequence positions, an unknown length shares nothing."""
    import onnx_ir as ir
    from onnx import TensorProto, helper

    from normexport.llm import deploy

    def graph(present_len):
        ids = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"])
               for n in ("input_ids", "attention_mask", "position_ids")]
        past = [helper.make_tensor_value_info(f"past_key_values.0.{kv}", TensorProto.FLOAT, ["batch", 2, "max", 8])
                for kv in ("key", "value")]
        outs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", 300])]
        outs += [helper.make_tensor_value_info(f"present.0.{kv}", TensorProto.FLOAT, ["batch", 2, present_len, 8])
                 for kv in ("key", "value")]
        nodes = [helper.make_node("Identity", [f"past_key_values.0.{kv}"], [f"present.0.{kv}"]) for kv in ("key", "value")]
        nodes.append(helper.make_node("Cast", ["input_ids"], ["logits"], to=TensorProto.FLOAT))
        return ir.serde.deserialize_model(helper.make_model(helper.make_graph(nodes, "g", ids + past, outs)))

    shared = deploy.graph_settings(graph("max"))
    assert shared["share_buffer"] and (shared["layers"], shared["num_key_value_heads"], shared["head_size"],
                                       shared["vocab_size"]) == (1, 2, 8, 300)
    assert not deploy.graph_settings(graph("max + sequence"))["share_buffer"]
    assert not deploy.graph_settings(graph(None))["share_buffer"]
