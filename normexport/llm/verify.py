"""The attention fusion's local check (normexport.llm.attention, item 5 of its docstring):
the fused file in onnxruntime on random feeds, a prefill (batch LOCAL_BATCH, empty past) and decode
steps (LOCAL_DECODE) with its own cache fed back: logits and every present.* within docs/design.md §7's
tolerance of the eager model's on the same feeds (a float32 model), else of the unfused file's.
Against eager, the unfused file runs only when the fused one fails, to say which is wrong.
Sessions are made by normexport.ortrun."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnx_ir as ir

from ..ortrun import inference_session

#: the local check's batch (rows of different tokens: each row's cache and seqlens_k its own)
LOCAL_BATCH = 2
#: the local check's decode steps after the prefill: every kind of step once, a decode over the prefill's
#: cache and one over a cache a decode step grew (each step is a pass over every weight in eager and in
#: onnxruntime, and again in the share-buffer check: a third decode repeated the second's kind and cost
#: 3.7 CPU s of a 1.1B LLaMA's convert on the 2-core VM)
LOCAL_DECODE = 2


def session(model: ir.Model, path: Path | None = None):
    """An onnxruntime session of `model`: from its file where given (any size; external data read
    from disk), else from the model serialised in memory."""
    source = str(path) if path is not None else ir.serde.serialize_model(model).SerializeToString()
    # log level 3: the fused file leaves position_ids unused, no warning for it; no MatMul weight
    # prepacking: the checks run a few steps, and prepacking a 4 GiB file's weights takes 6-7 s per
    # session (1.1B LLaMA, 2 cores; each run then ~0.4 s slower)
    return inference_session(source, log_level=3, prepacking=False)


def np_dtype(model: ir.Model):
    v = next(v for v in model.graph.inputs if v.name == "past_key_values.0.key")
    return np.float16 if v.dtype == ir.DataType.FLOAT16 else np.float32


def cache_dims(model: ir.Model) -> list[tuple[str, int, int]]:
    return [(v.name, v.shape[1], v.shape[3]) for v in model.graph.inputs if v.name.startswith("past_key_values.")]


def _vocab(model: ir.Model) -> int:
    emb = next((n for n in model.graph if n.op_type == "Gather" and n.inputs[1] is not None
                and n.inputs[1].name == "input_ids"), None)
    if emb is not None and emb.inputs[0] is not None and emb.inputs[0].shape is not None:
        return int(emb.inputs[0].shape[0])
    return 32


def run_steps(sess, names: Sequence[str], dims, dtype, ids_steps, batch: int):
    """Per step (logits, presents): prefill then decode, each step's presents fed back."""
    past = {n: np.zeros((batch, h, 0, d), dtype) for n, h, d in dims}
    outs, total = [], 0
    for ids in ids_steps:
        seq = ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((batch, total + seq), np.int64),
                 "position_ids": np.tile(np.arange(total, total + seq, dtype=np.int64), (batch, 1)), **past}
        res = sess.run(None, {n: feeds[n] for n in names})
        outs.append(res)
        out_names = [o.name for o in sess.get_outputs()]
        past = {n.replace("present", "past_key_values"): r for n, r in zip(out_names[1:], res[1:])}
        total += seq
    return outs


def local_feeds(model: ir.Model, batch: int = LOCAL_BATCH, prompt: int = 5, decode: int = LOCAL_DECODE,
                seed: int = 0) -> list[np.ndarray]:
    """The local check's input_ids per step: a random prompt of `prompt` tokens (`batch` rows),
    then `decode` single tokens."""
    rng = np.random.default_rng(seed)
    vocab = _vocab(model)
    steps = [rng.integers(0, vocab, (batch, prompt)).astype(np.int64)]
    return steps + [rng.integers(0, vocab, (batch, 1)).astype(np.int64) for _ in range(decode)]


def eager_ahead(unfused: ir.Model, reference, *, batch: int = LOCAL_BATCH, prompt: int = 5, decode: int = LOCAL_DECODE,
                seed: int = 0, one_thread=None) -> list | None:
    """`compare`'s eager outputs on the same feeds (`local_feeds` of `unfused`, same arguments),
    computed before its call (normexport.llm.attention: while the files it runs are still being
    written, when the process would only wait); None where they raise (compare then runs them
    again and reports why). `one_thread()`, asked before each step: True runs that step on one
    torch thread (attention.fuse: while the forked writer has the other core); torch's own count
    is restored after."""
    import torch

    before = torch.get_num_threads()

    def threads() -> None:
        want = 1 if one_thread is not None and one_thread() else before
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    try:
        return _eager_steps(reference, cache_dims(unfused), local_feeds(unfused, batch, prompt, decode, seed), batch,
                            each_step=threads)
    except Exception:  # noqa: BLE001  (compare's own run says why)
        return None
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


#: EagerForked.result's wait for its child before it is stopped and the steps run in this process instead
RESULT_TIMEOUT_S = 600.0


class EagerForked:
    """`eager_ahead` in a forked copy of this process (Linux; llm.files._fork_call), started now on one
    torch thread: it runs beside the caller's Python work (the fusion passes; from convert.prewrite, the
    norm rewrite before them) on the other core without sharing its GIL (in a thread, each of
    eager's ~2000 op calls waits for it: 1.1B LLaMA's 3 steps
    26.8 s beside a busy Python thread, 2.6 s alone); the weights are shared copy-on-write. Its outputs
    (the local check's small batch: logits and caches, a few MB) come back in a temp .npz file.
    `result()` waits; None where the child failed or there is no fork (compare then runs the steps here)."""

    def __init__(self, unfused: ir.Model, reference, *, batch: int = LOCAL_BATCH, prompt: int = 5,
                 decode: int = LOCAL_DECODE, seed: int = 0):
        import os
        import sys
        import tempfile
        import threading

        from .files import _fork_call, _wait_child

        self._thread = self._pid = self._path = None
        self._ok = False
        dims, feeds = cache_dims(unfused), local_feeds(unfused, batch, prompt, decode, seed)
        self.reference, self._dims, self._feeds = reference, dims, feeds
        if not sys.platform.startswith("linux"):
            return
        fd, path = tempfile.mkstemp(prefix="normexport-eager-", suffix=".npz")
        os.close(fd)

        def child() -> None:
            import torch

            torch.set_num_threads(1)
            outs = _eager_steps(reference, dims, feeds, batch)
            np.savez(path, **{f"{k}_{j}": a for k, step in enumerate(outs) for j, a in enumerate(step)},
                     shape=np.array([len(outs), len(outs[0])]))

        try:
            pid, err = _fork_call(child)
        except OSError:
            os.unlink(path)
            return
        self._pid, self._path = pid, path

        def wait() -> None:
            try:
                _wait_child(pid, err)
                self._ok = True
            except OSError:
                pass

        self._thread = threading.Thread(target=wait, name="normexport-eager-wait", daemon=True)
        self._thread.start()

    def serves(self, unfused: ir.Model, reference, *, batch: int = LOCAL_BATCH, prompt: int = 5,
               decode: int = LOCAL_DECODE, seed: int = 0) -> bool:
        """The steps started are `compare`'s for `unfused` (started earlier, from the file before the
        passes that keep its interface: convert.prewrite): the same eager model, cache and feeds."""
        feeds = local_feeds(unfused, batch, prompt, decode, seed)
        return (reference is self.reference and cache_dims(unfused) == self._dims and len(feeds) == len(self._feeds)
                and all(np.array_equal(a, b) for a, b in zip(feeds, self._feeds)))

    def result(self, timeout: float = RESULT_TIMEOUT_S) -> list | None:
        if self._thread is None:
            return None
        self._thread.join(timeout)
        if self._thread.is_alive():  # (a child that never ends: stopped, the steps run here)
            return self.stop()
        try:
            if not self._ok:
                return None
            with np.load(self._path, allow_pickle=False) as z:
                steps, outs = (int(x) for x in z["shape"])
                return [[z[f"{k}_{j}"] for j in range(outs)] for k in range(steps)]
        finally:
            self.stop()

    def stop(self) -> None:
        """The child stopped where it still runs (reaped by the waiting thread), its file removed. Returns None."""
        import os
        import signal

        if self._thread is not None and self._thread.is_alive() and self._pid is not None:
            try:
                os.kill(self._pid, signal.SIGKILL)
            except OSError:
                pass
            self._thread.join()
            self._ok = False
        if self._path is not None:
            try:
                os.unlink(self._path)
            except OSError:
                pass
            self._path = None
        return None


def compare(unfused: ir.Model, fused: ir.Model, *, batch: int = LOCAL_BATCH, prompt: int = 5, decode: int = LOCAL_DECODE,
            seed: int = 0, files: tuple[Path, Path] | None = None, keep: dict | None = None, reference=None,
            eager: list | None = None) -> dict:
    """The local check, on random prefill + decode feeds (`local_feeds`; each run's own cache fed
    back), every logits and present.* within docs/design.md §7's tolerance of the reference's:

    - with `reference` (the FlatCacheLM exported, float32): the fused file against eager. The
      unfused file runs only where that fails, against eager too, to say which is wrong: the
      fusion, or the file itself (`eager_failed`: e.g. its blocks grown from a shallow trace);
    - without: the fused file against the unfused one, both in onnxruntime.

    `files`: the two as written (unfused, fused), the sessions made from them (one at a time);
    `keep`: receives the fused file's session as "fused" and its run as "run" (feeds, outputs per
    step), for share_buffer_check. `eager`: `eager_ahead`'s outputs for `reference` on these feeds
    (the same arguments), made earlier; else they are computed here."""
    import torch

    try:
        dims, dtype = cache_dims(unfused), np_dtype(unfused)
        tdtype = torch.float16 if dtype == np.float16 else torch.float32
        steps = local_feeds(unfused, batch, prompt, decode, seed)

        def run(k: int):
            model = (unfused, fused)[k]
            sess = session(model, files[k] if files else None)
            names = [i.name for i in sess.get_inputs()]
            return sess, run_steps(sess, names, dims, dtype, steps, batch), [o.name for o in sess.get_outputs()]

        try:
            sess, got, names = run(1)
        except Exception as e:  # noqa: BLE001  (with eager: the decomposed file still checked below)
            if reference is None:
                raise
            got, names, failed = None, None, {"passed": False, "reason": why(e)}
        else:
            if keep is not None:
                keep["fused"], keep["run"] = sess, (steps, got)
            del sess
        if reference is not None:
            want = eager if eager is not None else _eager_steps(reference, dims, steps, batch)
            if got is not None:
                failed = _within(want, got, names, tdtype)
                if failed["passed"]:
                    return {**failed, "against": "eager", "batch": batch, "prompt": prompt, "decode_steps": decode}
            if keep is not None:  # the fused file failed: its session is not kept
                keep.clear()
            _, ref, ref_names = run(0)
            dec = _within(want, ref, ref_names, tdtype)
            if not dec["passed"]:
                return {**dec, "eager_failed": True, "reason": f"the decomposed file against eager, {dec['reason']}"}
            return {**failed, "reason": f"the fused file against eager (the decomposed file within tolerance, "
                                        f"max_abs_err {dec['max_abs_err']:.3g}), {failed['reason']}"}
        _, ref, ref_names = run(0)
    except Exception as e:  # noqa: BLE001
        return {"passed": False, "reason": why(e)}
    if names != ref_names:
        return {"passed": False, "reason": f"outputs differ: {names} vs {ref_names}"}
    out = _within([[r.astype(np.float64) for r in step] for step in ref], got, names, tdtype)
    return {**out, "against": "decomposed", "batch": batch, "prompt": prompt, "decode_steps": decode} \
        if out["passed"] else out


def why(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _within(want: list, got: list, names: Sequence[str], tdtype) -> dict:
    """Per step and output, `got` (onnxruntime's) within docs/design.md §7's tolerance of `want` (float64)."""
    from ..parity.tolerances import tolerance_for

    worst, compared = 0.0, 0
    for k, (w_step, g_step) in enumerate(zip(want, got, strict=True)):
        for name, w, g in zip(names, w_step, g_step, strict=True):
            if w.shape != g.shape:
                return {"passed": False, "reason": f"step {k} {name}: shape {list(g.shape)} != {list(w.shape)}"}
            err = float(np.abs(w - g.astype(np.float64)).max()) if w.size else 0.0
            tol = tolerance_for(tdtype, float(np.abs(w).max()) if w.size else 0.0)
            compared += 1
            worst = max(worst, err)
            if not err <= tol:  # NaN fails too
                return {"passed": False, "max_abs_err": err, "reason": f"step {k} ({'prefill' if k == 0 else 'decode'}) "
                        f"{name}: max_abs_err {err:.3g} > tolerance {tol:.3g}"}
    return {"passed": True, "outputs_compared": compared, "max_abs_err": worst}


def _eager_steps(lm, dims, steps, batch: int, each_step=None) -> list[list[np.ndarray]]:
    """Per step eager's outputs (logits, present.*; float64) of `lm` (a FlatCacheLM) on run_steps'
    feeds, its cache fed back; `each_step()` called before each step."""
    import torch

    past = [torch.zeros(batch, h, 0, d, dtype=lm.layout.dtype) for _, h, d in dims]
    outs, total = [], 0
    with torch.no_grad():
        for ids in steps:
            if each_step is not None:
                each_step()
            seq = ids.shape[1]
            res = lm(torch.from_numpy(ids), torch.ones(batch, total + seq, dtype=torch.long),
                     torch.arange(total, total + seq).expand(batch, seq).contiguous(), *past)
            outs.append([r.double().numpy() for r in res])
            past, total = list(res[1:]), total + seq
    return outs

