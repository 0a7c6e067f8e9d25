"""How fast the weights of an exported LLM are written, beside what this disk can do.

    python tools/bench_write.py [--layers 22] [--dir /tmp/bench_write] [--reps 2] [--json OUT.json]

A TinyLlama-1.1B-shaped set of float32 weights (22 layers: 4.4 GB; --layers to scale) built as the
exporter and llm.packing leave them: the embedding a contiguous torch parameter (onnx-ir TorchTensor),
o_proj / down_proj / lm_head transposed numpy views of torch parameters (the folded Transpose of
each Linear), q/k/v and gate/up packed by llm.packing (lazy np.concatenate of those views), the
norms' small vectors. Each way writes them to the same folder, in turn, `--reps` times:

  copy            the same bytes (every source parameter, C-contiguous) with f.write: this disk's
                  plain copy bandwidth, the anchor
  ir.save         onnx-ir's ir.save as normexport called it before (external data, 64 KiB alignment,
                  max_workers=2), nothing swapped
  save_ir         normexport.io.save_ir (ir.save inside io.streamed, atomic placement)
  workdir         normexport.llm.files.Workdir.write (the convert --target ort path), first write
  behind-thread   Workdir.write_behind with the thread (files._FORK off), waited for
  behind-fork     Workdir.write_behind in a forked process (convert's way where there is fork)

--busy runs a pure-Python loop in a thread during each write (what the fusion passes are to the
write behind them): a writer that needs the GIL often waits for it.

Times without and with the os.sync() that follows (no way fsyncs itself). The files of ir.save
and save_ir are compared byte for byte (same offsets, same bytes) and each save_ir tensor is
compared with its source through a memory map of the data file (--no-verify to skip).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"node": platform.node(), "cores": os.cpu_count(), "cpu": cpu, "ram_gib": round(ram, 1),
            "platform": platform.platform()}


def model(layers: int, hidden=2048, inter=5632, heads=32, kv_heads=4, vocab=32000, seed=0):
    """(ir.Model, sources): the weights as the exporter + packing leave them; sources are the
    torch parameters (C-contiguous) in the order their bytes are written."""
    import onnx_ir as ir
    import torch

    from onnx_ir.tensor_adapters import TorchTensor

    from normexport.llm import packing

    g = torch.Generator().manual_seed(seed)
    hd = hidden // heads

    def param(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    inits: list[ir.Value] = []
    sources = []

    def add(name, tensor):
        tensor.name = name
        inits.append(ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor))

    def linear_t(out_f, in_f):  # folded Transpose of a Linear weight: [in, out] view of [out, in]
        w = param(out_f, in_f)
        sources.append(w)
        return ir.Tensor(w.numpy().T)

    emb = torch.nn.Parameter(param(vocab, hidden), requires_grad=True)
    sources.append(emb.detach())
    add("model.embed_tokens.weight", TorchTensor(emb))
    for i in range(layers):
        p = f"model.layers.{i}"
        for n in ("input_layernorm", "post_attention_layernorm"):
            w = 1 + param(hidden)
            sources.append(w)
            add(f"{p}.{n}.weight", ir.Tensor(w.numpy()))
        qkv = [linear_t(heads * hd, hidden), linear_t(kv_heads * hd, hidden), linear_t(kv_heads * hd, hidden)]
        add(f"{p}.qkv_packed", packing._concat(qkv))
        add(f"{p}.o_proj", linear_t(hidden, heads * hd))
        add(f"{p}.gate_up_packed", packing._concat([linear_t(inter, hidden), linear_t(inter, hidden)]))
        add(f"{p}.down_proj", linear_t(hidden, inter))
    w = 1 + param(hidden)
    sources.append(w)
    add("model.norm.weight", ir.Tensor(w.numpy()))
    add("lm_head", linear_t(vocab, hidden))

    x = ir.Value(name="x", shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.FLOAT))
    y = ir.Value(name="y", shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.FLOAT))
    node = ir.Node("", "Identity", [x], outputs=[y])
    graph = ir.Graph([x], [y], nodes=[node], initializers=inits, opset_imports={"": 21}, name="weights")
    return ir.Model(graph, ir_version=10), sources


def expected(t) -> np.ndarray:
    """A tensor's bytes as a C-order array, computed independently of the writers."""
    import torch

    raw = getattr(t, "raw", None)
    if isinstance(raw, torch.Tensor):
        return raw.detach().contiguous().numpy()
    return np.ascontiguousarray(t.numpy())


def verify(m, path: Path) -> int:
    """Every external tensor of the written file equals its source; offsets of tensors over 1 MiB are
    64 KiB aligned. Returns the number of tensors compared."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    info = {t.name: {e.key: e.value for e in t.external_data} for t in proto.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL}
    srcs = {v.name: v.const_value for v in m.graph.initializers.values()}
    n = 0
    for name, e in info.items():
        off, length = int(e.get("offset", 0)), int(e["length"])
        if length > (1 << 20) and off % 65536:
            raise AssertionError(f"{name}: offset {off} not 64 KiB aligned")
        want = expected(srcs[name])
        got = np.memmap(path.parent / e["location"], dtype=np.uint8, mode="r", offset=off, shape=(length,))
        if length != want.nbytes or not np.array_equal(got, want.reshape(-1).view(np.uint8)):
            raise AssertionError(f"{name}: written bytes differ from the source")
        del got
        n += 1
    if n != sum(1 for t in srcs.values() if t.nbytes > 1024):
        raise AssertionError("not every weight was written outside")
    return n


def same_files(a: Path, b: Path, chunk=64 << 20) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True


class _Busy:
    """A thread looping in pure Python until stop()."""

    def __init__(self):
        import threading

        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop:
            sum(range(2000))

    def stop(self):
        self._stop = True
        self._thread.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--dir", default="/tmp/bench_write")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ways", default="copy,ir.save,save_ir,workdir")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--busy", action="store_true", help="a pure-Python thread runs during each write")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import onnx_ir as ir

    from normexport import io
    from normexport.llm.files import Workdir

    mach = machine()
    print(f"machine: {mach['node']}, {mach['cores']} cores, {mach['cpu']}, {mach['ram_gib']} GiB RAM; "
          f"writing to {args.dir}", flush=True)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    m, sources = model(args.layers)
    total = sum(s.numel() * s.element_size() for s in sources)
    print(f"weights: {total / 1e9:.2f} GB in {len(sources)} parameters, {len(m.graph.initializers)} initializers "
          f"(built in {time.perf_counter() - t0:.1f}s)", flush=True)

    def copy(d: Path):
        with open(d / "copy.bin", "wb") as f:
            for s in sources:
                f.write(memoryview(s.numpy()).cast("B"))
        return d / "copy.bin"

    def ir_save(d: Path):
        ir.save(m, d / "model.onnx", external_data="model.onnx.data", size_threshold_bytes=1024, alignment=65536,
                max_workers=2)
        return d / "model.onnx"

    def save_ir(d: Path):
        return io.save_ir(m, d / "model.onnx", external_data=True)

    def workdir(d: Path):
        wd = Workdir(d / "model.onnx")
        return wd.write(m, "decomposed.onnx")  # the temp folder goes with d

    def behind(fork: bool):
        from normexport.llm import files

        def way(d: Path):
            files._FORK = fork
            wd = Workdir(d / "model.onnx")
            return wd.write_behind(m, "decomposed.onnx").result()
        return way

    ways = {"copy": copy, "ir.save": ir_save, "save_ir": save_ir, "workdir": workdir,
            "behind-thread": behind(False), "behind-fork": behind(True)}
    chosen = [w for w in args.ways.split(",") if w]
    runs: dict[str, list[dict]] = {w: [] for w in chosen}
    checks = {}
    for rep in range(args.reps):
        for w in chosen:
            d = root / f"{w}.{rep}"
            d.mkdir()
            os.sync()
            load = os.getloadavg()[0]
            busy = _Busy() if args.busy else None
            t = time.perf_counter()
            out = ways[w](d)
            t_write = time.perf_counter() - t
            if busy is not None:
                busy.stop()
            os.sync()
            t_sync = time.perf_counter() - t
            r = {"write_s": round(t_write, 2), "write_sync_s": round(t_sync, 2),
                 "gb_s": round(total / 1e9 / t_write, 3), "gb_s_with_sync": round(total / 1e9 / t_sync, 3),
                 "load_average_before": round(load, 2)}
            runs[w].append(r)
            print(f"  rep {rep} {w:8s}: {t_write:6.2f}s = {r['gb_s']:.2f} GB/s; with sync {t_sync:6.2f}s = "
                  f"{r['gb_s_with_sync']:.2f} GB/s (load {load:.2f})", flush=True)
            if rep == 0 and not args.no_verify and w != "copy":
                checks[w] = f"{verify(m, out)} tensors equal to their sources, offsets over 1 MiB 64 KiB aligned"
                print(f"    verified: {checks[w]}", flush=True)
            if rep == 0 and w == "save_ir" and "ir.save" in chosen and not args.no_verify:
                a, b = root / "ir.save.0", d
                same = same_files(a / "model.onnx", b / "model.onnx") and same_files(
                    a / "model.onnx.data", b / "model.onnx.data")
                checks["save_ir == ir.save"] = "byte-identical .onnx and .data" if same else "DIFFER"
                print(f"    save_ir vs ir.save: {checks['save_ir == ir.save']}", flush=True)
                if not same:
                    return 1
            if not (rep == 0 and w == "ir.save"):
                shutil.rmtree(d)
                os.sync()
        if rep == 0:
            shutil.rmtree(root / "ir.save.0", ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)

    best = {w: max(r["gb_s"] for r in rs) for w, rs in runs.items()}
    best_sync = {w: max(r["gb_s_with_sync"] for r in rs) for w, rs in runs.items()}
    print("best GB/s (write / with sync):", ", ".join(f"{w} {best[w]:.2f} / {best_sync[w]:.2f}" for w in chosen))
    if args.json:
        import onnx_ir
        import torch

        res = {"tool": "tools/bench_write.py", "argv": sys.argv[1:], "machine": mach, "dir": str(root),
               "weights_gb": round(total / 1e9, 3), "layers": args.layers,
               "versions": {"onnx_ir": onnx_ir.__version__, "numpy": np.__version__, "torch": torch.__version__},
               "busy_python_thread": args.busy, "runs": runs, "best_gb_s": best, "best_gb_s_with_sync": best_sync, "checks": checks}
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
