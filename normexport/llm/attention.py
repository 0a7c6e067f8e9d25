"""Attention as onnxruntime's fused `com.microsoft.GroupQueryAttention` for `--target ort`
(docs/design.md §10, issue 31 item 2): an LLM-graph transform applied to the KV-cache file after it is
exported and rewritten, before the generation check; never a norm rule. This module is the
fusion's pipeline and convert's hook; its pieces live beside it, one concern each:
`gqa_rule` (the rewrite rule, packed q / k / v), `rotary` (the RoPE's inverse frequencies),
`masks` (the matched mask, run), `verify` (the local check in onnxruntime) and `share_buffer`
(past / present in one buffer).

What it does, on a copy of the file (the caller keeps the original):

1. onnxscript's ORT fusions that find the pieces: its preliminary optimisation (shape inference,
   constant folding, shape rules), `fuse_rotary_embedding` (q and k rotated by rotate-half) and
   `fuse_sdpa` (the softmax(q k^T x scale + mask) v chain, its scale read off the graph).
2. `GroupQueryAttentionFusion` (normexport.llm.gqa_rule) matches each layer's decomposed
   attention with its concatenated cache and writes one GroupQueryAttention (its cos / sin caches
   from the graph's own inverse frequencies: normexport.llm.rotary).
3. What the rule matched as the mask is checked by running it (normexport.llm.masks): the plain
   causal + attention_mask mask, else not fused (a sliding window: Mistral, Gemma 3).
4. All layers or none: one GroupQueryAttention per layer, else the file is left as it was.
5. The local check (`verify.compare`): the fused file in onnxruntime on random feeds, a prefill
   (batch 2, empty past) and decode steps with its own cache fed back: logits and every present.*
   within docs/design.md §7's tolerance of the eager model's on the same feeds (a float32 model),
   else of the unfused file's. Against eager, the unfused file runs only when the fused one
   fails, to say which is wrong. The share-buffer check (`share_buffer.share_buffer_check`) then
   reruns the first row of that run with one buffer; where it agrees the flag `SHARE_BUFFER_KEY`
   is set in the model's metadata and `deploy` writes past_present_share_buffer true.

The caller (convert) then runs the generation check on the fused file; where that fails it keeps
the unfused file and says so.

Limits of the fused form (GroupQueryAttention's contract): it reads the mask only as each row's
count of ones (seqlens_k) and takes positions from it, not from position_ids (that input stays,
unused): exact for unpadded batches (attention_mask all ones, position_ids = past + arange: what
the generation check, onnxruntime-genai and optimum feed at batch 1 or equal lengths); a
left-padded batch (zeros before the tokens) is not what the unfused graph computes. The cos / sin
caches cover `max_positions` positions (the model's context length): onnxruntime refuses a longer
run. onnxruntime's CPU kernel takes head sizes that are multiples of 16 (others are not fused) and
refuses batch > 1 with a prompt longer than 1 over a non-empty past (chunked prefill of a batch).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import onnx_ir as ir

from .gqa_rule import FUSION_DOMAIN as _FUSION
from .gqa_rule import MS, packed_qkv, rule_class
from .share_buffer import SHARE_BUFFER_KEY, share_buffer_check
from .verify import EagerForked, compare, eager_ahead, why as _why

#: onnxscript optimize's iterations before the fusions (it stops early at a fixed point: one more than its
#: default, so that the shape rules finding nothing leave a fixed point, not an iteration cap)
_ITERATIONS = 3
#: the decomposed file's name in a workdir (normexport.llm.files.Workdir.decomposed: this, unless the
#: output has this name; the fused one has the output's)
DECOMPOSED = "decomposed.onnx"


@dataclasses.dataclass
class Fusion:
    """The outcome of `fuse`: `model` is the fused copy (None where not fused) and `reason` why not."""

    model: ir.Model | None
    layers: int
    fused: int = 0
    nodes_before: int = 0
    nodes_after: int = 0
    reason: str | None = None
    local: dict = dataclasses.field(default_factory=dict)
    share_buffer: bool = False
    share_buffer_reason: str | None = None
    attributes: dict = dataclasses.field(default_factory=dict)
    packed_qkv: int = 0  # GroupQueryAttention nodes given the packed q / k / v projection
    optimized_first: bool = False  # onnxscript's optimize ran before the fusions (_fused_copy's second try)
    #: with a workdir (fuse): the fused file and the decomposed one, written there and checked by path
    path: Path | None = None
    decomposed_path: Path | None = None

    def to_dict(self) -> dict:
        return {"fused": self.model is not None, "group_query_attention": self.fused, "layers": self.layers,
                "nodes_before": self.nodes_before, "nodes_after": self.nodes_after, "reason": self.reason,
                "local_check": self.local, "attributes": self.attributes,
                "past_present_share_buffer": self.share_buffer,
                "share_buffer_reason": self.share_buffer_reason,
                "limits": "exact for unpadded batches (attention_mask all ones); GroupQueryAttention takes positions "
                          "from seqlens_k = attention_mask.sum(-1) - 1, not position_ids: left padding differs"}



# ---- the fusion ------------------------------------------------------------------------------------------

_TERM = re.compile(r"^([A-Za-z_]\w*|\d+)$")


def _canonical_dims(model: ir.Model) -> None:
    """Symbolic dims that are sums of the same terms spelled in one order (the exporter writes both
    `past_sequence + sequence` and `sequence + past_sequence`; onnxscript's shape checks compare
    names): the terms sorted. Labels only: the same sizes."""
    def canon(d):
        name = getattr(d, "value", None)
        if not isinstance(name, str) or "+" not in name:
            return d
        terms = [t.strip() for t in name.split("+")]
        return ir.SymbolicDim(" + ".join(sorted(terms))) if all(_TERM.match(t) for t in terms) else d

    values = list(model.graph.inputs) + [o for n in model.graph for o in n.outputs]
    for v in values:
        if v.shape is not None and any(isinstance(getattr(d, "value", None), str) and "+" in d.value for d in v.shape):
            v.shape = ir.Shape([canon(d) for d in v.shape])


def _take_presents(model: ir.Model, pairs) -> None:
    """The cache GroupQueryAttention returns replaces the concatenated one (graph outputs by name)."""
    outputs = model.graph.outputs
    for old, new in pairs:
        if old in outputs:
            name = old.name
            old.name = f"{name}_concatenated"
            outputs[outputs.index(old)] = new
            new.name = name
        ir.convenience.replace_all_uses_with(old, new)


def _count(model: ir.Model) -> int:
    return sum(1 for _ in model.graph)


def _copy(model: ir.Model) -> ir.Model:
    """The graph copied, its weights shared (onnx-ir's clone: the same tensor objects, no bytes
    copied; the fusion's passes replace values, never a tensor's contents)."""
    return model.clone()


def _float32(lm):
    """The eager reference of the local check: a float32 FlatCacheLM (others: their check is by generation)."""
    import torch

    if lm is None or getattr(getattr(lm, "layout", None), "dtype", None) != torch.float32:
        return None
    return lm


def fuse(model_ir: ir.Model, *, max_positions: int, local_check: bool = True, workdir=None,
         sessions: dict | None = None, reference=None, eager=None) -> Fusion:
    """The fused copy of a KV-cache file (module docstring); `model_ir` itself is left as it is.

    `workdir` (normexport.llm.files.Workdir): the checks run from files, for a model of any size:
    the decomposed file is written there as `workdir.decomposed` (the weights streamed once, by a
    forked process while the fusion passes run: Workdir.write_behind), the fused one as the
    output's name sharing its data file (`Fusion.path`, `Fusion.decomposed_path`); one onnxruntime session at a time. Without it the
    files are serialised in memory (up to 2 GiB). `sessions` (a dict): receives the fused file's
    onnxruntime session as "fused" where the fusion is kept, for the generation check to run on
    (one session of the file made, not two). `eager`: the local check's eager steps started earlier
    (a verify.EagerForked), taken where they are this file's (`serves`), else stopped."""
    copy = _copy(model_ir)  # before the write below swaps model_ir's initializers for streaming ones
    spare = _copy(model_ir)  # (the fusions' second try, with onnxscript's optimize first: _fused_copy)
    # the local check's eager outputs (the same feeds as compare's: its defaults), made by a forked copy of this
    # process beside the passes (forked first: no thread of this process is writing then); where that gives
    # nothing, here after the passes, while the decomposed file may still be written
    forked = eager if eager is not None and local_check and eager.serves(model_ir, reference) else None
    if eager is not None and forked is None:
        eager.stop()
    if forked is None and local_check and _float32(reference) is not None:
        forked = EagerForked(model_ir, reference)
    behind = None  # the decomposed file written while the passes run
    if workdir is not None and local_check and workdir.decomposed not in workdir.files:
        behind = workdir.write_behind(model_ir, workdir.decomposed)
    eager = None
    try:
        result = _fused_copy(model_ir, copy, max_positions, spare)
        del spare
        if forked is not None:
            eager = forked.result() if result.model is not None else forked.stop()
        if eager is None and result.model is not None and local_check and _float32(reference) is not None:
            # a step on one thread while the weights are still being written: the writer has the other core
            # (1.1B LLaMA's 3 steps beside a forked writer, busy 2-core VM: two torch threads 4.9 CPU s / 15 s,
            # one 2.3 / 9-10 s)
            eager = eager_ahead(model_ir, reference, one_thread=lambda: _writing(behind))
    finally:
        if forked is not None:
            forked.stop()
        write_error = behind.exception() if behind is not None else None  # waits for the write
    model = result.model
    if model is None or not local_check:
        return result
    files = None
    if workdir is not None:
        # the fused file is written once, with the share-buffer flag: the checks' sessions ignore metadata, and
        # where the share-buffer check below fails it is written again without it (the file kept says only
        # what was verified; docs/design.md §10)
        model.metadata_props[SHARE_BUFFER_KEY] = "true"
        try:
            if write_error is not None:
                raise write_error
            files = (workdir.files.get(workdir.decomposed) or workdir.write(model_ir, workdir.decomposed),
                     workdir.write(model, workdir.out.name))
        except OSError as e:
            model.metadata_props.pop(SHARE_BUFFER_KEY, None)
            result.model, result.reason = None, f"cannot write the files to check ({e.strerror or e})"
            return result
        result.decomposed_path, result.path = files
    shared: dict = {}  # the fused file's session and run, reused by the share-buffer check
    result.local = compare(model_ir, model, files=files, keep=shared, reference=_float32(reference), eager=eager)
    del eager
    if not result.local.get("passed"):
        model.metadata_props.pop(SHARE_BUFFER_KEY, None)
        result.reason = f"local check failed: {result.local.get('reason')}"
        result.model = None
        return result
    ok, why = share_buffer_check(model, session=shared.get("fused"), reference=shared.get("run"))
    if sessions is not None and "fused" in shared:
        sessions["fused"] = shared["fused"]
    shared.clear()
    result.share_buffer, result.share_buffer_reason = ok, why
    if ok:
        model.metadata_props[SHARE_BUFFER_KEY] = "true"
    elif model.metadata_props.pop(SHARE_BUFFER_KEY, None) is not None and workdir is not None:
        result.path = workdir.write(model, workdir.out.name)  # the flag the file was written with, taken out
    return result


def _writing(behind) -> bool:
    """The decomposed file's write (Workdir.write_behind's future) still running, its weights' by a forked process."""
    return behind is not None and not behind.done()


def _fused_copy(model_ir: ir.Model, model: ir.Model, max_positions: int, spare: ir.Model | None = None) -> Fusion:
    """The fusion passes on `model`, a copy of `model_ir` (module docstring, items 1-4), reading of
    `model_ir` its interface alone: `Fusion.model` the fused copy, unchecked, or None and
    `Fusion.reason`.

    With `spare` (a second copy): first without onnxscript's optimize before the fusions. convert's
    files are its fixed point already (the export ends with it, the grown blocks are copies of an
    optimized one, the rewrite's fused norms are opaque to it), and on a 1.1B LLaMA it is 1.1-1.4 s
    of the stage; where that does not fuse every layer, again on `spare` with it (the same graph on
    the families tested: tests/test_llm_attention.py). Without: with it, once."""
    if spare is not None:
        fast = _fusions(model_ir, model, max_positions, optimize_first=False)
        if fast.model is not None:
            return fast
        model = spare
    return _fusions(model_ir, model, max_positions, optimize_first=True)


def _fusions(model_ir: ir.Model, model: ir.Model, max_positions: int, *, optimize_first: bool) -> Fusion:
    import onnx_ir.passes.common as common_passes
    from onnxscript.optimizer import optimize
    from onnxscript.rewriter import pattern
    from onnxscript.rewriter.ort_fusions import shape_optimization
    from onnxscript.rewriter.ort_fusions.rotary_embedding import fuse_rotary_embedding
    from onnxscript.rewriter.ort_fusions.sdpa import fuse_sdpa

    from ..exporter.optimizer_rules import exact_no_op_rules

    layers = sum(1 for v in model_ir.graph.inputs if v.name.startswith("past_key_values.") and v.name.endswith(".key"))
    result = Fusion(None, layers, nodes_before=_count(model_ir), optimized_first=optimize_first)
    if not layers:
        result.reason = "no past_key_values.*.key input"
        return result
    try:
        common_passes.ShapeInferencePass()(model)
        with exact_no_op_rules():  # `x + 1e-15` is not `x` (exporter.optimizer_rules)
            if optimize_first:
                optimize(model, num_iterations=_ITERATIONS)
            if shape_optimization.rules.apply_to_model(model):  # else optimize's fixed point stands: not run again
                optimize(model, num_iterations=_ITERATIONS)
        _canonical_dims(model)
        rotary = fuse_rotary_embedding(model)
        sdpa = fuse_sdpa(model, apply_shape_inference=True)
        _canonical_dims(model)
        rule = rule_class()(max_positions)
        count = pattern.RewriteRuleSet([pattern.RewriteRule(
            rule.pattern, rule.rewrite, rule.check, name=rule.name, remove_nodes=rule.remove_nodes)]).apply_to_model(model)
        _take_presents(model, rule.presents)
    except Exception as e:  # noqa: BLE001
        result.reason = f"onnxscript's fusions failed: {_why(e)}"
        return result
    result.fused = count
    if count != layers:
        result.reason = (f"{count} of {layers} layers matched (rotary {rotary}, sdpa {sdpa}): "
                         + (rule.mask_failures[0] if rule.mask_failures else "the attention is not the plain "
                            "grouped-query form (rotate-half RoPE from position_ids, concatenated cache, causal mask)"))
        return result
    # the decomposed attention, its mask and the rotary's cos / sin are now unused: removed, and the rest
    # left as onnxscript's optimize leaves a file (its closing passes; its folding and rewrite rules ran
    # before the fusion and find nothing new after it on the families tested, at 0.46 s of 1.1B LLaMA's)
    common_passes.RemoveUnusedNodesPass()(model)
    common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    common_passes.DeduplicateInitializersPass()(model)
    common_passes.CommonSubexpressionEliminationPass()(model)
    common_passes.RemoveUnusedNodesPass()(model)
    model.opset_imports.setdefault(MS, 1)
    left = [n.op_type for n in model.graph if n.domain == _FUSION]
    got = sum(1 for n in model.graph if n.op_type == "GroupQueryAttention" and n.domain == MS)
    if left or got != layers:
        result.reason = f"after cleanup: {got} GroupQueryAttention, {len(left)} intermediate fusion op(s) left"
        return result
    _keep_interface(model, model_ir)
    result.packed_qkv = packed_qkv(model)  # q / k / v projections packed before the fusion: the packed query
    result.nodes_after = _count(model)
    a = rule.attributes[0]
    result.attributes = {k: a[k] for k in ("num_heads", "kv_num_heads", "scale", "do_rotary", "rotary_interleaved")}
    result.attributes["cos_sin_cache_positions"] = max_positions
    result.model = model
    return result


def _keep_interface(model: ir.Model, original: ir.Model) -> None:
    """The fused graph keeps the file's interface: inputs / outputs by name, their types and dim names."""
    outs = {v.name: v for v in original.graph.outputs}
    for v in model.graph.outputs:
        o = outs.get(v.name)
        if o is not None:
            v.shape, v.type = o.shape, o.type
    ins = {v.name: v for v in original.graph.inputs}
    for v in model.graph.inputs:
        o = ins.get(v.name)
        if o is not None:
            v.shape, v.type = o.shape, o.type



# ---- convert's hook ---------------------------------------------------------------------------------------

#: config keys holding the context length (the cos / sin caches' rows), as deploy reads them
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def context_length(lm) -> int | None:
    """The model's context length from its transformers config (None: a .pt2 program, no config)."""
    config = getattr(getattr(lm, "generates", None), "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def for_convert(model_ir: ir.Model, lm, workdir=None, sessions: dict | None = None, eager=None) -> Fusion:
    """convert --target ort, KV-cache task: the fused copy of the exported file where it matches and
    passes the local check (`Fusion.model`), else why not (`Fusion.reason`). `workdir`
    (normexport.llm.files.Workdir): checked from files there, for a model of any size (`fuse`); `eager`:
    the local check's eager steps started earlier (`fuse`)."""
    positions = context_length(lm)
    if positions is None:
        if eager is not None:
            eager.stop()
        layers = sum(1 for v in model_ir.graph.inputs if v.name.startswith("past_key_values.") and v.name.endswith(".key"))
        return Fusion(None, layers, nodes_before=_count(model_ir),
                      reason="no context length in the model's config (the cos / sin caches' size)")
    return fuse(model_ir, max_positions=positions, workdir=workdir, sessions=sessions, reference=lm, eager=eager)


def line(f: Fusion, generation: str | None = None) -> str:
    """convert's line on the fusion: done (node counts, how verified, share buffer) or why not."""
    if f.model is None:
        return f"  attention: decomposed (not fused as GroupQueryAttention: {f.reason})"
    share = "past/present can share one buffer" if f.share_buffer else \
        f"past/present share buffer not verified ({f.share_buffer_reason})"
    return (f"  attention: {f.fused} com.microsoft.GroupQueryAttention (one per layer, num_heads "
            f"{f.attributes['num_heads']}, kv_num_heads {f.attributes['kv_num_heads']}), {f.nodes_before} -> "
            f"{f.nodes_after} nodes; local check PASSED (the fused file in onnxruntime against "
            + ("eager" if f.local.get("against") == "eager" else "the decomposed file")
            + f", logits and cache, batch {f.local.get('batch')}, prefill + {f.local.get('decode_steps')} decode "
            f"steps, max_abs_err {f.local.get('max_abs_err', 0):.3g})"
            + (f"; {generation}" if generation else "") + f"; {share}; exact for unpadded batches only "
            "(seqlens_k = attention_mask.sum(-1) - 1; left padding differs: --no-fuse attention keeps it decomposed)")
