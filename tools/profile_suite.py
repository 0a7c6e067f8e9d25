"""Where a whole test run's CPU goes (issue 47 item 1): a py-spy profile of `make test`, summed by phase
and by test file, with every process the run starts (xdist workers, CLI subprocesses, TensorRT build
workers) in it.

    pip install py-spy   # once, into the venv (not a dependency of the package)
    py-spy record -r 7 --subprocesses --nonblocking -f raw -o RUN.raw -- \
        .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests
    python tools/profile_suite.py RUN.raw --rate 7

py-spy samples only threads that are running (not idle ones), so the seconds are CPU seconds, not wall:
a 2-worker run on 2 cores has about twice as many as its wall time. Native code without Python frames
(nvcc, the sanitizer drivers) is not sampled. A sample is counted in the first phase its stack enters
(outermost first): a collection inside an export counts as the export's, one after it (gc_paused's exit) as
"gc.collect"; a test file is the innermost tests/test_*.py frame of the stack (subprocesses: none, shown by
their command line).
"""

from __future__ import annotations

import argparse
import collections
import re

#: (phase, substring of a frame "function (file:line)") tried outermost frame first
PHASES = [
    ("imports", "_find_and_load ("),
    ("torch.export trace", "torch/export/_trace.py"),
    ("torch.onnx decompositions", "_prepare_exported_program_for_export ("),
    ("torch.onnx translation", "_exported_program_to_onnx_program ("),
    ("onnxscript optimizer", "onnxscript/optimizer/"),
    ("onnxscript rewriter", "onnxscript/rewriter/"),
    ("TorchScript exporter", "torch/onnx/utils.py"),
    ("onnxruntime session", "_create_inference_session ("),
    ("TensorRT build", "build_in_process ("),
]
#: a frame of a gc.collect() call site (the innermost Python frame is the caller: C functions are not frames)
GC_CALL = re.compile(r"gc\.collect|collect_harder")


def _parse(line: str):
    stack, _, count = line.rstrip("\n").rpartition(" ")
    try:
        return stack.split(";"), int(count)
    except ValueError:  # a command line with a newline in it: the rest of that sample's line
        return None, 0


def _phase(frames: list[str], is_gc_site) -> str:
    for frame in frames:
        for label, needle in PHASES:
            if needle in frame:
                return label
    return "gc.collect" if frames and is_gc_site(frames[-1]) else "other"


def _test_file(frames: list[str]) -> str:
    for frame in reversed(frames):
        m = re.search(r"\((test_\w+\.py):\d+\)", frame)
        if m:
            return m.group(1)
    procs = [f for f in frames if f.startswith("process ")]
    return ("subprocess: " + procs[-1].split(":", 1)[1][:90]) if len(procs) > 2 else "(outside a test)"


def _gc_site_test():
    """frame -> whether its line calls gc.collect() (C functions are not frames: the caller's line is the innermost
    frame of a sample taken in a collection), read from the source once per distinct frame."""
    import functools
    import linecache

    @functools.cache
    def is_gc_site(frame: str) -> bool:
        m = re.search(r"\((.+):(\d+)\)$", frame)
        if not m:
            return False
        for root in ("", ".venv/lib/python3.11/site-packages/"):
            text = linecache.getline(root + m.group(1), int(m.group(2)))
            if text:
                return bool(GC_CALL.search(text))
        return False

    return is_gc_site


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", help="py-spy record -f raw output")
    ap.add_argument("--rate", type=float, default=7.0, help="py-spy's -r (samples per second)")
    ap.add_argument("--files", type=int, default=40, help="test files shown")
    args = ap.parse_args(argv)
    is_gc_site = _gc_site_test()
    by_phase: collections.Counter = collections.Counter()
    by_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(args.raw, errors="replace") as f:
        for line in f:
            frames, n = _parse(line)
            if not frames:
                continue
            phase = _phase(frames, is_gc_site)
            by_phase[phase] += n
            by_file[_test_file(frames)][phase] += n
    total = sum(by_phase.values())
    print(f"{total / args.rate:.0f} CPU s sampled ({total} samples at {args.rate:g}/s)\n")
    for label, n in by_phase.most_common():
        print(f"{n / args.rate:8.1f} s  {100 * n / total:5.1f} %  {label}")
    shown = ["torch.export trace", "torch.onnx decompositions", "onnxscript optimizer", "gc.collect", "imports"]
    print(f"\n{'CPU s':>8} " + " ".join(f"{s.split()[-1][:8]:>8}" for s in shown) + "  test file")
    for name, c in sorted(by_file.items(), key=lambda kv: -sum(kv[1].values()))[:args.files]:
        print(f"{sum(c.values()) / args.rate:8.1f} " + " ".join(f"{c[s] / args.rate:8.1f}" for s in shown) + f"  {name}")


if __name__ == "__main__":
    main()
