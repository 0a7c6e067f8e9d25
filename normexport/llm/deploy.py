"""The deployable folder of a causal LM exported with its KV cache (docs/design.md §10).

Beside the ONNX file `convert` writes what the runtimes load, so that
`onnxruntime_genai.Model(DIR)` and optimum's `ORTModelForCausalLM.from_pretrained(DIR)` generate
with nothing added:

- `genai_config.json`: onnxruntime-genai's settings, its field names as its own source reads them
  (src/config.cpp of microsoft/onnxruntime-genai; the values as its model builder's
  `make_genai_config` fills them), matched to the written graph: the input and output names read
  from the graph, `head_size` / `num_key_value_heads` / `num_hidden_layers` from its cache inputs,
  `past_present_share_buffer` true only when the graph's present tensors have the past's length
  (a graph that writes into the past buffer; normexport's concatenates, so false); token ids
  (eos / bos / pad: generation_config.json over config.json, as transformers reads them), context
  length, hidden size, attention heads and vocabulary from the model's configuration;
  `type` "decoder", onnxruntime-genai's generic decoder-only model (the graph does everything
  model-specific itself);
- a folder's `config.json`, `generation_config.json` and tokenizer files, copied as they are; a
  factory's or pickle's `config.json` / `generation_config.json` written from its config objects,
  with no tokenizer files (a note line says so).

Every file is written to a temporary name in the output folder and renamed into place; one line
lists what was written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .. import io as _io
from ..errors import UsageError, first_line
from .cache import INPUT_NAMES, KV

GENAI_CONFIG = "genai_config.json"
#: the ONNX file's name when `-o` names a folder (`-o DIR/`)
FOLDER_FILE = "model.onnx"
MODEL_FILES = ("config.json", "generation_config.json")
#: tokenizer files of a save_pretrained folder (transformers' slow and fast tokenizers, sentencepiece,
#: tiktoken, chat templates); any other `tokenizer*` file is copied too
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt", "merges.txt",
                   "chat_template.jinja", "chat_template.json")
#: config keys holding the context length, in the order transformers' configs use them
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def names_folder(arg: str | None) -> bool:
    """`-o DIR/` (a trailing slash) names the output as a folder."""
    return bool(arg) and arg.endswith(("/", os.sep))


def output_path(arg: str | None) -> Path | None:
    """`-o DIR/` (a trailing slash): the output is a folder, the file DIR/model.onnx (DIR made
    when its parent exists); any other -o is the file itself (None: the default)."""
    if not names_folder(arg):
        return Path(arg) if arg else None
    folder = Path(arg)
    if not folder.exists() and folder.parent.is_dir():
        try:
            folder.mkdir()
        except OSError as e:
            raise UsageError(f"cannot make the output folder '{folder}' ({e.strerror or first_line(e, 160)}): "
                             "choose another -o path") from None
    return folder / FOLDER_FILE


# ---- the graph's interface ------------------------------------------------------------------------

def _dim(value, axis: int):
    """A dim of a graph value: its size, its symbol's name, or None (unknown)."""
    shape = getattr(value, "shape", None)
    if shape is None or axis >= len(shape):
        return None
    d = shape[axis]
    return d if isinstance(d, int) else getattr(d, "value", None)


def graph_settings(model_ir) -> dict:
    """What onnxruntime-genai's decoder settings take from the graph itself: the input / output
    names, the cache's layers, KV heads and head size, whether present shares the past's buffer."""
    inputs = {v.name: v for v in model_ir.graph.inputs}
    outputs = {v.name: v for v in model_ir.graph.outputs}
    missing = [n for n in (*INPUT_NAMES, "past_key_values.0.key") if n not in inputs]
    if missing or "logits" not in outputs or "present.0.key" not in outputs:
        raise UsageError(f"the graph lacks the KV-cache interface onnxruntime-genai needs (missing: "
                         f"{', '.join(missing + [n for n in ('logits', 'present.0.key') if n not in outputs])})")
    layers = 0
    while f"past_key_values.{layers}.key" in inputs:
        layers += 1
    shapes = {(_dim(inputs[f"past_key_values.{i}.{kv}"], 1), _dim(inputs[f"past_key_values.{i}.{kv}"], 3))
              for i in range(layers) for kv in KV}
    heads, head_size = _dim(inputs["past_key_values.0.key"], 1), _dim(inputs["past_key_values.0.key"], 3)
    # past_present_share_buffer: the runtime hands one buffer of max_length positions as past and
    # present; only a graph whose present has the past's length (it writes the new positions into
    # the buffer) serves it. A graph that concatenates returns past + sequence positions.
    share = all(_dim(inputs[f"past_key_values.{i}.{kv}"], 2) is not None
                and _dim(outputs.get(f"present.{i}.{kv}"), 2) == _dim(inputs[f"past_key_values.{i}.{kv}"], 2)
                for i in range(layers) for kv in KV)
    # a GroupQueryAttention file whose shared-buffer run was checked (normexport.llm.attention) serves it too
    share = share or model_ir.metadata_props.get("normexport.past_present_share_buffer") == "true"
    return {"layers": layers, "num_key_value_heads": heads, "head_size": head_size, "uniform": len(shapes) == 1,
            "share_buffer": share, "vocab_size": _dim(outputs["logits"], 2)}


# ---- the model's configuration ---------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read '{path}' ({first_line(e, 160)}): fix or remove it") from None


def _text(cfg: dict) -> dict:
    """A config's text model settings (a nested text_config's keys fill what the top level lacks)."""
    nested = cfg.get("text_config")
    return {**nested, **cfg} if isinstance(nested, dict) else cfg


def _first(d: dict, *keys):
    return next((d[k] for k in keys if d.get(k) is not None), None)


def _token(gen: dict, cfg: dict, key: str):
    """A special token id as transformers' generate reads it: generation_config.json over config.json."""
    value = gen.get(key) if gen.get(key) is not None else cfg.get(key)
    if isinstance(value, list):
        value = [int(v) for v in value]
        return value[0] if len(value) == 1 else (value or None)
    return None if value is None else int(value)


def genai_config(filename: str, graph: dict, cfg: dict, gen: dict) -> tuple[dict, list[str]]:
    """(genai_config.json's content, notes) for the file `filename` with the graph settings
    `graph` (graph_settings) and the model's config.json / generation_config.json contents."""
    notes = []
    cfg = _text(cfg)
    eos, bos, pad = (_token(gen, cfg, k) for k in ("eos_token_id", "bos_token_id", "pad_token_id"))
    if pad is None and eos is not None:  # as onnxruntime-genai's builder: pad falls back to eos
        pad = eos[0] if isinstance(eos, list) else eos
    context = _first(cfg, *CONTEXT_KEYS)
    vocab = graph["vocab_size"] if isinstance(graph["vocab_size"], int) else cfg.get("vocab_size")
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    heads = _first(cfg, "num_attention_heads", "n_head", "num_heads")
    if eos is None:
        notes.append("no eos_token_id in config.json / generation_config.json: onnxruntime-genai generates to "
                     "max_length")
    if context is None:
        notes.append(f"no context length in the config ({' / '.join(CONTEXT_KEYS)}): genai_config.json has none; "
                     "give max_length to onnxruntime-genai's search options")
    if not graph["uniform"]:
        notes.append("the cache's layers differ in KV heads or head size: genai_config.json gives layer 0's "
                     f"({graph['num_key_value_heads']} heads of {graph['head_size']})")
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": filename,
        "head_size": graph["head_size"],
        "hidden_size": hidden,
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                   "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
        "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value"},
        "num_attention_heads": heads,
        "num_hidden_layers": graph["layers"],
        "num_key_value_heads": graph["num_key_value_heads"],
    }
    model = {"type": "decoder", "bos_token_id": bos, "context_length": context, "decoder": decoder,
             "eos_token_id": eos, "pad_token_id": pad, "vocab_size": vocab}
    search = {
        "do_sample": bool(gen.get("do_sample", False)),
        "max_length": context,
        "min_length": 0,
        "num_beams": int(gen.get("num_beams") or 1),
        "num_return_sequences": int(gen.get("num_return_sequences") or 1),
        "past_present_share_buffer": graph["share_buffer"],
        "repetition_penalty": float(gen.get("repetition_penalty") or 1.0),
        "temperature": float(gen.get("temperature") or 1.0),
        "top_k": int(gen.get("top_k") or 50),
        "top_p": float(gen.get("top_p") or 1.0),
    }
    # onnxruntime-genai's parser takes no null: an unknown value is left to its default
    drop = lambda d: {k: v for k, v in d.items() if v is not None}  # noqa: E731
    model["decoder"] = drop(decoder)
    return {"model": drop(model), "search": drop(search)}, notes


# ---- writing ---------------------------------------------------------------------------------------

def _write_atomic(dest: Path, write) -> None:
    """`write(tmp_path)` into a temporary file beside `dest`, then renamed to `dest` (io.write_atomic)."""
    _io.write_atomic(dest, write, "-o")


def _write_json(obj: dict, dest: Path) -> None:
    _write_atomic(dest, lambda p: p.write_text(json.dumps(obj, indent=2) + "\n"))


def _copy(src: Path, dest: Path) -> bool:
    """Copy `src` to `dest` atomically; False when they are the same file (nothing to do)."""
    if dest.exists() and os.path.samefile(src, dest):
        return False
    _write_atomic(dest, lambda p: shutil.copyfile(src, p))
    return True


def _clashes(where: Path, onnx_name: str, copies: list[Path], objects: dict) -> list[str]:
    """Files of another model in `where` that the folder's files would overwrite: a config /
    tokenizer file that differs from the one to copy or write, a genai_config.json for another ONNX
    file. (The same files, or our own genai_config.json of a re-run, are no clash.)"""
    out = []
    for src in copies:
        dest = where / src.name
        if dest.exists() and not os.path.samefile(src, dest) and dest.read_bytes() != src.read_bytes():
            out.append(src.name)
    for name, obj in objects.items():
        dest = where / name
        if dest.exists():
            try:
                same = json.loads(dest.read_text()) == obj
            except (OSError, ValueError):
                same = False
            if not same:
                out.append(name)
    genai = where / GENAI_CONFIG
    if genai.exists():
        try:
            named = json.loads(genai.read_text()).get("model", {}).get("decoder", {}).get("filename")
        except (OSError, ValueError, AttributeError):
            named = None
        if named != onnx_name:
            out.append(GENAI_CONFIG)
    return out


def tokenizer_files(folder: Path) -> list[Path]:
    names = set(TOKENIZER_FILES) | {p.name for p in folder.glob("tokenizer*")} | {p.name for p in folder.glob("*.tiktoken")}
    return sorted(folder / n for n in names if (folder / n).is_file())


def _config_objects(model) -> tuple[dict, dict]:
    """config.json / generation_config.json contents from a transformers model's config objects
    (a factory's or pickle's model): use_cache true, as the graph has the cache."""
    config = json.loads(model.config.to_json_string(use_diff=False))
    config["use_cache"] = True
    for sub in config.values():  # nested configs (text_config) carry their own flag, which load turned off
        if isinstance(sub, dict) and "use_cache" in sub:
            sub["use_cache"] = True
    gen = getattr(model, "generation_config", None)
    return config, (json.loads(gen.to_json_string(use_diff=True)) if gen is not None else {})


def write(out: Path, model_ir, lm, source: str, kind: str | None = None) -> list[str]:
    """Write the deployable folder's files beside `out` (the ONNX file just written) for the
    exported FlatCacheLM `lm` loaded from `source` (a save_pretrained folder, or a factory / pickle
    whose transformers model `lm.generates` holds); the lines to print."""
    out = Path(out)
    where = out.parent
    model = getattr(lm, "generates", None)
    folder = Path(source) if os.path.isdir(source) else None
    if model is None and folder is None:
        return ["  note: no genai_config.json: a .pt2 program carries no model configuration (special tokens, context "
                "length); convert the save_pretrained folder for a folder onnxruntime-genai and optimum load"]
    graph = graph_settings(model_ir)
    layout = getattr(lm, "layout", None)
    if layout is not None and layout.layers:  # a dim the graph leaves symbolic: the cache layout it was exported with
        for key, value in (("num_key_value_heads", layout.keys[0][0]), ("head_size", layout.keys[0][1])):
            graph[key] = graph[key] if isinstance(graph[key], int) else value
    notes: list[str] = []
    copies: list[Path] = []
    if folder is not None:
        cfg_path, gen_path = folder / "config.json", folder / "generation_config.json"
        cfg = _read_json(cfg_path) if cfg_path.is_file() else (_config_objects(model)[0] if model is not None else {})
        gen = _read_json(gen_path) if gen_path.is_file() else {}
        copies = [p for p in (cfg_path, gen_path) if p.is_file()]
        tokenizer = tokenizer_files(folder)
        copies += tokenizer
        if not tokenizer:
            notes.append(f"no tokenizer files in '{folder}': none copied (onnxruntime-genai's Tokenizer and "
                         "transformers' AutoTokenizer need them; generation from token ids works without)")
        written_objects = {}
    else:
        cfg, gen = _config_objects(model)
        written_objects = {"config.json": cfg, "generation_config.json": gen}
        notes.append(f"no tokenizer files: the model came from a {kind or 'factory or pickle'}, not a folder; "
                     f"config.json / generation_config.json written from its config objects; copy its tokenizer "
                     f"files into '{where}' for onnxruntime-genai's Tokenizer and AutoTokenizer")
    content, more = genai_config(out.name, graph, cfg, gen)
    notes += more
    clash = _clashes(where, out.name, copies, written_objects)
    if clash:  # another model's files there: writing ours would leave a folder of two models
        return [f"deployable folder not written: '{where}' already holds {', '.join(clash)} of another model "
                f"(different content); convert with -o DIR/ for a folder of its own"]
    _write_json(content, where / GENAI_CONFIG)
    written = [GENAI_CONFIG]
    for name, obj in written_objects.items():
        _write_json(obj, where / name)
        written.append(name)
    kept = []
    for src in copies:
        (written if _copy(src, where / src.name) else kept).append(src.name)
    share = "true" if graph["share_buffer"] else "false (the graph concatenates its cache)"
    line = (f"deployable folder '{where}': wrote {', '.join(written)} beside {out.name}"
            + (f" ({', '.join(kept)} already there)" if kept else "")
            + f"; past_present_share_buffer {share}; eos {content['model'].get('eos_token_id', 'none')}, "
            f"context {content['model'].get('context_length', 'none')}")
    return [line] + [f"  note: {n}" for n in notes]
