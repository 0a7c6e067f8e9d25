"""The anchor of an int4 LLM (docs/design.md §15): onnxruntime-genai's builder (`-p int4 -e cpu`)
on the same transformers folder, with the same block size, symmetry, accuracy level and LM head
choice, in a child process; its model.onnx is judged beside ours on the same prompt (verdict.py).
Where the builder is not installed, the model is no transformers folder, or the builder refuses it,
the reason is said and the verdict uses the thresholds instead."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def available() -> str | None:
    """None where onnxruntime-genai's builder can run here, else why not."""
    if importlib.util.find_spec("onnxruntime_genai") is None:
        return "onnxruntime-genai is not installed (pip install onnxruntime-genai)"
    return None


def build(source, opts: dict, workdir: Path) -> tuple[Path | None, str, float]:
    """(the anchor's model.onnx or None, a note, seconds) for the transformers folder `source`."""
    why = available()
    if why:
        return None, why, 0.0
    src = Path(str(source))
    if not (src.is_dir() and (src / "config.json").is_file()):
        return None, f"'{source}' is no transformers folder (the builder reads config.json and the weights)", 0.0
    if opts["algorithm"] != "rtn":
        return None, f"onnxruntime-genai's builder has no {opts['algorithm']} (it offers rtn / k_quant)", 0.0
    out = workdir / "anchor"
    src, stand_in = _with_tokenizer(src, workdir)
    extra = [f"block_size={opts['block_size']}", f"is_symmetric={str(opts['symmetric']).lower()}",
             f"accuracy_level={opts['accuracy_level']}"]
    if not opts["lm_head"]:
        extra.append("nodes_to_exclude=/lm_head/MatMul")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(out), "-p", "int4",
           "-e", "cpu", "-c", str(workdir / "cache"), "--extra_options", *extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    seconds = time.perf_counter() - t0
    model = out / "model.onnx"
    if done.returncode != 0 or not model.is_file():
        tail = [l for l in (done.stderr or done.stdout).strip().splitlines() if l.strip()]
        return None, f"onnxruntime-genai's builder failed: {tail[-1][:200] if tail else f'exit {done.returncode}'}", seconds
    return model, (f"onnxruntime-genai's builder -p int4 (block {opts['block_size']}, "
                   f"{'symmetric' if opts['symmetric'] else 'asymmetric'}, accuracy level {opts['accuracy_level']}, "
                   f"LM head {'int4' if opts['lm_head'] else 'float'}) on the same folder"
                   f"{' (no tokenizer files in it: the builder given a stand-in one, which the graph does not read)' if stand_in else ''}"
                   f", {seconds:.1f} s"), seconds


def _with_tokenizer(src: Path, workdir: Path) -> tuple[Path, bool]:
    """`src`, or where it has no tokenizer files (the builder copies a tokenizer beside its model and
    stops without one) a folder of links to its files with a stand-in tokenizer (a word-level
    tokenizer of the special tokens): the graph the builder makes does not depend on it."""
    from ..llm.deploy import tokenizer_files

    if tokenizer_files(src):
        return src, False
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    linked = workdir / "source"
    linked.mkdir()
    for f in src.iterdir():
        (linked / f.name).symlink_to(f.resolve())
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(linked)
    return linked, True


class Workdir:
    """A temp folder for the anchor, removed on leaving."""

    def __enter__(self) -> Path:
        self._tmp = tempfile.TemporaryDirectory(prefix="normexport-anchor-")
        return Path(self._tmp.name)

    def __exit__(self, *exc):
        self._tmp.cleanup()
