"""Damaged ONNX files never end in an internal error (docs/design.md §14, issue 39 item 5).

A seeded generator (tests/_damage.py) damages copies of real ONNX files (the reference models
exported plain and fused, and ONNX files shipped in installed wheels): truncated, bytes flipped, a
node dropped, a dangling input, a cycle, an unknown opset, initializer dims / dtype wrong, an
attribute out of range, no graph outputs, duplicate value names, NaN weights, a zero-size input
dim, an unknown op domain, external data missing or pointing outside the folder. Each case runs
`normexport rewrite` through the CLI's main() in a forked child (the parent imported torch once:
a case costs the rewrite alone; a crash, a hang or an uncaught exception fails the case), and
asserts:

- exit 0 or 2 only;
- exit 2: stderr is one non-empty line starting with "normexport: ", no "Traceback", no
  "internal error"; no output file and nothing else (no temp file) left in the output folder;
- exit 0: onnx.checker.check_model(full_check=True) accepts the written file.

CI runs NORMEXPORT_FUZZ_CASES cases (default 40, every damage kind at least twice);
`NORMEXPORT_FUZZ_CASES=1200 NORMEXPORT_FUZZ_SEED=1 .venv/bin/python -m pytest tests/test_fuzz_damaged.py`
runs more by hand (NORMEXPORT_FUZZ_REPORT=FILE.json writes each case's outcome). A few cases also
run as a real subprocess (`python -m normexport rewrite`, `normexport check`) to see the process's
own exit and stderr. Every CHECK_EVERY-th case also runs `normexport check` on the damaged file
(reference torch.nn.Identity): exit 0, 1 (the parity verdict) or 2 with one line, never an internal
error.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

import _damage

CASES = int(os.environ.get("NORMEXPORT_FUZZ_CASES", "40"))
SEED = int(os.environ.get("NORMEXPORT_FUZZ_SEED", "0"))
TIMEOUT = 120  # seconds for one case
CHECK_EVERY = 5  # every 5th case (prime to the 16 kinds: each kind in turn) also runs `normexport check`


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz_corpus")
    files = _damage.export_reference(d) + _damage.shipped_files()
    assert len(files) >= 10
    return files


def run_forked(argv: list[str], folder: Path, timeout: float = TIMEOUT) -> tuple[int, str, str]:
    """normexport's main(argv) in a forked child: (exit code, stdout, stderr). A signal is -signum;
    an exception main() let through prints its traceback and exits 99; a hang is killed (-9)."""
    from normexport import cli

    out_f, err_f = folder / "stdout.txt", folder / "stderr.txt"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 98
        try:
            fo = os.open(out_f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            fe = os.open(err_f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fo, 1)
            os.dup2(fe, 2)
            sys.stdout = os.fdopen(1, "w", closefd=False)
            sys.stderr = os.fdopen(2, "w", closefd=False)
            code = cli.main(argv)
        except BaseException:  # noqa: BLE001 - what main() let through: a traceback the user would see
            import traceback

            traceback.print_exc()
            code = 99
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -9, "", f"timed out after {timeout} s"
        time.sleep(0.02)
    code = os.waitstatus_to_exitcode(status)
    return code, out_f.read_text(errors="replace"), err_f.read_text(errors="replace")


def problems(code: int, err: str, out_dir: Path, out_path: Path) -> list[str]:
    """What is wrong with one outcome (empty: fine)."""
    bad = []
    left = sorted(p.name for p in out_dir.iterdir())
    if code == 2:
        lines = err.strip("\n").split("\n")
        if len(lines) != 1 or not lines[0].strip():
            bad.append(f"stderr is {len(lines)} lines: {err[:600]!r}")
        if not err.startswith("normexport: "):
            bad.append(f"stderr does not start with 'normexport: ': {err[:300]!r}")
        if "Traceback" in err or "internal error" in err:
            bad.append(f"traceback / internal error: {err[:600]!r}")
        if left:
            bad.append(f"left in the output folder after a refusal: {left}")
    elif code == 0:
        if "Traceback" in err or "internal error" in err:
            bad.append(f"exit 0 but stderr has {err[:600]!r}")
        if not out_path.is_file():
            bad.append("exit 0 without an output file")
        else:
            try:
                onnx.checker.check_model(str(out_path), full_check=True)
            except Exception as e:  # noqa: BLE001
                bad.append(f"exit 0, the checker refuses the output: {type(e).__name__}: {str(e)[:300]}")
        stray = [n for n in left if not (n == out_path.name or n == out_path.name + ".data")]
        if stray:
            bad.append(f"exit 0, stray files in the output folder: {stray}")
    else:
        bad.append(f"exit {code}: {err[-800:]!r}")
    return bad


def run_case(case: _damage.Case, root: Path) -> dict:
    work = root / case.id
    src_dir, out_dir = work / "in", work / "out"
    what = _damage.damage(case, src_dir)
    out_dir.mkdir(parents=True)
    out_path = out_dir / "model.trt.onnx"
    code, out, err = run_forked(["rewrite", str(src_dir / "model.onnx"), "-o", str(out_path)], work)
    return {"case": case.id, "kind": case.kind, "damage": what, "code": code, "stderr": err.strip()[:400],
            "problems": problems(code, err, out_dir, out_path)}


def check_problems(code: int, err: str) -> list[str]:
    """`normexport check` on a damaged file against torch.nn.Identity: 0 or 1 (the parity verdict)
    or 2 (one line); never an internal error or a traceback."""
    bad = []
    if code not in (0, 1, 2):
        bad.append(f"check: exit {code}: {err[-600:]!r}")
    if "Traceback" in err or "internal error" in err:
        bad.append(f"check: traceback / internal error: {err[-600:]!r}")
    if code == 2 and (len(err.strip("\n").split("\n")) != 1 or not err.startswith("normexport: ")):
        bad.append(f"check: exit 2 but stderr is not one 'normexport: ' line: {err[:600]!r}")
    return bad


def test_fuzz_rewrite_damaged(sources, tmp_path):
    results = []
    for i, c in enumerate(_damage.cases(sources, CASES, SEED)):
        r = run_case(c, tmp_path)
        if i % CHECK_EVERY == 0:  # `normexport check` too, on every CHECK_EVERY-th case (a parity run each)
            work = tmp_path / c.id
            code, _, err = run_forked(["check", str(work / "in" / "model.onnx"), "--reference", "torch.nn:Identity"],
                                      work)
            r["check_code"] = code
            r["problems"] += check_problems(code, err)
        results.append(r)
    report = os.environ.get("NORMEXPORT_FUZZ_REPORT")
    if report:
        Path(report).write_text(json.dumps(results, indent=1))
    by_kind = collections.Counter((r["kind"], r["code"]) for r in results)
    print("\n" + "\n".join(f"{k:18} exit {c}: {n}" for (k, c), n in sorted(by_kind.items())))
    failed = [f"{r['case']} ({r['damage']}): {'; '.join(r['problems'])}" for r in results if r["problems"]]
    assert not failed, f"{len(failed)} of {len(results)} cases failed:\n" + "\n".join(failed[:40])
    assert {r["kind"] for r in results} == set(_damage.KINDS) or CASES < len(_damage.KINDS)


def test_fuzz_build_damaged(sources, tmp_path):
    """`normexport build` of one damaged file of each kind (TensorRT for RTX builds on the CPU): a
    file normexport's checks refuse (io.read_checked: what rewrite refuses) is refused by build too,
    exit 2 in one line, before TensorRT sees it (TensorRT built engines from files with an unknown
    opset or domain); anything else is an engine (exit 0) or TensorRT's refusal in one line (exit 1);
    never a traceback, never a file left beside a failure."""
    from normexport import trt
    from normexport.errors import UsageError
    from normexport.io import read_checked

    ok, why = trt.can_build()
    if not ok:
        pytest.skip(f"no TensorRT to build with: {why}")
    failed, seen = [], collections.Counter()
    for c in _damage.cases(sources, len(_damage.KINDS), SEED + 1):
        work = tmp_path / c.id
        what = _damage.damage(c, work / "in")
        out_dir = work / "out"
        out_dir.mkdir(parents=True)
        engine = out_dir / "model.engine"
        try:
            read_checked(work / "in" / "model.onnx")
            refused = False
        except UsageError:
            refused = True
        code, _, err = run_forked(["build", str(work / "in" / "model.onnx"), "-o", str(engine), "--no-plugin"], work,
                                  timeout=300)
        seen[(c.kind, code)] += 1
        lines = err.strip("\n").split("\n")
        bad = []
        if refused and code != 2:
            bad.append(f"normexport's checks refuse the file, build exits {code}")
        if code in (1, 2) and (len(lines) != 1 or not err.startswith("normexport: ")):
            bad.append(f"exit {code} but stderr is not one 'normexport: ' line: {err[:400]!r}")
        if code not in (0, 1, 2) or "Traceback" in err or "internal error" in err:
            bad.append(f"exit {code}: {err[-400:]!r}")
        left = sorted(p.name for p in out_dir.iterdir())
        if code != 0 and left:
            bad.append(f"left after a failure: {left}")
        if code == 0 and not engine.is_file():
            bad.append("exit 0 without an engine")
        if bad:
            failed.append(f"{c.id} ({what}): {'; '.join(bad)}")
    print("\n" + "\n".join(f"{k:18} exit {c}: {n}" for (k, c), n in sorted(seen.items())))
    assert not failed, "\n".join(failed)


def test_damage_is_deterministic(sources, tmp_path):
    for c in _damage.cases(sources, len(_damage.KINDS), SEED):
        a, b = tmp_path / "a" / c.id, tmp_path / "b" / c.id
        assert _damage.damage(c, a) == _damage.damage(c, b)
        assert (a / "model.onnx").read_bytes() == (b / "model.onnx").read_bytes()


@pytest.mark.parametrize("kind", ["truncate", "external_outside", "dangling_input"])
def test_subprocess_refusal_is_one_line(sources, tmp_path, kind):
    """The real process (python -m normexport): exit 2, one line, nothing written."""
    case = next(c for c in _damage.cases(sources, 64, SEED) if c.kind == kind)
    _damage.damage(case, tmp_path / "in")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    p = subprocess.run([sys.executable, "-m", "normexport", "rewrite", str(tmp_path / "in" / "model.onnx"), "-o",
                        str(out_dir / "x.onnx")], capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 2, p.stderr
    assert not problems(p.returncode, p.stderr, out_dir, out_dir / "x.onnx"), p.stderr


def test_layer_norms_sharing_a_weight_fuse_to_a_valid_file(sources, tmp_path):
    """Found by the fuzz (nan_weights on DiT): two LayerNorms reading one weight that is not all
    ones, and no bias, each fused into AdaLNZero with a zero bias made for it; the second zero bias
    took the first one's name and the file written read a value nothing defined."""
    import numpy as np
    from onnx import numpy_helper

    src = next(p for p in sources if p.parent.name == "dit" and p.name == "plain.onnx")
    m = onnx.load(str(src))
    readers = collections.Counter(n.input[1] for n in m.graph.node
                                  if n.op_type == "LayerNormalization" and (len(n.input) < 3 or not n.input[2]))
    shared = [name for name, k in readers.items() if k >= 2]
    assert shared, readers
    for t in m.graph.initializer:
        if t.name == shared[0]:
            a = np.linspace(0.5, 1.5, int(np.prod(t.dims)), dtype=np.float32).reshape(list(t.dims))
            t.CopyFrom(numpy_helper.from_array(a, t.name))
    (tmp_path / "in").mkdir()
    onnx.save(m, str(tmp_path / "in" / "model.onnx"))
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    code, so, err = run_forked(["rewrite", str(tmp_path / "in" / "model.onnx"), "-o", str(out)], tmp_path)
    assert code == 0, (so, err)
    onnx.checker.check_model(str(out), full_check=True)
    fused = onnx.load(str(out))
    assert sum(n.op_type in ("AdaLNZero", "GatedAdaLNZero") for n in fused.graph.node) >= 2
    assert len([t for t in fused.graph.initializer if t.name.startswith(shared[0] + "__zero_bias")]) >= 2


@pytest.mark.parametrize("kind,said", [
    ("dangling_input", "which no node, graph input or initializer produces"),
    ("cycle", "the graph has a cycle through node"),
    ("duplicate_name", ("is produced twice", "which is also a graph input or initializer")),
    ("no_outputs", "the graph has no outputs"),
    ("opset_99", "is not a version onnx"),
    ("external_outside", "outside the model's folder"),
    ("external_missing", ("not found beside the model", "is shorter than its tensors need")),
    ("init_dims", "onnx.checker refuses it"),
])
def test_each_damage_has_its_own_message(sources, tmp_path, kind, said):
    """The refusal names the damage (normexport.validate), not only "damaged"."""
    src = next(p for p in sources if p.parent.name == "conv_bn")
    for seed in range(4):
        work = tmp_path / str(seed)
        _damage.damage(_damage.Case(src, kind, seed), work / "in")
        (work / "out").mkdir()
        code, _, err = run_forked(["rewrite", str(work / "in" / "model.onnx"), "-o", str(work / "out" / "o.onnx")], work)
        assert code == 2 and not problems(code, err, work / "out", work / "out" / "o.onnx"), err
        assert any(s in err for s in ((said,) if isinstance(said, str) else said)), err


def test_a_dim_of_minus_one_is_dynamic(sources, tmp_path):
    """Found by the fuzz (zero_dim on norm_heavy): a graph input dim of -1 (how Paddle2ONNX writes a
    dynamic dim; onnxruntime reads it so) was taken as the size -1 by the rules and the local
    verifier, every fusion failed verification and rewrite exited 1 with nothing written."""
    src = next(p for p in sources if p.parent.name == "norm_heavy")
    m = onnx.load(str(src))
    d = next(v for v in m.graph.input if v.name == "r").type.tensor_type.shape.dim[0]  # the residual's batch
    d.Clear()
    d.dim_value = -1
    (tmp_path / "in").mkdir()
    onnx.save(m, str(tmp_path / "in" / "model.onnx"))
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    code, so, err = run_forked(["rewrite", str(tmp_path / "in" / "model.onnx"), "-o", str(out)], tmp_path)
    assert code == 0, (so, err)
    assert "0 fusion(s)" not in so and "failed local verification" not in so, so
    onnx.checker.check_model(str(out), full_check=True)
