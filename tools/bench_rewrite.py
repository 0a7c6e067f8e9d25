"""Benchmark normexport.rewrite on stacked LLaMA-style decomposed graphs (not a test).

    python tools/bench_rewrite.py [--layers 12 48] [--hidden 256] [--repeat 3] [--ort-forms]

Builds N-layer stacks (legacy torch exporter, opset 14: manual RMSNorm written like HF
LlamaRMSNorm, attention projections, SiLU-gated MLP, residuals), times
normexport.rewrite(verify=True / False) and onnxscript.optimizer.optimize on the same graph,
prints a table with the ratio and the 48/12 growth, and writes
benchmarks/results/rewrite_<date>.json. --ort-forms also times onnxruntime CPU on the forms an
RMSNorm can take for target ort (decomposed, RMSNormalization at opset 23, ORT's
SimplifiedLayerNormalization) so rules/rms_norm.py can pick the fastest on evidence.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import statistics
import sys
import time
import warnings

import numpy as np
import onnx
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RMSNorm(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(h) * 0.1 + 1)

    def forward(self, x):
        dt = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dt)


class Block(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.n1, self.n2 = RMSNorm(h), RMSNorm(h)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(h, h, bias=False) for _ in range(4))
        self.gate, self.up = torch.nn.Linear(h, 2 * h, bias=False), torch.nn.Linear(h, 2 * h, bias=False)
        self.down = torch.nn.Linear(2 * h, h, bias=False)

    def forward(self, x):
        y = self.n1(x)
        a = torch.softmax(self.q(y) @ self.k(y).transpose(-1, -2) / 8.0, dim=-1) @ self.v(y)
        x = x + self.o(a)
        y = self.n2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(y)) * self.up(y))


class Stack(torch.nn.Module):
    def __init__(self, n, h):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block(h) for _ in range(n))
        self.norm = RMSNorm(h)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def build(n: int, h: int) -> onnx.ModelProto:
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Stack(n, h).eval(), (torch.randn(1, 16, h),), f, dynamo=False, opset_version=14,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "b", 1: "s"}})
    return onnx.load_from_string(f.getvalue())


def timed(fn, repeat):
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times), out


def bench_rewrite(layers, hidden, repeat):
    import onnxscript.optimizer

    import normexport.rewriter as rw

    rows = []
    for n in layers:
        model = build(n, hidden)
        t_v, med_v, (out, rep) = timed(lambda: (lambda r: (rw.rewrite(model, verify=True, report=r), r))(rw.RewriteReport()), repeat)
        t_nv, med_nv, _ = timed(lambda: rw.rewrite(model, verify=False), repeat)

        def opt():
            m = onnx.ModelProto()
            m.CopyFrom(model)
            return onnxscript.optimizer.optimize(m)

        t_o, med_o, _ = timed(opt, repeat)
        # norms fused: RMSNorm nodes and SkipRMSNorm ones (the residual Add fused in, target trt's default)
        fused = sum(1 for nd in out.graph.node if nd.op_type in ("RMSNorm", "SkipRMSNorm"))
        rows.append({"layers": n, "hidden": hidden, "nodes_before": len(model.graph.node),
                     "nodes_after": len(out.graph.node), "fused_rmsnorm": fused, "expected_rmsnorm": 2 * n + 1,
                     "rewrite_verify_s": t_v, "rewrite_verify_median_s": med_v,
                     "rewrite_noverify_s": t_nv, "rewrite_noverify_median_s": med_nv,
                     "onnxscript_optimize_s": t_o, "onnxscript_optimize_median_s": med_o,
                     "ratio_verify_vs_optimize": t_v / t_o, "ratio_noverify_vs_optimize": t_nv / t_o})
    return rows


def bench_ort_forms(shape=(4, 128, 1024), repeat=50):
    """onnxruntime CPU time of one RMSNorm in its possible forms (fp32)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    h = shape[-1]
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal(h).astype(np.float32) + 1, "w")
    x_vi = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y_vi = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))
    c = lambda name, v: numpy_helper.from_array(np.array(v, dtype=np.float32 if isinstance(v, float) else np.int64), name)  # noqa: E731
    decomposed = [helper.make_node("Pow", ["x", "two"], ["sq"]), helper.make_node("ReduceMean", ["sq", "ax"], ["ms"]),
                  helper.make_node("Add", ["ms", "eps"], ["v"]), helper.make_node("Sqrt", ["v"], ["r"]),
                  helper.make_node("Div", ["x", "r"], ["n"]), helper.make_node("Mul", ["n", "w"], ["y"])]
    inits = [w, c("two", 2.0), c("ax", [-1]), c("eps", 1e-6)]
    forms = {
        "decomposed (opset 18)": (decomposed, inits, 18),
        "decomposed (opset 23)": (decomposed, inits, 23),
        "RMSNormalization (opset 23)": ([helper.make_node("RMSNormalization", ["x", "w"], ["y"], axis=-1, epsilon=1e-6)], [w], 23),
        "SimplifiedLayerNormalization (ORT contrib, opset 18)": (
            [helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["y"], axis=-1, epsilon=1e-6)], [w], 18),
    }
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    results = {}
    for name, (nodes, inits_, opset) in forms.items():
        m = helper.make_model(helper.make_graph(nodes, "g", [x_vi], [y_vi], inits_),
                              opset_imports=[helper.make_opsetid("", opset)])
        m.ir_version = 10
        for level_name, level in (("ort_default_opt", ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
                                  ("ort_no_opt", ort.GraphOptimizationLevel.ORT_DISABLE_ALL)):
            so = ort.SessionOptions()
            so.graph_optimization_level = level
            so.log_severity_level = 3
            try:
                sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
            except Exception as e:  # noqa: BLE001
                results[f"{name} [{level_name}]"] = f"does not load: {str(e).splitlines()[0][:100]}"
                continue
            sess.run(None, {"x": x})
            ts = []
            for _ in range(repeat):
                t = time.perf_counter()
                sess.run(None, {"x": x})
                ts.append(time.perf_counter() - t)
            results[f"{name} [{level_name}]"] = {"median_ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3}
    return {"shape": list(shape), "forms": results}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[12, 48])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ort-forms", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import logging

    logging.disable(logging.WARNING)
    rows = bench_rewrite(args.layers, args.hidden, args.repeat)
    print(f"{'layers':>6} {'nodes':>6} {'fused':>9} {'rewrite+verify s':>17} {'rewrite s':>10} "
          f"{'optimize s':>11} {'verify/opt':>10} {'noverify/opt':>12}")
    for r in rows:
        print(f"{r['layers']:>6} {r['nodes_before']:>6} {r['fused_rmsnorm']:>4}/{r['expected_rmsnorm']:<4} "
              f"{r['rewrite_verify_s']:>17.3f} {r['rewrite_noverify_s']:>10.3f} {r['onnxscript_optimize_s']:>11.3f} "
              f"{r['ratio_verify_vs_optimize']:>10.2f} {r['ratio_noverify_vs_optimize']:>12.2f}")
    growth = {}
    by = {r["layers"]: r for r in rows}
    if 12 in by and 48 in by:
        for key in ("rewrite_verify_s", "rewrite_noverify_s", "onnxscript_optimize_s"):
            ratio = by[48][key] / by[12][key]
            growth[key] = {"ratio_48_over_12": ratio, "linear": ratio <= 4 * 1.5}
            print(f"48/12 {key}: {ratio:.2f} ({'~linear' if ratio <= 6 else 'super-linear'}; 4.0 = linear)")
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                    "processor": platform.processor()},
        "versions": {m: __import__(m).__version__ for m in ("onnx", "onnxruntime", "onnxscript", "torch")},
        "repeat": args.repeat, "rows": rows, "growth": growth,
        "note": "times are best of `repeat` wall seconds for one rewrite of the whole model",
    }
    if args.ort_forms:
        result["ort_rmsnorm_forms"] = [bench_ort_forms((4, 128, 1024), 200), bench_ort_forms((8, 512, 4096), 30)]
        for entry in result["ort_rmsnorm_forms"]:
            for k, v in entry["forms"].items():
                shown = v if isinstance(v, str) else "%.3f ms median" % v["median_ms"]
                print(f"ORT CPU {entry['shape']} {k}: {shown}")
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"rewrite_{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
