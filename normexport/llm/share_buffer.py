"""past_present_share_buffer (onnxruntime-genai's one buffer of max_length positions as past and
present): GroupQueryAttention writes the new positions at seqlens_k when its past and present share
a buffer; `share_buffer_check` runs the fused file that way (io binding, one OrtValue as past and
present, attention_mask of the buffer's length, zeros past the tokens) against the concatenating
run; where it agrees the attention fusion (normexport.llm.attention) sets the flag
`SHARE_BUFFER_KEY` in the model's metadata and `deploy` writes past_present_share_buffer true."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .verify import LOCAL_DECODE, cache_dims, local_feeds, np_dtype, run_steps, why
from .verify import session as _session

#: metadata_props key set on a fused file whose past / present can share one buffer (read by deploy)
SHARE_BUFFER_KEY = "normexport.past_present_share_buffer"


def share_buffer_check(fused: ir.Model, *, batch: int = 1, prompt: int = 4, decode: int = LOCAL_DECODE,
                       max_length: int = 16, session=None, reference=None) -> tuple[bool, str | None]:
    """(True, None) where the fused file run with one buffer of `max_length` positions as past and
    present (io binding, as onnxruntime-genai's past_present_share_buffer; attention_mask of
    `max_length`, ones over the tokens so far) gives the concatenating run's logits and cache.
    `reference`: a concatenating run of this file made already (compare's `keep["run"]`: feeds
    and outputs per step), its first `batch` rows the reference here (no second run); else the
    concatenating run is made here on random feeds."""
    import onnxruntime as ort

    try:
        dims, dtype = cache_dims(fused), np_dtype(fused)
        sess = session if session is not None else _session(fused)  # `session`: the fused file's, made already
        names = [i.name for i in sess.get_inputs()]
        outs = [o.name for o in sess.get_outputs()]
        if reference is not None:
            steps = [ids[:batch] for ids in reference[0]]
            ref = [[o[:batch] for o in step] for step in reference[1]]
        else:
            steps = local_feeds(fused, batch, prompt, decode, seed=1)
            ref = run_steps(sess, names, dims, dtype, steps, batch)
        max_length = max(max_length, sum(ids.shape[1] for ids in steps))
        buffers = {n: ort.OrtValue.ortvalue_from_numpy(np.zeros((batch, h, max_length, d), dtype)) for n, h, d in dims}
        total = 0
        for k, ids in enumerate(steps):
            seq = ids.shape[1]
            am = np.zeros((batch, max_length), np.int64)
            am[:, :total + seq] = 1
            feeds = {"input_ids": ids, "attention_mask": am,
                     "position_ids": np.tile(np.arange(total, total + seq, dtype=np.int64), (batch, 1))}
            io = sess.io_binding()
            for n in names:
                if n in buffers:
                    io.bind_ortvalue_input(n, buffers[n])
                else:
                    io.bind_cpu_input(n, feeds[n])
            io.bind_output(outs[0])
            for n in outs[1:]:
                io.bind_ortvalue_output(n, buffers[n.replace("present", "past_key_values")])
            sess.run_with_iobinding(io)
            logits = io.copy_outputs_to_cpu()[0]
            total += seq
            want = ref[k][0]
            if logits.shape != want.shape or float(np.abs(logits.astype(np.float64) - want).max()) > 1e-4 * max(1.0, float(np.abs(want).max())):
                return False, f"step {k}: the shared-buffer run's logits differ from the concatenating run's"
            for n, r in zip(outs[1:], ref[k][1:]):
                buf = buffers[n.replace("present", "past_key_values")].numpy()[:, :, :total]
                if buf.shape != r.shape or float(np.abs(buf.astype(np.float64) - r).max()) > 1e-4 * max(1.0, float(np.abs(r).max())):
                    return False, f"step {k}: {n} in the shared buffer differs from the concatenating run's"
        return True, None
    except Exception as e:  # noqa: BLE001
        return False, why(e)

