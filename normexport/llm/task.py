"""`--task` of `normexport convert` (docs/design.md §10): which graph a causal LM exports.

- `text-generation-with-past` (default for a causal LM): `CacheLM`, the model with its KV cache as
  inputs / outputs, one graph for prefill and decode.
- `text-generation`: the plain `input_ids -> logits` graph (as before this task existed).

A causal LM is any loaded model that is a transformers model that generates (GenerationMixin,
`can_generate()`), whatever the source: a save_pretrained folder, `package.module:callable`
(+ `--weights`) or a trusted pickle. A causal LM whose cache is not a KV cache CacheLM can carry
(Mamba's SSM state, hybrid models, xLSTM, RWKV: what `cache.probe_layout` sees) defaults to
`text-generation`, said on the first line; asking for the cache is then an error naming why. A
`.pt2` program's call is fixed at export: one that takes a KV cache and returns it grown
(`program.ProgramLM` finds out by running it) exports the cache interface and is checked by
generation (`text-generation-with-past`, its only task); any other program exports its call, and
`--task` on it is an error naming why and the fix. Any other model has no task (`--task` is then
an error naming why).
"""

from __future__ import annotations

import sys

from ..errors import UsageError
from ..load.call import unwrap
from ..load.model import LoadedModel, generates
from . import program
from .cache import CacheLM, NoKVCache, probe_layout

WITH_PAST = "text-generation-with-past"
PLAIN = "text-generation"
TASKS = (WITH_PAST, PLAIN)


def causal_lm(loaded: LoadedModel):
    """The transformers causal LM a loaded model is (or a normexport call adapter around it holds:
    a folder's), else None. The model's own class decides, not its source."""
    model = unwrap(loaded.module)  # a folder's call adapter holds the model
    transformers = sys.modules.get("transformers")  # a transformers model has imported it
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    return model if generates(model) else None


def _pt2_error(loaded: LoadedModel, task: str, why: str | None = None) -> UsageError:
    names = list(loaded.input_names or [])
    shown = ", ".join(names[:4]) + (f", ... ({len(names)} inputs)" if len(names) > 4 else "")
    if task == WITH_PAST and why:
        return UsageError(f"--task {task} does not apply to this .pt2: {why}; export a program that takes the cache "
                          "with its past length dynamic and returns it with the new positions appended, or convert the "
                          "save_pretrained folder or package.module:callable")
    if task == WITH_PAST:
        why = f"the program takes no KV cache (inputs: {shown or 'none'})"
    else:
        why = f"the program's call is fixed at export (inputs: {shown or 'none'}) and --task cannot change it"
    return UsageError(f"--task {task} does not apply to a .pt2: {why}; for the KV-cache graph checked by generation "
                      "convert the save_pretrained folder or the package.module:callable that builds the model")


def resolve(loaded: LoadedModel, task: str | None, module_name: str | None, input_args: list[str]):
    """(task or None, loaded model to export, --input flags left for the generic path, note or None).

    The note (the first output line's tail) says why a model got its task by default (a causal LM
    `text-generation`, a .pt2 `text-generation-with-past`).
    With the cache, `--input input_ids:BxS` sets batch and sequence of the export example and
    `--input attention_mask:BxT` the past length (T - S); no other input may be given."""
    requested = task
    if task is not None and task not in TASKS:
        raise UsageError(f"unknown --task '{task}': use one of {', '.join(TASKS)}")
    if loaded.kind == "exported-program":
        if task == PLAIN or not program.takes_cache(loaded):
            if task is not None:
                raise _pt2_error(loaded, task)
            return None, loaded, input_args, None
        try:  # docs/design.md §10: a program that takes a KV cache and returns it grown exports the cache interface
            lm = program.ProgramLM(loaded)
        except NoKVCache as e:
            if task == WITH_PAST:
                raise _pt2_error(loaded, task, e.reason) from None
            # said, never silent: the file is the program's call, not normexport's KV-cache graph
            loaded.notes.append(f"the program takes tensors beside input_ids but not as a KV cache the file can "
                                f"carry ({e.reason}): the file is the program's fixed call, names as torch.export gave "
                                "them, checked on that call, not by generation")
            return None, loaded, input_args, None
        why = None if task else "the program takes a KV cache and returns it grown, found by running it"
        return WITH_PAST, _with_past(lm, loaded, input_args), [], why
    model = causal_lm(loaded)
    if model is None:
        if task is not None:
            raise UsageError(f"--task {task} applies to a transformers causal-LM folder, factory or pickle (a model "
                             "that generates), not to this model: leave --task out")
        return None, loaded, input_args, None
    if task is None:
        task = PLAIN if module_name else WITH_PAST
    if task == PLAIN:
        return task, loaded, input_args, None
    if module_name:
        raise UsageError(f"--module exports one block, which has no cache of its own: use --task {PLAIN} with --module")
    try:
        layout = probe_layout(model)
    except NoKVCache as e:
        if requested == WITH_PAST:
            raise UsageError(f"--task {WITH_PAST} does not apply: {e.reason}: use --task {PLAIN}") from None
        return PLAIN, loaded, input_args, f"{WITH_PAST} does not apply: {e.reason}"
    return task, _with_past(CacheLM(model, layout), loaded, input_args), [], None


def _with_past(lm, loaded: LoadedModel, input_args: list[str]) -> LoadedModel:
    """The loaded model to export: `lm` (a FlatCacheLM) with example inputs of the sizes --input
    asks for, floating ones in the dtype of its weights (its cache's where it has no floating weights)."""
    inputs = lm.example_inputs(**_sizes(input_args))
    dtype = next((p.dtype for p in lm.parameters() if p.is_floating_point()), lm.layout.dtype)
    inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    return LoadedModel(lm, f"{loaded.kind}-with-past", inputs, list(lm.input_names), lm.dynamic_axes(),
                       output_names=list(lm.output_names), notes=list(loaded.notes))


def _sizes(input_args: list[str]) -> dict:
    from ..load.inputs import parse_input

    sizes: dict = {}
    for text in input_args:
        spec = parse_input(text)
        dims = list(spec.dims)
        if spec.name == "input_ids" and len(dims) == 2:
            sizes["batch"], sizes["sequence"] = dims
        elif spec.name == "attention_mask" and len(dims) == 2:
            sizes["total"] = dims[1]
        else:
            raise UsageError(f"--input {text}: with --task {WITH_PAST} give input_ids:BxS and attention_mask:BxT "
                             f"(T = past + S) only; the cache inputs follow from them")
    total = sizes.pop("total", None)
    if total is not None:
        seq = sizes.get("sequence", 3)
        if total - seq < 2:
            raise UsageError(f"--input attention_mask:..x{total}: the export example needs a past of at least 2 "
                             f"positions (T >= S + 2 = {seq + 2}); the file still serves past length 0 and 1")
        sizes["past"] = total - seq
    for k in ("batch", "sequence"):
        if k in sizes and sizes[k] < 2:
            raise UsageError(f"--input input_ids: the export example needs {k} >= 2 (sizes 0 and 1 are specialised by "
                             "torch.export); the file still serves 1")
    return sizes
