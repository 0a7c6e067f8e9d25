"""Decode speed of an LLM exported with its KV cache, side by side (issue 23, item 5).

One TinyLlama-1.1B-shaped float32 folder (random weights, a word-level tokenizer added because
onnxruntime-genai's builder needs one), exported three ways, each in its own process (wall time
and peak RSS from /usr/bin/time -v):

  normexport   python -m normexport convert DIR --target ort --no-check
  normexport-decomposed   the same with --no-fuse attention (the decomposed attention, projections unpacked)
  optimum      optimum-cli export onnx --model DIR --task text-generation-with-past  (optimum-onnx)
  genai        python -m onnxruntime_genai.models.builder -i DIR -o OUT -p fp32 -e cpu

then each file in onnxruntime CPU (its own process, default session options) by one loop: prefill
of --prefill tokens (batch 1, empty past), then --decode greedy steps with the cache fed back;
prefill latency is the median of 3 runs, decode tokens/s over the decode steps. With --repeat N
the speed runs go N rounds, the files alternating within each round, in reverse order every other
round (A B, B A, ...: a change of machine load hits every file alike, and no file always runs first); the table gives each file's median and the JSON every round. With
--export-repeat N the exports go N rounds the same way (each into a new folder, the folder's
weights read into the page cache first); the export time is each exporter's median, its ratio
to genai's builder printed, every run in the JSON. The anchor: this machine's read bandwidth (every core) over the bytes of
weights a decode step reads (all but the input embedding table), the tokens/s the memory allows. optimum-onnx and
onnxruntime-genai are installed with `pip install --target` into --work (never into the project's
environment: optimum pins other transformers versions); an exporter that fails is a row with its
error. Timings on a shared machine are noisy: the load average is printed before and after.

    python tools/bench_llm.py --work /tmp/bench_llm [--preset tinyllama|tiny] [--only normexport,genai]
        [--repeat 3] [--export-repeat 3] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PRESETS = {
    # TinyLlama-1.1B: 22 layers, hidden 2048, 32 heads, 4 KV heads, MLP 5632, vocab 32000 (4.4 GB in float32)
    "tinyllama": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256),
}
EXPORTERS = ("normexport", "normexport-decomposed", "optimum", "genai")
#: --before DIR: a folder holding another revision's `normexport` package (e.g. `git archive REV normexport | tar -x
#: -C DIR`), exported as "normexport-before" with the same command (before / after a change, in one run)
BEFORE: list = []

def make_folder(preset: str, out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.LlamaConfig(**PRESETS[preset], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, cfg.vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(out)
    return out


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "?"
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return m.group(1).strip() if m else "?"


def read_bandwidth(nbytes: int = 1 << 30, repeat: int = 7) -> float:
    """Memory read bandwidth in GB/s, every core reading (torch sum of a float32 tensor of `nbytes`,
    median of `repeat`): the anchor of decode speed at batch 1, which reads every weight once per token."""
    import torch

    x = torch.ones(nbytes // 4)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return nbytes / sorted(times)[repeat // 2] / 1e9


SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def decode_bytes(folder: Path) -> int:
    """Bytes of weights one decode step reads: all but the input embedding table, of which it reads
    one row (unless the table is tied to the output layer, which reads all of it)."""
    from safetensors import safe_open

    total = embed = 0
    names = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "np") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                n = int(np.prod(sl.get_shape())) * SAFETENSORS_BYTES[sl.get_dtype()]
                total += n
                names.add(k)
                if "embed_tokens" in k:
                    embed += n
    tied = not any(k.startswith("lm_head") for k in names)
    return total if tied else total - embed


def _memory_cgroup(limit_gib: float | None) -> Path | None:
    """A new cgroup-v1 memory group below this process's own (root only), its limit `limit_gib`
    (memory.limit_in_bytes: page cache is reclaimed under it, anonymous memory is not: no swap);
    None where cgroups cannot be made here."""
    try:
        rel = next(ln.split(":", 2)[2] for ln in Path("/proc/self/cgroup").read_text().splitlines()
                   if ln.split(":", 2)[1] == "memory")
        cg = Path("/sys/fs/cgroup/memory") / rel.lstrip("/") / f"bench_llm_{os.getpid()}_{time.monotonic_ns()}"
        cg.mkdir()
    except (OSError, StopIteration, IndexError):
        return None
    if limit_gib:
        (cg / "memory.limit_in_bytes").write_text(str(int(limit_gib * 2**30)))
    return cg


def _anon_bytes(cg: Path | None, pid: int) -> int:
    """Anonymous memory now: the cgroup's total_rss (pages charged once, a forked writer's shared pages
    not counted twice), else the RssAnon of `pid` and its children."""
    if cg is not None:
        for ln in (cg / "memory.stat").read_text().splitlines():
            if ln.startswith("total_rss "):
                return int(ln.split()[1])
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(re.search(r"RssAnon:\s+(\d+) kB", status).group(1)) * 1024
            for t in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (t / "children").read_text().split()]
        except (OSError, AttributeError):
            pass
    return total


def timed(cmd: list[str], env: dict | None = None, log: Path | None = None, memory_limit_gib: float | None = None,
          cwd: Path | None = None) -> dict:
    """Run `cmd` under /usr/bin/time -v in a memory cgroup of its own where one can be made: wall
    seconds, peak RSS GiB (time -v: the largest process, page cache of mapped files included),
    peak anonymous GiB (sampled every 50 ms: the cgroup's total_rss, else RssAnon over the process
    tree), the cgroup's peak usage (page cache included), exit code, last error line.
    `memory_limit_gib`: the cgroup's limit (does the command complete inside it?)."""
    cg = _memory_cgroup(memory_limit_gib)
    if memory_limit_gib and cg is None:
        raise SystemExit("--memory-limit needs a cgroup-v1 memory hierarchy writable here (root)")
    pre = ["sh", "-c", f'echo $$ > {cg / "cgroup.procs"} && exec "$@"', "sh"] if cg is not None else []
    t = time.monotonic()
    proc = subprocess.Popen([*pre, "/usr/bin/time", "-v", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=cwd)
    import threading

    anon = [0]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.05):
            anon[0] = max(anon[0], _anon_bytes(cg, proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    wall = time.monotonic() - t
    stop.set()
    sampler.join()
    cg_peak = oom = None
    if cg is not None:
        cg_peak = int((cg / "memory.max_usage_in_bytes").read_text())
        oom = int((cg / "memory.failcnt").read_text())
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    p = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    status = re.search(r"Exit status: (\d+)", p.stderr)
    rc = int(status.group(1)) if status else p.returncode
    killed = re.search(r"Command terminated by signal (\d+)", p.stderr)
    if log:
        log.write_text(p.stdout + "\n----\n" + p.stderr)
    err = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip() and "\t" not in ln and "Command" not in ln]
    cpu = [float(m) for m in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", p.stderr)]
    return {"seconds": round(wall, 1), "cpu_s": round(sum(cpu), 1) if cpu else None, "peak_rss_gib": round(int(rss.group(1)) / 2**20, 2) if rss else None,
            "peak_anon_gib": round(anon[0] / 2**30, 2),
            "anon_measured_by": "cgroup-v1 memory.stat total_rss" if cg is not None else "RssAnon over the tree",
            "cgroup_peak_gib": round(cg_peak / 2**30, 2) if cg_peak is not None else None,
            "memory_limit_gib": memory_limit_gib, "cgroup_failcnt": oom,
            "rc": (128 + int(killed.group(1))) if killed else rc,
            "error": None if (rc == 0 and not killed) else
            (f"killed by signal {killed.group(1)}" if killed else (err[-1][:300] if err else "?"))}


def pip_target(package: str, target: Path) -> Path:
    """`pip install --target` (its own folder: the project's environment is left as it is)."""
    if not target.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target), "--no-deps",
                        *package.split()], check=True)
    return target


def warm_cache(folder: Path) -> None:
    """Read the folder's files once, so each export finds them in the page cache."""
    for f in folder.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass


#: --quantize int4: both sides quantize with the same options (onnxruntime-genai's builder's CPU defaults)
INT4 = {"block_size": 32, "symmetric": True, "accuracy_level": 4}


def export(name: str, folder: Path, work: Path, quantize: str | None = None,
           memory_limit_gib: float | None = None) -> tuple[dict, Path | None]:
    out = work / name
    out.mkdir(exist_ok=True)
    env = dict(os.environ)
    if name == "normexport-before":  # the package of another revision (--before DIR), the same command
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BEFORE[0]), env.get("PYTHONPATH")) if p)
    if name in ("normexport", "normexport-decomposed", "normexport-before"):
        onnx_path = out / "model.onnx"
        cmd = [sys.executable, "-m", "normexport", "convert", str(folder), "-o", str(onnx_path), "--target", "ort",
               "--no-check", *(["--no-fuse", "attention"] if name == "normexport-decomposed" else []),
               *(["--quantize", "int4", "--block-size", str(INT4["block_size"]), "--accuracy-level",
                  str(INT4["accuracy_level"])] if quantize else [])]
    elif name == "optimum":
        # optimum-onnx 0.1.0 needs transformers < 4.58 (the project runs 5.x) and optimum ~= 2.1.0 (2.3 imports
        # huggingface_hub.resolve_revision, which the hub that transformers 4.57 takes lacks): those, in their own folders, first
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (
            pip_target("transformers==4.57.3 huggingface_hub==0.36.0 tokenizers==0.22.1", work / "pkgs_transformers4"),
            # optimum imports diffusers where one is installed: the project's needs the newer hub
            pip_target("diffusers==0.35.2", work / "pkgs_diffusers035"),
            pip_target("optimum-onnx", work / "pkgs_optimum"), pip_target("optimum==2.1.0", work / "pkgs_optimum_core")))
        onnx_path = out / "model.onnx"
        cmd = [sys.executable, "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", str(folder),
               "--task", "text-generation-with-past", str(out)]
    else:
        import importlib.util

        if importlib.util.find_spec("onnxruntime_genai") is None:  # the environment's own where it has one
            env["PYTHONPATH"] = str(pip_target("onnxruntime-genai", work / "pkgs_genai"))
        onnx_path = out / "model.onnx"
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(folder), "-o", str(out),
               "-p", "int4" if quantize else "fp32", "-e", "cpu", "-c", str(work / "genai_cache")]
        if quantize:
            cmd += ["--extra_options", f"block_size={INT4['block_size']}", f"is_symmetric={str(INT4['symmetric']).lower()}",
                    f"accuracy_level={INT4['accuracy_level']}"]
    row = timed(cmd, env, log=work / f"{name}.export.log", memory_limit_gib=memory_limit_gib,
                cwd=BEFORE[0] if name == "normexport-before" else None)  # (python -m puts the cwd's package first)
    if row["rc"] == 0 and onnx_path.exists():
        import onnx

        graph = onnx.load(str(onnx_path), load_external_data=False).graph
        row["nodes"] = len(graph.node)
        row["group_query_attention"] = sum(n.op_type == "GroupQueryAttention" for n in graph.node)
        row["matmul_nbits"] = sum(n.op_type == "MatMulNBits" for n in graph.node)
        row["file_bytes"] = sum(p.stat().st_size for p in out.iterdir() if p.name.startswith("model.onnx"))
    return row, (onnx_path if row["rc"] == 0 and onnx_path.exists() else None)


SPEED = r'''
import json, sys, time
import numpy as np, onnxruntime as ort
path, prefill, decode, kv_heads, head_dim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
so = ort.SessionOptions()
sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
ins = {i.name: i for i in sess.get_inputs()}
outs = [o.name for o in sess.get_outputs()]
def dt(t): return np.float16 if "float16" in t else np.float32
def empty(batch):
    past = {}
    for n, i in ins.items():
        if n.startswith("past_key_values"):
            h = i.shape[1] if isinstance(i.shape[1], int) else kv_heads
            d = i.shape[3] if isinstance(i.shape[3], int) else head_dim
            past[n] = np.zeros((batch, h, 0, d), dt(i.type))
    return past
def step(ids, n, past):
    s = ids.shape[1]
    f = {"input_ids": ids, "attention_mask": np.ones((1, n + s), np.int64)}
    if "position_ids" in ins:
        f["position_ids"] = np.arange(n, n + s, dtype=np.int64)[None]
    f.update(past)
    f = {k: v for k, v in f.items() if k in ins}
    r = sess.run(None, f)
    new = {}
    for name, v in zip(outs[1:], r[1:]):
        new[name.replace("present", "past_key_values")] = v
    return r[0], new
rng = np.random.default_rng(0)
ids = rng.integers(4, 500, (1, prefill)).astype(np.int64)
times = []
for _ in range(3):
    t = time.perf_counter(); logits, past = step(ids, 0, empty(1)); times.append(time.perf_counter() - t)
nxt = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
n = prefill
t = time.perf_counter()
for _ in range(decode):
    logits, past = step(nxt, n, past)
    nxt = logits[:, -1].argmax(-1)[:, None].astype(np.int64); n += 1
d = time.perf_counter() - t
print(json.dumps({"prefill_ms": round(1000 * sorted(times)[1], 1), "decode_tokens_per_s": round(decode / d, 2)}))
'''


AGREEMENT = r'''
import json, sys
import torch, transformers
from normexport.llm import CacheLM
from normexport.quantize import verdict
folder, files = sys.argv[1], json.loads(sys.argv[2])
lm = CacheLM(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
prompt, path, eager = verdict.eager_path(lm)
empty = list(lm.layout.empty(1, 0, dtype=torch.float32))
out = {name: verdict.agreement(f, name, prompt, path, eager, empty, checked=name.startswith("normexport")).to_dict()
       for name, f in files.items()}
print(json.dumps(out))
'''


def agreement(folder: Path, paths: dict, work: Path) -> dict:
    """normexport.quantize.verdict's numbers (teacher-forced top-1, logit cosine, greedy tokens against
    eager fp32, one prompt) for every file, in one child process."""
    script = work / "agreement.py"
    script.write_text(AGREEMENT)
    p = subprocess.run([sys.executable, str(script), str(folder), json.dumps({k: str(v) for k, v in paths.items()})],
                       capture_output=True, text=True)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def speed(onnx_path: Path, prefill: int, decode: int, work: Path, preset: str) -> dict:
    script = work / "speed.py"
    script.write_text(SPEED)
    cfg = PRESETS[preset]
    p = subprocess.run([sys.executable, str(script), str(onnx_path), str(prefill), str(decode),
                        str(cfg["num_key_value_heads"]), str(cfg["hidden_size"] // cfg["num_attention_heads"])],
                       capture_output=True, text=True)
    if p.returncode != 0:
        return {"speed_error": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _abba(items: list, k: int) -> list:
    """Round k's order: as given in even rounds, reversed in odd ones (A B, B A, A B, ...), so that
    no file always runs first after an export or after the other's run (the page cache and the
    memory just freed favour one place in a round: the same two files swapped 1st / 2nd place in
    their decode speed between rounds on the 2-vCPU VM)."""
    return items if k % 2 == 0 else items[::-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--preset", choices=PRESETS, default="tinyllama")
    ap.add_argument("--only", default=",".join(EXPORTERS))
    ap.add_argument("--prefill", type=int, default=16)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=1, help="speed rounds, files alternating (median reported)")
    ap.add_argument("--export-repeat", type=int, default=1,
                    help="export rounds, exporters alternating (median export time reported, every run kept)")
    ap.add_argument("--quantize", choices=("int4",), default=None,
                    help="int4: normexport convert --quantize int4 beside genai's builder -p int4, same block size, "
                         "symmetry and accuracy level; their agreement with eager fp32 beside each other")
    ap.add_argument("--memory-limit", type=float, default=None, metavar="GIB",
                    help="each export in a cgroup of this limit (does it complete inside it?); root, cgroup v1")
    ap.add_argument("--before", type=Path, default=None, metavar="DIR",
                    help="a folder with another revision's normexport package: exporter 'normexport-before'")
    ap.add_argument("--no-speed", action="store_true", help="exports only (no decode speed rounds)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.before is not None:
        BEFORE[:] = [args.before.resolve()]
    load = load_before = os.getloadavg()
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (shared: noisy)")
    folder = make_folder(args.preset, args.work / f"{args.preset}_fp32")
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"folder {folder}: {weights / 2**30:.2f} GiB of float32 weights")
    rows, paths = [], {}
    names = args.only.split(",")
    for k in range(max(1, args.export_repeat)):  # export rounds, exporters alternating (a shared VM drifts)
        for i, name in _abba(list(enumerate(names)), k):
            shutil.rmtree(args.work / name, ignore_errors=True)  # each export writes a new folder
            warm_cache(folder)  # every exporter starts with the folder in the page cache (the first one paid the disk read)
            row, path = export(name, folder, args.work, args.quantize, args.memory_limit)
            row["exporter"] = name
            print(f"export round {k + 1}: {json.dumps(row)}", flush=True)
            if k == 0:
                rows.append(row)
            runs = rows[i].setdefault("export_runs", [])
            runs.append(row["seconds"])
            rows[i]["seconds"] = sorted(runs)[len(runs) // 2]
            rows[i].setdefault("export_runs_memory", []).append(
                {k: row[k] for k in ("seconds", "cpu_s", "peak_rss_gib", "peak_anon_gib", "cgroup_peak_gib", "rc")})
            for key in ("peak_rss_gib", "peak_anon_gib", "cgroup_peak_gib"):  # the largest over the rounds
                vals = [m[key] for m in rows[i]["export_runs_memory"] if m[key] is not None]
                rows[i][key] = max(vals) if vals else None
            if row["rc"] != 0:
                rows[i].update(rc=row["rc"], error=row["error"])
            if path is not None and rows[i]["rc"] == 0:
                paths[name] = path
    for k in range(0 if args.no_speed else max(1, args.repeat)):  # speed rounds after every export, files alternating
        for row in _abba(rows, k):
            if row["exporter"] in paths:
                got = speed(paths[row["exporter"]], args.prefill, args.decode, args.work, args.preset)
                row.setdefault("rounds", []).append(got)
                print(f"round {k + 1}: {row['exporter']} {json.dumps(got)}", flush=True)
    for row in rows:
        ok = [r for r in row.get("rounds", []) if "speed_error" not in r]
        if ok:
            for key in ("prefill_ms", "decode_tokens_per_s"):
                row[key] = sorted(r[key] for r in ok)[len(ok) // 2]
        elif row.get("rounds"):
            row["speed_error"] = row["rounds"][0]["speed_error"]
    agreed = agreement(folder, paths, args.work) if args.quantize else {}
    for row in rows:
        if row["exporter"] in agreed:
            row["agreement"] = agreed[row["exporter"]]
    bw, per_token = (1.0 if args.no_speed else read_bandwidth()), decode_bytes(folder)
    limit = bw * 1e9 / per_token
    print(f"read bandwidth {bw:.1f} GB/s (every core); a decode step reads {per_token / 1e9:.2f} GB of weights: "
          f"at most {limit:.2f} tokens/s")
    load = os.getloadavg()
    print(f"\n{'exporter':<22} {'nodes':>6} {'GQA':>4} {'export s':>9} {'peak RSS GiB':>13} {'x weights':>9} {'anon GiB':>9} {'cgroup GiB':>10} {'prefill ms':>11} "
          f"{'decode tok/s':>13} {'x limit':>8}  (prefill {args.prefill} tokens, batch 1; decode {args.decode} steps; "
          f"median of {max(1, args.repeat)} round(s))")
    for r in rows:
        x = f"{r['peak_rss_gib'] * 2**30 / weights:.2f}" if r.get("peak_rss_gib") else "-"
        print(f"{r['exporter']:<22} {r.get('nodes', '-'):>6} {r.get('group_query_attention', '-'):>4} {r['seconds']:>9} {r.get('peak_rss_gib') or '-':>13} {x:>9} "
              f"{r.get('peak_anon_gib') or '-':>9} {r.get('cgroup_peak_gib') or '-':>10} {r.get('prefill_ms', '-'):>11} {r.get('decode_tokens_per_s', '-'):>13} "
              f"{(format(r['decode_tokens_per_s'] / limit, '.2f') if r.get('decode_tokens_per_s') else '-'):>8}"
              + (f"  FAILED: {r['error']}" if r.get("error") else "")
              + (f"  SPEED FAILED: {r['speed_error']}" if r.get("speed_error") else ""))
    base = next((r for r in rows if r["exporter"] == "genai" and r["rc"] == 0), None)
    for r in rows:
        if base is not None and r is not base and r["rc"] == 0:
            r["export_vs_genai"] = round(r["seconds"] / base["seconds"], 2)
            print(f"{r['exporter']} export / genai's builder: {r['export_vs_genai']:.2f}x (median of "
                  f"{len(r['export_runs'])} run(s) each: {r['export_runs']} vs {base['export_runs']} s)")
    if args.quantize:
        print(f"\n{'exporter':<22} {'MatMulNBits':>11} {'file MiB':>9} {'top-1':>6} {'cos mean':>9} {'cos min':>8} {'greedy':>7}")
        for r in rows:
            a = r.get("agreement") or {}
            print(f"{r['exporter']:<22} {r.get('matmul_nbits', '-'):>11} "
                  f"{(format(r['file_bytes'] / 2**20, '.1f') if r.get('file_bytes') else '-'):>9} "
                  f"{a.get('top1', '-'):>6} {a.get('cosine_mean', '-'):>9} {a.get('cosine_min', '-'):>8} "
                  f"{str(a.get('greedy_equal', '-')) + '/' + str(a.get('steps', '-')):>7}" + (f"  {a['error']}" if a.get("error") else ""))
        if base is not None and base.get("file_bytes"):
            for r in rows:
                if r is not base and r.get("file_bytes"):
                    r["file_vs_genai"] = round(r["file_bytes"] / base["file_bytes"], 3)
                    print(f"{r['exporter']} file size / genai's: {r['file_vs_genai']:.3f}x")
    print(f"load average after: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "quantize": args.quantize, "int4": INT4 if args.quantize else None, "cpu": cpu_model(), "weights_bytes": weights, "prefill": args.prefill,
                                         "decode": args.decode, "repeat": args.repeat, "export_repeat": args.export_repeat, "cpus": os.cpu_count(),
                                         "read_gbps": round(bw, 1), "decode_bytes": per_token, "decode_limit_tokens_per_s": round(limit, 2), "load_before": list(load_before), "load_after": list(load),
                                         "page_cache": "the folder read once before each export", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
