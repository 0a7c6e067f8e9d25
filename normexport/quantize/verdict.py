"""The verdict of a quantized file (docs/design.md §15): agreement with eager fp32, never the float
verdict of §7.

A causal LM with its KV cache (`judge_llm`): a prompt of random ids (seeded), eager fp32 generates
TOKENS tokens greedily; the file is fed eager's tokens (teacher forcing) and judged per step by
top-1 agreement (its argmax is eager's token) and the cosine of its logits with eager's; then it
generates TOKENS tokens greedily on its own, and the tokens equal to eager's (and the length of the
common prefix) are counted. With an anchor (onnxruntime-genai's int4 folder of the same weights,
anchor.py) the same numbers are taken for it on the same prompt: PASS when the file is at least as
close to eager as the anchor (within one step's worth of noise, LLM_SLACK); without one, PASS by
the thresholds LLM_THRESHOLDS.

Any other model (`judge_outputs`): the file's outputs on convert's inputs against eager fp32 and
against the float file's, by cosine, PSNR and max error; PASS by OUTPUT_THRESHOLDS.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from pathlib import Path

import numpy as np
import torch

TOKENS = 32
PROMPT = 8
#: without an anchor (docs/design.md §15): teacher-forced top-1 agreement and the mean and smallest
#: logit cosine per step. The greedy tokens are shown, not judged, without an anchor: one near tie
#: (eager's top two logits closer than the quantization error, common in small or random models)
#: parts two greedy paths for good, whatever the file's quality; beside an anchor it is compared
#: Set where int4 of small random models sits (their quantization noise is the largest: a tiny Gemma 3
#: with tied embeddings, block 32, gives top-1 1.0 and all 32 greedy tokens at a mean cosine of 0.952)
LLM_THRESHOLDS = {"top1": 0.75, "cosine_mean": 0.9, "cosine_min": 0.8}
#: beside an anchor: the file may trail it by one teacher-forced step of top-1, 0.002 of mean
#: cosine and an eighth of the greedy tokens (run-to-run noise between two int4 files of the same
#: weights: the kernels' accumulation order differs)
LLM_SLACK = {"top1": 1 / TOKENS, "cosine_mean": 2e-3, "greedy_equal": TOKENS // 8}
#: any other model: per output, cosine with eager fp32 and PSNR against eager's peak
OUTPUT_THRESHOLDS = {"int4": {"cosine": 0.98, "psnr": 20.0}, "int8": {"cosine": 0.99, "psnr": 25.0},
                     "fp8": {"cosine": 0.98, "psnr": 20.0}}


@dataclasses.dataclass
class Agreement:
    """One file's agreement with eager along one prompt."""

    label: str
    steps: int = 0
    top1: float = 0.0
    cosine_mean: float = 0.0
    cosine_min: float = 0.0
    greedy_equal: int = 0
    greedy_prefix: int = 0
    error: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def row(self) -> str:
        if self.error:
            return f"{self.label:<28} ERROR {self.error}"
        return (f"{self.label:<28} {self.top1:>6.3f}  {self.cosine_mean:>9.5f}  {self.cosine_min:>9.5f}  "
                f"{self.greedy_equal:>3}/{self.steps:<3}  {self.greedy_prefix:>6}")


def _close(lines: list, rule: str, failures: list, passed: bool) -> str:
    """A verdict table's last lines: the rule, each failure, the verdict."""
    lines = [*lines, f"  rule: {rule}", *(f"  FAIL {f}" for f in failures),
             f"{'PASSED' if passed else 'FAILED'} (quantized verdict, docs/design.md §15)"]
    return "\n".join(lines)


@dataclasses.dataclass
class LLMVerdict:
    ours: Agreement
    anchor: Agreement | None = None
    anchor_note: str | None = None
    rule: str = ""
    failures: list = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures and self.ours.error is None

    def table(self) -> str:
        lines = [f"quantized check: {TOKENS} greedy tokens of eager fp32 from {PROMPT} random ids; teacher-forced "
                 "top-1 agreement and logit cosine per step, then each file's own greedy tokens",
                 f"{'file':<28} {'top-1':>6}  {'cos mean':>9}  {'cos min':>9}  {'greedy':>7}  {'prefix':>6}",
                 self.ours.row()]
        if self.anchor is not None:
            lines.append(self.anchor.row())
        if self.anchor_note:
            lines.append(f"  anchor: {self.anchor_note}")
        return _close(lines, self.rule, self.failures, self.passed)

    def to_dict(self) -> dict:
        return {"passed": self.passed, "rule": self.rule, "failures": self.failures, "ours": self.ours.to_dict(),
                "anchor": self.anchor.to_dict() if self.anchor else None, "anchor_note": self.anchor_note,
                "tokens": TOKENS, "prompt": PROMPT}


def _fp32(lm):
    from ..parity.reference import _cast_reference

    return lm if lm.layout.dtype == torch.float32 else _cast_reference(lm, torch.float32)


def eager_path(lm, tokens: int = TOKENS, prompt_length: int = PROMPT, seed: int = 0):
    """(prompt, eager fp32's greedy path [1, prompt + tokens], its per-step logits [1, vocab] float64)."""
    from ..parity.generate import _eager

    lm = _fp32(lm)
    prompt = torch.randint(0, lm.vocab_size, (1, prompt_length), generator=torch.Generator().manual_seed(seed))
    path, logits, _ = _eager(lm, prompt, tokens, torch.float32)
    return prompt, path, [l[:, -1] for l in logits]


def _source(onnx_path, checked: bool):
    """The file as parity's runners take it: read through normexport's checks (ours), or as it is
    (the anchor's: onnxruntime-genai writes contrib ops such as SimplifiedLayerNormalization in the
    default domain, which onnx.checker refuses and onnxruntime runs)."""
    import onnx

    from ..parity import runners

    if checked:
        return runners._ModelSource(str(onnx_path))
    source = runners._ModelSource.__new__(runners._ModelSource)
    source._tmp, source.path, source.label = None, str(onnx_path), str(onnx_path)
    source.proto = onnx.load(str(onnx_path), load_external_data=False)
    return source


def agreement(onnx_path, label: str, prompt, path, eager_logits, empty_past, checked: bool = True) -> Agreement:
    """The file at `onnx_path` along eager's path (teacher forced), then greedy on its own;
    `empty_past`: the cache of length 0 (the model's layout: the anchor's file names its head size
    by a symbol)."""
    from ..parity import runners

    n, tokens = prompt.shape[1], path.shape[1] - prompt.shape[1]
    a = Agreement(label=label, steps=tokens)
    source = _source(onnx_path, checked)
    runner = runners.runner_for("ort", source)
    try:
        runner.activate()
        got = _steps(runner, source.proto, path[:, :n], tokens, empty_past, lambda k, logits: path[:, n + k:n + k + 1])
        cos, top = [], 0
        for k in range(tokens):
            have, want = got[k], eager_logits[k].astype(np.float64)
            cos.append(float((have * want).sum() / max(np.linalg.norm(have) * np.linalg.norm(want), 1e-300)))
            top += int(np.argmax(have, axis=-1)[0] == int(path[0, n + k]))
        a.top1, a.cosine_mean, a.cosine_min = top / tokens, float(np.mean(cos)), float(np.min(cos))
        own = _steps(runner, source.proto, prompt, tokens, empty_past,
                     lambda k, logits: torch.tensor([[int(np.argmax(logits[0]))]]))
        own = [int(np.argmax(l[0])) for l in own]
        want = path[0, n:].tolist()
        a.greedy_equal = sum(x == y for x, y in zip(own, want))
        a.greedy_prefix = next((i for i, (x, y) in enumerate(zip(own, want)) if x != y), tokens)
    except Exception as e:  # noqa: BLE001 - said in the table, the verdict fails
        a.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
    finally:
        runner.deactivate()
        source.close()
        gc.collect()
    return a


def _steps(runner, proto, prompt, tokens: int, empty_past, next_ids) -> list[np.ndarray]:
    """`tokens` steps of the file from `prompt` (batch 1), its cache fed back; the ids of step k + 1
    are next_ids(k, step k's last logits): eager's token (teacher forcing) or the file's own argmax.
    The last position's logits of each step, float64 [1, vocab]."""
    from ..parity._util import _graph_inputs
    from ..parity.generate import _feeds, _tensor

    names = [i.name for i in _graph_inputs(proto)]
    past_names = [i.name for i in _graph_inputs(proto) if i.name.startswith("past_key_values.")]
    past = [p.float() for p in empty_past]
    n, ids, out = prompt.shape[1], prompt, []
    for k in range(tokens):
        plen = 0 if k == 0 else n + k - 1
        feeds = dict(zip(["input_ids", "attention_mask", "position_ids"] + past_names,
                         _feeds(None, ids, plen, ids.shape[1], 1, past)))
        outs = runner.infer([feeds[name] for name in names])
        last = np.asarray(outs[0], dtype=np.float64)[:, -1]
        out.append(last)
        ids = next_ids(k, last)
        past = [_tensor(o) for o in outs[1:]]
    return out


def eager_reference(lm) -> tuple:
    """What the verdict needs of eager fp32 (`lm`, a normexport.llm FlatCacheLM): the prompt, eager's
    greedy path, its per-step logits and the empty cache; the model can be released after this."""
    prompt, path, eager_logits = eager_path(lm)
    return prompt, path, eager_logits, [t.float() for t in lm.layout.empty(1, 0, dtype=torch.float32)]


def judge_llm(onnx_path, lm, anchor=None, anchor_note: str | None = None, label: str = "normexport int4") -> LLMVerdict:
    """The LLM verdict of the file at `onnx_path` against eager fp32 (`lm`, a normexport.llm
    FlatCacheLM, or eager_reference(lm) taken before); `anchor`: the path of the anchor's model
    file, judged on the same prompt."""
    prompt, path, eager_logits, empty = lm if isinstance(lm, tuple) else eager_reference(lm)
    v = LLMVerdict(ours=agreement(onnx_path, label, prompt, path, eager_logits, empty), anchor_note=anchor_note)
    if anchor is not None:
        v.anchor = agreement(anchor, "onnxruntime-genai int4", prompt, path, eager_logits, empty, checked=False)
    return decide(v)


def decide(v: LLMVerdict) -> LLMVerdict:
    """The rule of docs/design.md §15 applied to the numbers in `v`."""
    o, a = v.ours, v.anchor
    v.failures = []
    if o.error:
        v.failures.append(f"the file did not run: {o.error}")
        return v
    if a is not None and a.error is None:
        s = LLM_SLACK
        v.rule = (f"at least as close to eager as the anchor: top-1 >= anchor's - {s['top1']:.3g}, mean cosine >= "
                  f"anchor's - {s['cosine_mean']:g}, greedy tokens equal >= anchor's - {s['greedy_equal']}")
        if o.top1 < a.top1 - s["top1"] - 1e-12:
            v.failures.append(f"top-1 agreement {o.top1:.3f} < the anchor's {a.top1:.3f} - {s['top1']:.3g}")
        if o.cosine_mean < a.cosine_mean - s["cosine_mean"]:
            v.failures.append(f"mean logit cosine {o.cosine_mean:.5f} < the anchor's {a.cosine_mean:.5f} - {s['cosine_mean']:g}")
        if o.greedy_equal < a.greedy_equal - s["greedy_equal"]:
            v.failures.append(f"greedy tokens equal {o.greedy_equal} < the anchor's {a.greedy_equal} - {s['greedy_equal']}")
        return v
    t = LLM_THRESHOLDS
    v.rule = (f"no anchor: top-1 >= {t['top1']}, mean cosine >= {t['cosine_mean']}, smallest cosine >= "
              f"{t['cosine_min']} (greedy tokens shown, not judged without an anchor)")
    if o.top1 < t["top1"]:
        v.failures.append(f"top-1 agreement {o.top1:.3f} < {t['top1']}")
    if o.cosine_mean < t["cosine_mean"]:
        v.failures.append(f"mean logit cosine {o.cosine_mean:.5f} < {t['cosine_mean']}")
    if o.cosine_min < t["cosine_min"]:
        v.failures.append(f"smallest logit cosine {o.cosine_min:.5f} < {t['cosine_min']}")
    return v


@dataclasses.dataclass
class OutputVerdict:
    kind: str
    rows: list = dataclasses.field(default_factory=list)  # per output: name, cosine, psnr, max_err, vs float file
    failures: list = dataclasses.field(default_factory=list)
    rule: str = ""

    @property
    def passed(self) -> bool:
        return bool(self.rows) and not self.failures

    def table(self) -> str:
        lines = [f"quantized check ({self.kind}): each output against eager fp32 on convert's inputs",
                 f"{'output':<24} {'cosine':>9}  {'psnr dB':>8}  {'max_err':>9}  {'float file max_err':>18}"]
        for r in self.rows:
            lines.append(f"{r['output']:<24} {r['cosine']:>9.5f}  {r['psnr']:>8.2f}  {r['max_err']:>9.3g}  "
                         f"{r['float_max_err'] if r['float_max_err'] is not None else '-':>18}")
        return _close(lines, self.rule, self.failures, self.passed)

    def to_dict(self) -> dict:
        return {"passed": self.passed, "kind": self.kind, "rule": self.rule, "rows": self.rows, "failures": self.failures}


def compare_outputs(got: list, want: list, names: list, kind: str, float_got: list | None = None) -> OutputVerdict:
    """Per output: cosine, PSNR (against eager's peak) and max error of `got` against eager's `want`."""
    t = OUTPUT_THRESHOLDS[kind]
    v = OutputVerdict(kind=kind, rule=f"every output: cosine >= {t['cosine']} and PSNR >= {t['psnr']} dB against eager fp32")
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g, dtype=np.float64).ravel(), np.asarray(w, dtype=np.float64).ravel()
        if g.shape != w.shape:
            v.failures.append(f"output {i}: shape {g.shape} vs eager's {w.shape}")
            continue
        err = np.abs(g - w)
        cos = float((g * w).sum() / max(np.linalg.norm(g) * np.linalg.norm(w), 1e-300))
        mse = float((err ** 2).mean()) if err.size else 0.0
        peak = float(np.abs(w).max()) if w.size else 0.0
        psnr = math.inf if mse == 0 else 10 * math.log10(peak ** 2 / mse) if peak > 0 else -math.inf
        fe = None
        if float_got is not None:
            fe = float(np.abs(np.asarray(float_got[i], dtype=np.float64).ravel() - w).max())
        name = names[i] if i < len(names) else f"output {i}"
        v.rows.append({"output": name, "cosine": cos, "psnr": psnr, "max_err": float(err.max()) if err.size else 0.0,
                       "float_max_err": fe})
        if not np.isfinite(g).all():
            v.failures.append(f"{name}: not finite")
        elif cos < t["cosine"] or psnr < t["psnr"]:
            v.failures.append(f"{name}: cosine {cos:.5f}, PSNR {psnr:.2f} dB (limits {t['cosine']}, {t['psnr']} dB)")
    return v


def judge_outputs(onnx_path, module, inputs, names, kind: str, float_path=None) -> OutputVerdict:
    """The quantized file at `onnx_path` on `inputs` against eager fp32 `module` (and the float file
    at `float_path`, where given)."""
    from ..parity import runners
    from ..parity._util import _flatten

    f32 = tuple(t.float() if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs)
    mod = module.float() if any(p.dtype != torch.float32 for p in module.parameters() if p.is_floating_point()) else module
    with torch.no_grad():
        want = [t.detach().float().numpy() for t in _flatten(mod(*f32)) if torch.is_tensor(t)]

    def run(path):
        src = runners._ModelSource(str(path))
        try:
            with runners.runner_for("ort", src) as r:
                return [np.asarray(o, dtype=np.float32) for o in r.infer(list(inputs))]
        finally:
            src.close()

    got = run(onnx_path)
    float_got = run(float_path) if float_path is not None else None
    import onnx

    out_names = [o.name for o in onnx.load(str(onnx_path), load_external_data=False).graph.output]
    return compare_outputs(got, want, out_names, kind, float_got)
