"""A damaged exported pipeline folder (docs/convert.md "A pipeline folder out"; docs/design.md §14) never
ends in an internal error: `normexport.pipeline.load(OUT)` either loads it or raises a UsageError
of one line naming what is wrong, and `normexport check OUT --reference DIR` / `normexport build
OUT/` exit 2 with that one line. Nothing in the manifest or model_index.json is trusted: a slot's
file that points outside the folder is refused before anything opens it.

A seeded generator damages copies of one real converted folder (DiTPipeline from real diffusers
classes, tests/_pipelines.py): the manifest (deleted, truncated, not JSON, keys dropped, values of
the wrong type, paths outside, shapes / dtypes / dynamic axes / output structure wrong), model_index.json
(deleted, truncated, entries wrong, classes outside diffusers / transformers) and the slots' ONNX
files (truncated, bytes flipped, emptied, deleted). CI runs PIPELINE_FUZZ_CASES (default 60) cases;
`NORMEXPORT_PIPELINE_FUZZ_CASES=1000` runs more by hand."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

import _shared_export as shared_export

diffusers = pytest.importorskip("diffusers")

CASES = int(os.environ.get("NORMEXPORT_PIPELINE_FUZZ_CASES", "60"))
WRONG_VALUES = [None, 1, -3, 1.5, True, "x", "", [], {}, [1, "a"], {"tensor": 99}, "../../outside.onnx",
                "/etc/passwd", "transformer/../../x.onnx"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The DiT pipeline converted once per run, shared with tests/test_pipeline_out.py
    (tests/_shared_export.py): damaged only in copies."""
    folder, out, _ = shared_export.converted("dit", tmp_path_factory)
    return folder, out


# ------------------------------------------------------------------------------------------------
# damage (each returns a short description)
# ------------------------------------------------------------------------------------------------
def _json_paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _json_paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _json_paths(v, path + (i,))


def _set(node, path, value):
    for k in path[:-1]:
        node = node[k]
    if value is _DROP:
        del node[path[-1]]
    else:
        node[path[-1]] = value


_DROP = object()


def _damage_json(rng: random.Random, path: Path) -> str:
    data = json.loads(path.read_text())
    kind = rng.choice(["value", "value", "value", "drop", "truncate", "not_json", "delete", "not_object"])
    if kind == "truncate":
        raw = path.read_bytes()
        path.write_bytes(raw[: rng.randrange(len(raw))])
        return f"{path.name} truncated"
    if kind == "not_json":
        path.write_text("\x00\xff not json")
        return f"{path.name} not JSON"
    if kind == "delete":
        path.unlink()
        return f"{path.name} deleted"
    if kind == "not_object":
        path.write_text(json.dumps(rng.choice([[1, 2], "text", 3, None])))
        return f"{path.name} not an object"
    paths = [p for p in _json_paths(data) if p]
    target = rng.choice(paths)
    value = _DROP if kind == "drop" else rng.choice(WRONG_VALUES)
    _set(data, target, value)
    path.write_text(json.dumps(data))
    return f"{path.name} {'/'.join(map(str, target))} -> {'dropped' if value is _DROP else repr(value)}"


def _damage_onnx(rng: random.Random, out: Path) -> str:
    path = rng.choice(sorted(out.glob("*/model.onnx")))
    raw = bytearray(path.read_bytes())
    kind = rng.choice(["truncate", "flip", "empty", "delete"])
    if kind == "truncate":
        path.write_bytes(bytes(raw[: rng.randrange(1, len(raw))]))
    elif kind == "flip":
        for _ in range(rng.randint(1, 64)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(raw))
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()
    return f"{path.parent.name}/model.onnx {kind}"


def damage(seed: int, src: Path, dst: Path) -> str:
    shutil.copytree(src, dst)
    rng = random.Random(seed)
    what = rng.choice(["manifest", "manifest", "manifest", "index", "onnx"])
    if what == "manifest":
        return _damage_json(rng, dst / "normexport_pipeline.json")
    if what == "index":
        return _damage_json(rng, dst / "model_index.json")
    return _damage_onnx(rng, dst)


# ------------------------------------------------------------------------------------------------
def _one_line(e: BaseException) -> bool:
    text = str(e)
    return bool(text.strip()) and "\n" not in text.strip() and "Traceback" not in text


def test_damaged_folders_load_or_refuse_in_one_line(converted, tmp_path):
    from normexport.errors import UsageError
    from normexport.pipeline import load

    _, out = converted
    outcomes = {"loaded": 0, "refused": 0}
    for seed in range(CASES):
        dst = tmp_path / f"case{seed}"
        what = damage(seed, out, dst)
        try:
            load(dst)
            outcomes["loaded"] += 1
        except UsageError as e:
            assert _one_line(e), f"seed {seed} ({what}): refusal is not one line: {e}"
            outcomes["refused"] += 1
        except Exception as e:  # noqa: BLE001 - the defect this test is for
            pytest.fail(f"seed {seed} ({what}): internal error {type(e).__name__}: {e}")
        shutil.rmtree(dst)
    assert outcomes["refused"] > CASES // 3, outcomes  # the generator damages for real
    print(outcomes)


@pytest.mark.parametrize("edit, words", [
    (lambda m: m["slots"]["transformer"].update(file="../../outside/model.onnx"), "points outside the folder"),
    (lambda m: m["slots"]["transformer"]["inputs"]["hidden_states"].update(dynamic=[7]), "outside its rank"),
    (lambda m: m["slots"]["transformer"]["structure"]["values"][0].update(tensor=5), "names tensor 5"),
    (lambda m: m["slots"]["vae_decoder"].update(method="eval"), "has method 'eval'"),
])
def test_cli_refuses_a_damaged_manifest_in_one_line(converted, tmp_path, cli, edit, words):
    folder, out = converted
    dst = tmp_path / "out"
    shutil.copytree(out, dst)
    path = dst / "normexport_pipeline.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    before = sorted(p.relative_to(dst) for p in dst.rglob("*"))
    for argv in (("check", dst, "--reference", folder, "--steps", "1"), ("build", dst)):
        code, _, err = cli(*argv)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (argv, code, err)
    assert sorted(p.relative_to(dst) for p in dst.rglob("*")) == before  # nothing written


def test_truncated_slot_file_is_named(converted, tmp_path):
    from normexport.errors import UsageError
    from normexport.pipeline import load

    _, out = converted
    dst = tmp_path / "out"
    shutil.copytree(out, dst)
    f = dst / "transformer" / "model.onnx"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(UsageError, match="onnxruntime cannot open .*transformer/model.onnx.*damaged"):
        load(dst)
