"""The check of a file exported with its KV cache: greedy generation, step by step (docs/design.md §10).

N tokens (default 16) are generated greedily from a prompt (random token ids, seeded): a prefill
step (past length 0, the whole prompt) and N - 1 decode steps (one token, the cache fed back).

1. Eager: the model with the same cache semantics as the file (`normexport.llm.CacheLM`, the
   module the file was exported from) in the checked dtype; its greedy tokens are the path every
   run follows, and its top-2 logit margin at each step is recorded. Eager, the float64 reference
   and the runtime get their inputs from one helper (`_feeds`), so a bug there would pass them
   all: eager is checked against transformers' own `generate` from the same prompt (its cache,
   its position ids), its per-step logits within the tolerance (docs/design.md §7) and its tokens equal
   wherever eager's top-2 margin exceeds the tolerance.
2. The float64 reference (parity.reference: a float64 copy, or each module's weights upcast while
   it runs for a model too large for a copy) follows eager's tokens with its own float64 cache.
3. The runtime (onnxruntime) runs the file on the same tokens with its own cache fed back (each
   step's `present.*` become the next step's `past_key_values.*`).

The three run one after another, each dropping what it held before the next starts (eager's and
the reference's logits are kept; the model is released before onnxruntime loads the file when the
caller hands it over as a loader), so eager, the float64 copy and onnxruntime never each hold the
weights at once.

Per step: the logits are judged by docs/design.md §7 (parity.verdict: 2x eager, else the plain export of
the same CacheLM, else the tolerance without a float64 reference), and the runtime's greedy token
must equal eager's wherever eager's top-2 margin exceeds the margin limit, max(tolerance, 2 x the
step's limit): an error within the limit cannot swap two logits further apart than twice it. The
runtime is fed eager's tokens (teacher forcing), so every step compares like with like; where the
tokens must be equal at every step the runtime's own greedy generation is eager's.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import UsageError
from . import runners
from ._util import _as_float64, _dtype_name, _elem_dtype, _graph_inputs, _short
from .reference import _Float64Reference
from .report import Row, _fmt
from .tolerances import LIMIT_RULE, tolerance_for
from .verdict import _compare

DEFAULT_TOKENS = 16
DEFAULT_BATCH = 1
DEFAULT_PROMPT = 8


def is_with_past(model) -> bool:
    """The ONNX model (proto) takes a KV cache: input_ids and past_key_values.0.key among its inputs."""
    names = {i.name for i in _graph_inputs(model)}
    return "input_ids" in names and "past_key_values.0.key" in names


@dataclasses.dataclass
class Step:
    """One generation step: its logits row (verdict) and its token check."""

    index: int  # 0: prefill
    past: int
    sequence: int
    row: Row
    eager_tokens: list[int]
    runtime_tokens: list[int] | None = None
    margin: float | None = None  # eager's smallest top-2 margin over the batch
    margin_limit: float | None = None
    tokens_required: bool = False
    tokens_passed: bool = True

    @property
    def name(self) -> str:
        return "prefill" if self.index == 0 else f"decode {self.index}"

    @property
    def passed(self) -> bool:
        return self.row.passed and self.tokens_passed

    def to_dict(self) -> dict:
        return {"step": self.name, "past": self.past, "sequence": self.sequence, "logits": self.row.to_dict(),
                "eager_tokens": self.eager_tokens, "runtime_tokens": self.runtime_tokens,
                "top2_margin": self.margin, "margin_limit": self.margin_limit,
                "tokens_must_match": self.tokens_required, "tokens_passed": self.tokens_passed,
                "passed": self.passed}


@dataclasses.dataclass
class GenerationReport:
    command: str
    onnx_model: str
    reference: str
    backend: str
    dtype: str
    batch: int
    prompt_length: int
    tokens: int
    steps: list[Step] = dataclasses.field(default_factory=list)
    fp64_reference: dict = dataclasses.field(default_factory=dict)
    plain_export: dict = dataclasses.field(default_factory=dict)
    error: str | None = None
    widened: bool = False
    #: transformers' own generate (its cache, sliding layers cut to the window) from the same prompt:
    #: {"tokens": [[per step]], "required": steps whose eager margin > tolerance, "logits_compared",
    #: "logits_max_abs_err" (its per-step logits vs eager's, within the tolerance), "passed"} or {"reason"}
    library: dict = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return (self.error is None and bool(self.steps) and all(s.passed for s in self.steps)
                and self.library.get("passed", True))

    def to_dict(self) -> dict:
        from .. import __version__

        return {"normexport_version": __version__, "command": self.command, "check": "generation",
                "onnx_model": self.onnx_model, "reference": self.reference, "backend": self.backend,
                "dtype": self.dtype, "inputs": [{"name": "input_ids", "shape": [self.batch, self.prompt_length],
                                                 "dtype": "int64"}],
                "batch": self.batch, "prompt_length": self.prompt_length, "tokens": self.tokens,
                "limit_rule": LIMIT_RULE, "token_rule": TOKEN_RULE, "fp64_reference": self.fp64_reference,
                "plain_export": self.plain_export, "library_generate": self.library,
                "steps": [s.to_dict() for s in self.steps],
                "error": self.error, "passed": self.passed}

    def write_json(self, path) -> Path:
        from ..io import write_json

        return write_json(self.to_dict(), path)

    def table(self) -> str:
        head = ("step", "past", "seq", "eager_err", "plain_err", "file_err", "limit", "rule", "eager_tok", "file_tok",
                "margin", "must_match", "result")
        lines = []
        for s in self.steps:
            r = s.row
            toks = lambda t: "-" if t is None else ",".join(map(str, t))  # noqa: E731
            lines.append((s.name, str(s.past), str(s.sequence), _fmt(r.ref_err_fp64), _fmt(r.plain_err),
                          _fmt(r.max_abs_err), _fmt(r.limit), r.rule or "-", toks(s.eager_tokens),
                          toks(s.runtime_tokens), _fmt(s.margin), "yes" if s.tokens_required else "no",
                          "PASS" if s.passed else "FAIL"))
        widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
        fp64 = "" if self.fp64_reference.get("available") else " -- unavailable, against eager"
        out = [f"generation check: {self.onnx_model} vs {self.reference}: {self.tokens} greedy tokens, batch "
               f"{self.batch}, prompt {self.prompt_length} random ids; {self.backend} fed eager's tokens and its own "
               f"cache; logits errors against the float64 reference{fp64}, eager in {self.dtype}"]
        out.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        out.extend("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in lines)
        out.append("  the tokens must match where eager's top-2 margin > max(tolerance, 2 x limit) (margin: the "
                   "smallest over the batch)")
        if self.widened:
            out.append(f"  {runners.WIDENED}")
        for s in self.steps:
            if s.row.warning:
                out.append(f"  WARNING {s.name}: {s.row.warning}")
        if self.plain_export.get("reason"):
            out.append(f"  plain export: {self.plain_export['reason']}")
        if not self.fp64_reference.get("available", True):
            out.append(f"  no float64 reference: {self.fp64_reference.get('reason')}")
        for s in self.steps:
            if not s.row.passed and s.row.reason:
                out.append(f"  FAIL {s.name} logits: {s.row.reason}")
            if not s.tokens_passed:
                out.append(f"  FAIL {s.name} tokens: {self.backend} chose {s.runtime_tokens}, eager {s.eager_tokens} "
                           f"with a top-2 margin of {s.margin:.3g} > {s.margin_limit:.3g}")
        if self.error:
            out.append(f"  ERROR {self.backend}: {self.error}")
        lib = self.library
        if "tokens" in lib:
            why = "; ".join(x for x in (lib.get("first_difference"), lib.get("logits_first_difference")) if x)
            logits = (f", its logits against eager's at {lib['logits_compared']} step(s): max_abs_err "
                      f"{_fmt(lib['logits_max_abs_err'])}" if "logits_compared" in lib else "")
            out.append(f"  {'FAIL' if not lib['passed'] else 'ok'}: transformers' generate (its own cache) gives eager's "
                       f"tokens at {lib['equal']}/{len(self.steps)} steps ({lib['required']} required: eager's margin "
                       f"> tolerance){logits}{'' if lib['passed'] else ': ' + why}")
        elif lib.get("reason"):
            out.append(f"  transformers' generate not compared: {lib['reason']}")
        required = sum(s.tokens_required for s in self.steps)
        equal = sum(1 for s in self.steps if s.runtime_tokens == s.eager_tokens)
        verdict = "PASSED" if self.passed else "FAILED"
        out.append(f"{verdict}: {sum(s.row.passed for s in self.steps)}/{len(self.steps)} steps' logits within limits; "
                   f"tokens equal at {equal}/{len(self.steps)} steps ({required} required by the margin)")
        return "\n".join(out)


TOKEN_RULE = ("the runtime's greedy token equals eager's wherever eager's top-2 logit margin > max(tolerance, 2 x limit) "
              "of that step's logits row")


def _margin(logits_last: torch.Tensor) -> float:
    """Smallest top-2 margin over the batch of [batch, vocab] logits."""
    top = torch.topk(logits_last.double(), 2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def check_generation(onnx_model, reference, *, tokens: int = DEFAULT_TOKENS, batch: int = DEFAULT_BATCH,
                     prompt_length: int = DEFAULT_PROMPT, seed: int = 0, rtol: float | None = None,
                     atol: float | None = None, backend: str = "ort", command: str = "check",
                     plain_export: Callable | bool | None = None, session=None) -> GenerationReport:
    """Greedy generation of `tokens` tokens through `onnx_model` (path or ModelProto) vs `reference`
    (a normexport.llm.FlatCacheLM: CacheLM or ProgramLM, or a function returning one: then it is
    released before the runtime loads the file). `plain_export`: () -> onnx.ModelProto of the plain
    torch.onnx export of the same FlatCacheLM, or True (built here from the reference), built only when a step fails the
    2x-eager rule; a model over 2 GiB of weights is released instead (no plain-export rule).
    `session`: an onnxruntime session already made of this very file (CPU; e.g. by the attention
    fusion's local check), run instead of a new one (backend "ort" only)."""
    if tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {tokens}")
    if batch < 1 or prompt_length < 1:
        raise UsageError(f"the prompt must have batch >= 1 and length >= 1, got {batch}x{prompt_length}")
    source = runners._ModelSource(onnx_model)
    try:
        if not is_with_past(source.proto):
            raise UsageError(f"'{source.label}' takes no KV cache (no past_key_values.0.key input): check it with "
                             "the generic parity check")
        lm = reference() if callable(reference) and not isinstance(reference, torch.nn.Module) else reference
        dtype = _file_dtype(source.proto) or lm.layout.dtype
        label = lm.label
        report = GenerationReport(command=command, onnx_model=source.label, reference=label, backend=backend,
                                  dtype=_dtype_name(dtype), batch=batch, prompt_length=prompt_length, tokens=tokens)
        if lm.layout.dtype != dtype:
            from .reference import _cast_reference

            lm = _cast_reference(lm, dtype)
        vocab = lm.vocab_size
        prompt = torch.randint(0, vocab, (batch, prompt_length), generator=torch.Generator().manual_seed(seed))

        # 1. eager: the token path, its logits and margins; transformers' own generate beside it
        path, eager_logits, margins = _eager(lm, prompt, tokens, dtype)
        report.library = _library_generate(lm, prompt, path, eager_logits, margins, dtype, rtol, atol)
        # 2. float64 reference on the same path
        ref, why = _float64(lm, path, prompt_length)
        report.fp64_reference = {"available": ref is not None} | ({} if ref is not None else {"reason": why})
        keep = plain_export not in (None, False) and runners.weight_bytes(source.proto) <= (2 << 30)
        if keep and plain_export is True:
            from .plain import builder, opset_of

            ex = tuple(t.to(dtype) if t.is_floating_point() else t for t in lm.example_inputs())
            plain_export = builder(lm, ex, input_names=list(lm.input_names), output_names=list(lm.output_names),
                                   dynamic_axes=lm.dynamic_axes(), opset=opset_of(source.proto))
        if not keep:
            if plain_export not in (None, False):
                report.plain_export = {"built": False, "reason": "not built: the model has over 2 GiB of weights, "
                                       "released before onnxruntime loads the file"}  # the weights leave before onnxruntime loads the file (docs/design.md §8)
            plain_export = None
            lm = None
            gc.collect()
        # 3. the runtime
        try:
            got, widened = _runtime(source, backend, path, prompt_length, dtype,
                                    session=session if backend == "ort" else None)
            session = None
            report.widened = widened
        except Exception as e:  # noqa: BLE001
            report.error = f"{type(e).__name__}: {_short(e)}"
            return report
        plain = _Plain(plain_export, backend, path, prompt_length, dtype, report)
        for k in range(tokens):
            seq = prompt_length if k == 0 else 1
            past = 0 if k == 0 else prompt_length + k - 1
            eager64 = eager_logits[k]
            refs = ref[k] if ref is not None else eager64
            eager_err = None if ref is None else float(np.abs(eager64 - refs).max())
            row = Row(backend=backend, shape_index=k, input_shapes={"input_ids": [batch, seq], "past": [past]},
                      output="logits", dtype=_dtype_name(dtype))
            _compare(row, got[k], refs, eager64, dtype, eager_err, rtol, atol,
                     plain=(lambda k=k, r=refs: plain.error(k, r)) if plain_export is not None else None)
            step = Step(index=k, past=past, sequence=seq, row=row, eager_tokens=path[:, prompt_length + k].tolist())
            if got[k].shape == eager64.shape:
                step.runtime_tokens = np.argmax(got[k][:, -1], axis=-1).tolist()
            step.margin = margins[k]
            tol = row.tolerance if row.tolerance is not None else tolerance_for(dtype, float(np.abs(refs).max()), rtol, atol)
            step.margin_limit = max(tol, 2 * (row.limit or 0.0))
            step.tokens_required = step.margin > step.margin_limit
            step.tokens_passed = not step.tokens_required or step.runtime_tokens == step.eager_tokens
            report.steps.append(step)
        if plain_export is not None and plain.info:
            report.plain_export = plain.info
        return report
    finally:
        source.close()


def check_generation_ir(model_ir, reference, workdir, *, name: str | None = None, label: str | None = None,
                        **kwargs) -> GenerationReport:
    """check_generation of an onnx-ir model of any size, run from its file in `workdir`
    (normexport.llm.files.Workdir): `name` where the model is written there already (e.g. the
    fused file attention.fuse wrote, or workdir.decomposed), else it is written now as the
    output's name (its weights streamed to the data file, or shared with the file written first).
    onnxruntime loads it by path: no protobuf of the weights in memory; the float64 reference of
    a model over 4 GiB in float64 upcasts one module at a time. `label`: the file's name in the
    report (default: the output's). Other arguments as check_generation's."""
    name = name or workdir.out.name
    path = workdir.files.get(name) or workdir.write(model_ir, name)
    report = check_generation(path, reference, **kwargs)
    report.onnx_model = label or workdir.out.name
    return report


def _file_dtype(proto):
    for vi in _graph_inputs(proto):
        if vi.name.startswith("past_key_values."):
            return _elem_dtype(vi)
    return None


def _feeds(lm_or_none, ids, past_len, seq_len, batch, past):
    mask = torch.ones(batch, past_len + seq_len, dtype=torch.long)
    pos = torch.arange(past_len, past_len + seq_len).expand(batch, seq_len).contiguous()
    return (ids, mask, pos, *past)


def _eager(lm, prompt: torch.Tensor, tokens: int, dtype):
    """(prompt + generated ids [batch, prompt + tokens], per-step logits as float64, per-step margins)."""
    batch, n = prompt.shape
    past = lm.layout.empty(batch, 0, dtype=dtype)
    path, logits_all, margins = prompt, [], []
    ids = prompt
    with torch.no_grad():
        for k in range(tokens):
            plen = 0 if k == 0 else n + k - 1
            out = lm(*_feeds(lm, ids, plen, ids.shape[1], batch, past))
            logits, past = out[0], list(out[1:])
            last = logits[:, -1].float()
            nxt = last.argmax(-1, keepdim=True)
            margins.append(_margin(last))
            logits_all.append(_as_float64(logits))
            path = torch.cat([path, nxt], dim=1)
            ids = nxt
    return path, logits_all, margins


def _library_generate(lm, prompt, path, eager_logits, margins, dtype, rtol, atol) -> dict:
    """transformers' `generate` (greedy, its own cache) from the prompt vs eager's path: the
    cache semantics of CacheLM (the file's) against the library's, and the feeds `_feeds` builds
    (shared by eager, the float64 reference and the runtime, so only this comparison sees a bug in
    them) against the library's own. Per step, while the paths agree: generate's logits
    (output_logits: before any logits processor) within the tolerance of eager's last position,
    and its token equal to eager's where eager's top-2 margin exceeds the tolerance (both are eager
    in one dtype)."""
    model = lm.generates
    if model is None:
        return {"reason": f"{lm.label} is no transformers model: it has no generate of its own"}
    n, tokens = prompt.shape[1], path.shape[1] - prompt.shape[1]
    try:
        own = model.generation_config
        config = _plain_greedy(own)
        config.eos_token_id = None  # all `tokens` steps, no early stop
        config.pad_token_id = 0 if config.pad_token_id is None else config.pad_token_id
        config.max_new_tokens, config.do_sample, config.use_cache = tokens, False, True
        config.output_logits, config.return_dict_in_generate = True, True
        # generate fills what the config passed leaves unset from the model's own: swapped for the call
        model.generation_config = config
        try:
            with torch.no_grad():
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
        finally:
            model.generation_config = own
        got, got_logits = out.sequences[:, n:], out.logits
    except Exception as e:  # noqa: BLE001
        return {"reason": f"{type(e).__name__}: {_short(e)}"}
    if got.shape[1] != tokens or got_logits is None or len(got_logits) != tokens:
        return {"reason": f"generate gave {got.shape[1]} tokens, not {tokens}"}
    required = equal = compared = 0
    first = first_logits = None
    worst = 0.0
    for k in range(tokens):
        # step k's logits come from the same prefix in both (the paths agree up to here)
        want = eager_logits[k][:, -1]
        have = _as_float64(got_logits[k])
        tol = tolerance_for(dtype, float(np.abs(want).max()), rtol, atol)
        err = float(np.abs(have - want).max()) if have.shape == want.shape else math.inf
        compared += 1
        worst = max(worst, err)
        if err > tol and first_logits is None:
            first_logits = (f"step {k}: generate's logits differ from eager's by {err:.3g} > tolerance {tol:.3g}"
                            if math.isfinite(err) else f"step {k}: generate's logits have shape {list(have.shape)}, "
                            f"eager's {list(want.shape)}")
        same = got[:, k].tolist() == path[:, n + k].tolist()
        equal += same
        if margins[k] > tol:
            required += 1
            if not same and first is None:
                first = f"step {k}: generate {got[:, k].tolist()}, eager {path[:, n + k].tolist()} (margin {margins[k]:.3g})"
        elif not same:  # a near tie: the paths part here, later steps are not comparable
            break
    return {"tokens": got.T.tolist(), "equal": equal, "required": required,
            "passed": first is None and first_logits is None, "first_difference": first,
            "logits_compared": compared, "logits_max_abs_err": worst, "logits_first_difference": first_logits}


#: what of a model's generation config decides how its cache is kept, not which token is chosen
_CACHE_FIELDS = ("cache_implementation", "cache_config", "pad_token_id", "bos_token_id", "decoder_start_token_id")


def _plain_greedy(own):
    """A generation config for plain greedy decoding with the model's own cache settings: none of the
    logits processors its own config switches on (BART's forced_eos_token_id puts EOS at the last step,
    min_length / no_repeat_ngram_size / repetition_penalty / suppress_tokens change tokens too), which
    eager's argmax path does not apply."""
    from transformers import GenerationConfig

    config = GenerationConfig()
    for k in _CACHE_FIELDS:
        if getattr(own, k, None) is not None:
            setattr(config, k, copy.deepcopy(getattr(own, k)))
    return config


def _float64(lm, path: torch.Tensor, n: int):
    """Per-step float64 logits along `path`, or (None, why).

    A model too large for a float64 copy (its weights upcast one module at a time while it runs,
    parity.reference) is run once over the whole path (prompt and the tokens fed back, empty past):
    causal attention makes each position's logits those of the step that produced it, so every
    step's float64 logits come from one upcast of the weights instead of one per step (16 x 8.8 GB
    of float64 copies for a 1.1B model). Where that one pass fails or gives another shape, per step."""
    run = _Float64Reference(lm)
    batch, total = path.shape
    try:
        if run.streamed and run.module is not None:
            whole = _float64_one_pass(run, lm, path, n)
            if whole is not None:
                return whole, None
    except Exception:  # noqa: BLE001 - a model that takes no long prefill: per step below
        pass
    past = [t.double() for t in lm.layout.empty(batch, 0)]
    out_logits = []
    try:
        for k in range(total - n):
            ids = path[:, :n] if k == 0 else path[:, n + k - 1:n + k]
            plen = 0 if k == 0 else n + k - 1
            outs, why = run(_feeds(None, ids, plen, ids.shape[1], batch, past))
            if outs is None:
                return None, why
            out_logits.append(_as_float64(outs[0]))
            past = outs[1:]
        return out_logits, None
    finally:
        del run
        gc.collect()


def _float64_one_pass(run, lm, path: torch.Tensor, n: int):
    """The per-step float64 logits of `_float64` from one forward over path[:, :-1] (empty past):
    step 0 the prompt's positions, step k position n + k - 1; None where it does not run."""
    batch, total = path.shape
    ids = path[:, :total - 1]
    past = [t.double() for t in lm.layout.empty(batch, 0)]
    outs, _ = run(_feeds(None, ids, 0, ids.shape[1], batch, past))
    if outs is None:
        return None
    logits = _as_float64(outs[0])
    if logits.shape[:2] != (batch, total - 1):
        return None
    return [logits[:, :n]] + [logits[:, n + k - 1:n + k] for k in range(1, total - n)]


def _runtime(source, backend: str, path: torch.Tensor, n: int, dtype, session=None):
    """Per-step logits of the file in the runtime along `path`, its own cache fed back."""
    provider = {"ort": "CPUExecutionProvider", "ort-cuda": "CUDAExecutionProvider"}.get(backend)
    if provider is None:
        raise UsageError(f"the generation check runs in onnxruntime (--backend ort or ort-cuda), not '{backend}'")
    runner = runners.OrtRunner.of_session(session) if session is not None else runners.runner_for(backend, source)
    session = None
    try:
        runner.activate()
        return _run_loop(runner.infer, source.proto, path, n, dtype), runner.widened
    finally:
        runner.deactivate()
        del runner
        gc.collect()


def _run_loop(run, proto, path, n, dtype):
    names = [i.name for i in _graph_inputs(proto)]
    past_infos = [vi for vi in _graph_inputs(proto) if vi.name.startswith("past_key_values.")]
    batch, total = path.shape
    past = []
    from ._util import _dims

    for vi in past_infos:
        d = _dims(vi)
        past.append(torch.zeros(batch, d[1], 0, d[3], dtype=dtype))
    logits = []
    for k in range(total - n):
        ids = path[:, :n] if k == 0 else path[:, n + k - 1:n + k]
        plen = 0 if k == 0 else n + k - 1
        feeds = dict(zip(["input_ids", "attention_mask", "position_ids"] + [vi.name for vi in past_infos],
                         _feeds(None, ids, plen, ids.shape[1], batch, past)))
        outs = run([feeds[name] for name in names])
        logits.append(_as_float64(outs[0]))
        past = [_tensor(o) for o in outs[1:]]
    return logits


def _tensor(a) -> torch.Tensor:
    a = np.asarray(a)
    return torch.from_numpy(a.astype(np.float32) if a.dtype.kind == "V" else a)


class _Plain:
    """The runtime on the plain export, run once along the path when a step first asks for it."""

    def __init__(self, build, backend, path, n, dtype, report):
        self.build, self.backend, self.path, self.n, self.dtype = build, backend, path, n, dtype
        self.logits: list | None = None
        self.info: dict = {}

    def error(self, k: int, ref64: np.ndarray):
        if self.logits is None and not self.info.get("reason"):
            try:
                src = runners._ModelSource(self.build())
                try:
                    self.logits, _ = _runtime(src, self.backend, self.path, self.n, self.dtype)
                finally:
                    src.close()
                self.info = {"built": True}
            except Exception as e:  # noqa: BLE001
                self.info = {"built": False, "reason": f"the plain export failed: {type(e).__name__}: {_short(e)}"}
        if self.logits is None:
            return None, self.info.get("reason")
        got = self.logits[k]
        if got.shape != ref64.shape:
            return None, "the plain export gives logits of another shape"
        return float(np.abs(got - ref64).max()), None
