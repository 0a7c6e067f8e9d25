"""`--task` of `normexport convert` (DESIGN §10): which graph a causal-LM folder exports.

- `text-generation-with-past` (default for a causal LM): `CacheLM`, the model with its KV cache as
  inputs / outputs, one graph for prefill and decode.
- `text-generation`: the plain `input_ids -> logits` graph (as before this task existed).

Any other model has no task (`--task` is then an error naming why).
"""

from __future__ import annotations

from ..errors import UsageError
from ..load.model import LoadedModel
from .cache import CacheLM

WITH_PAST = "text-generation-with-past"
PLAIN = "text-generation"
TASKS = (WITH_PAST, PLAIN)


def causal_lm(loaded: LoadedModel):
    """The transformers causal LM a loaded folder holds, else None."""
    if loaded.kind != "pretrained":
        return None
    model = getattr(loaded.module, "inner", None)
    if model is None or not type(model).__module__.startswith("transformers"):
        return None
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    try:
        generates = bool(model.can_generate())
    except Exception:  # noqa: BLE001
        generates = False
    return model if generates else None


def resolve(loaded: LoadedModel, task: str | None, module_name: str | None, input_args: list[str]):
    """(task or None, loaded model to export, --input flags left for the generic path).

    With the cache, `--input input_ids:BxS` sets batch and sequence of the export example and
    `--input attention_mask:BxT` the past length (T - S); no other input may be given."""
    if task is not None and task not in TASKS:
        raise UsageError(f"unknown --task '{task}': use one of {', '.join(TASKS)}")
    model = causal_lm(loaded)
    if model is None:
        if task is not None:
            raise UsageError(f"--task {task} applies to a transformers causal-LM folder (a model that generates), "
                             "not to this model: leave --task out")
        return None, loaded, input_args
    if task is None:
        task = PLAIN if module_name else WITH_PAST
    if task == PLAIN:
        return task, loaded, input_args
    if module_name:
        raise UsageError(f"--module exports one block, which has no cache of its own: use --task {PLAIN} with --module")
    lm = CacheLM(model)
    sizes = _sizes(input_args)
    inputs = lm.example_inputs(**sizes)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is not None:
        inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    wrapped = LoadedModel(lm, "pretrained-with-past", inputs, list(lm.input_names), lm.dynamic_axes(),
                          output_names=list(lm.output_names), notes=list(loaded.notes))
    return task, wrapped, []


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
