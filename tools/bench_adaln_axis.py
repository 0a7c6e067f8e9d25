#!/usr/bin/env python3
"""AdaLNZero / GatedAdaLNZero with modulation_axis=1 (x [S, B, H], modulation [B, H]) against the
same op batch-first (x [B, S, H], modulation_axis 0) on the same bytes, and a device copy of x.

The *ModAxis kernels compute the modulation row as (row / inner) % B; this run shows what that costs
next to the default kernels on the same GPU, in the same run. Prints a table and writes
<out-dir>/adaln_axis_<date>_<device>.json.

    python tools/bench_adaln_axis.py --lib build/plugins/libnormexport_kernels.so [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import DTYPE_CODE, time_fn  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_adaln_axis: no CUDA GPU; nothing to measure", file=sys.stderr)
        return 2
    so = ctypes.CDLL(args.lib)
    i64, p, f32, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    so.normexport_adaln_zero.argtypes = [p, p, p, p, p, p, i64, i64, i64, c_int, c_int, f32, p]
    so.normexport_adaln_zero_axis.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, c_int, f32, p]
    so.normexport_gated_adaln_zero.argtypes = [p, p, p, p, p, p, p, p, p, i64, i64, i64, c_int, c_int, f32, p]
    so.normexport_gated_adaln_zero_axis.argtypes = [p, p, p, p, p, p, p, p, p, i64, i64, i64, i64, c_int, f32, p]
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    rows = []
    for dtype_name in ("bfloat16", "float16", "float32"):
        dtype = getattr(torch, dtype_name)
        code = DTYPE_CODE[dtype_name]
        for seq, batch, hidden in ((4096, 4, 3072), (1024, 16, 1152), (4096, 2, 4096)):
            x = torch.randn(seq * batch * hidden, device="cuda").to(dtype)
            upd, y, tot = torch.randn_like(x), torch.empty_like(x), torch.empty_like(x)
            gate, shift, scale = (torch.randn(batch, hidden, device="cuda").to(dtype) for _ in range(3))
            w = torch.randn(hidden, device="cuda").to(dtype)
            bcopy = torch.empty_like(x)
            ms = {
                "copy": time_fn(torch, lambda: bcopy.copy_(x), args.iters, 10, flush),
                "adaln_batch_first": time_fn(torch, lambda: so.normexport_adaln_zero(
                    ptr(x), ptr(shift), ptr(scale), ptr(w), None, ptr(y), batch, seq, hidden, 0, code, 1e-6, stream),
                    args.iters, 10, flush),
                "adaln_axis1": time_fn(torch, lambda: so.normexport_adaln_zero_axis(
                    ptr(x), ptr(shift), ptr(scale), ptr(w), None, ptr(y), seq, batch, 1, hidden, code, 1e-6, stream),
                    args.iters, 10, flush),
                "gated_batch_first": time_fn(torch, lambda: so.normexport_gated_adaln_zero(
                    ptr(x), ptr(upd), ptr(gate), ptr(shift), ptr(scale), ptr(w), None, ptr(y), ptr(tot), batch, seq,
                    hidden, 0, code, 1e-6, stream), args.iters, 10, flush),
                "gated_axis1": time_fn(torch, lambda: so.normexport_gated_adaln_zero_axis(
                    ptr(x), ptr(upd), ptr(gate), ptr(shift), ptr(scale), ptr(w), None, ptr(y), ptr(tot), seq, batch,
                    1, hidden, code, 1e-6, stream), args.iters, 10, flush),
            }
            nbytes = x.numel() * x.element_size()
            row = {"dtype": dtype_name, "seq": seq, "batch": batch, "hidden": hidden, "ms": ms,
                   "copy_GBps": 2 * nbytes / ms["copy"] / 1e6,
                   "adaln_axis_vs_batch_first": ms["adaln_axis1"] / ms["adaln_batch_first"],
                   "gated_axis_vs_batch_first": ms["gated_axis1"] / ms["gated_batch_first"],
                   "adaln_axis_pct_copy": 100 * 2 * nbytes / ms["adaln_axis1"] / 1e6 / (2 * nbytes / ms["copy"] / 1e6),
                   "gated_axis_pct_copy": 100 * (4 * nbytes / ms["gated_axis1"]) / (2 * nbytes / ms["copy"])}
            rows.append(row)
            print(f"{dtype_name:9s} S={seq:5d} B={batch:2d} H={hidden:5d}  "
                  + "  ".join(f"{k} {v * 1000:7.1f}us" for k, v in ms.items())
                  + f"  axis/batch-first adaln {row['adaln_axis_vs_batch_first']:.3f} gated "
                  f"{row['gated_axis_vs_batch_first']:.3f}  % of copy adaln {row['adaln_axis_pct_copy']:.0f} "
                  f"gated {row['gated_axis_pct_copy']:.0f}", flush=True)
    name = torch.cuda.get_device_name(0)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    out = Path(args.out_dir) / f"adaln_axis_{dt.date.today()}_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
