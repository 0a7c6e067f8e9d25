"""MODEL as a `save_pretrained` folder of transformers or diffusers (config.json + weights).

Loaded offline (local files only, no hub access), with the class the config names, looked up in
the library itself (never imported from a name in the file). Example inputs fit the model class:
token ids for language models, latents + timestep + conditioning for diffusion transformers,
built from the config's sizes; `--input` overrides them by forward parameter name.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import warnings
from pathlib import Path

import torch

from ..errors import UsageError, first_line
from . import checkpoint_keys, entries
from ._util import refuse_meta_tensors, without_cache
from .call import CallAdapter
from .examples import BATCH, BATCH_LOOP, BATCHED, MASK_READ_AS_VALUES, derive, forward_parameters, make_one, \
    missing_message
from .folder_files import folder_sizes
from .probe import settle
from .inputs import make_inputs
from .model import LoadedModel, generates


def load_folder(path: Path, probe_generating: bool = True, user_inputs: bool = False):
    model, library = load_module(path)
    model._normexport_folder_sizes = folder_sizes(path)  # what the processor / generation configs say (examples)
    return library_model(model, library, "pretrained", probe_generating=probe_generating, user_inputs=user_inputs)


def load_module(path: Path):
    """(the model of a save_pretrained folder, its library), in the dtype its weights are stored in."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UsageError(f"'{path}' is a directory without config.json: pass a save_pretrained folder of transformers "
                         "or diffusers, a .pt2, .pt/.pth file or `package.module:callable`")
    from ..jsonfile import read_json_object

    config = read_json_object(config_file, "re-save the model with save_pretrained")
    if "_diffusers_version" in config or "_class_name" in config:
        library, class_name = "diffusers", config.get("_class_name")
    else:
        library, class_name = "transformers", (config.get("architectures") or [None])[0]
    if not isinstance(class_name, str) or not class_name.isidentifier():
        key = "_class_name" if library == "diffusers" else "architectures"
        raise UsageError(f"'{config_file}' names no model class ('{key}'): re-save the model with save_pretrained")
    if importlib.util.find_spec(library) is None:
        raise UsageError(f"'{path}' is a {library} folder but {library} is not installed: pip install {library}")
    cls = getattr(importlib.import_module(library), class_name, None)
    if cls is None:
        raise UsageError(f"'{path}' names {class_name}, which this {library} does not have: "
                         f"upgrade {library} or re-save the model with this version")
    return _from_pretrained(cls, path), library


def library_of(module) -> str | None:
    """"transformers" / "diffusers" when the module is a model class of that library (whatever
    loaded it: a folder, a factory, a pickle), else None."""
    import sys

    for name, base in (("transformers", "PreTrainedModel"), ("diffusers", "ModelMixin")):
        lib = sys.modules.get(name)  # a model of the library has imported it
        if lib is not None and isinstance(module, getattr(lib, base, ())):
            return name
    return None


def library_model(module, library: str, kind: str, probe_generating: bool = True,
                  user_inputs: bool = False) -> LoadedModel:
    """A transformers / diffusers model called as a folder's is (docs/design.md §4): example inputs derived
    from its forward and config (examples.derive), the batch dynamic, notes for the classes whose
    forward fixes sizes; the inputs it cannot make are left to --input / --inputs.
    `probe_generating=False`: a model that generates (model.generates) is returned with its derived
    inputs not yet run in eager and `LoadedModel.probe` set (convert exports such a model with its
    KV cache and inputs of its own: the two forwards of the probe would be thrown away).
    `user_inputs=True` (--input / --inputs given): nothing is made or run here; the user's call is
    read first and only the parameters it leaves out are derived (with_inputs), so inputs of
    normexport's making that the forward refuses never stand in the way of the user's."""
    class_name = type(module).__name__
    config = getattr(module, "config", None)
    if library == "transformers" and config is not None:
        without_cache(config)  # no KV cache objects among the outputs (the cache is --task's business)
    module._normexport_library = library  # for derive() once the user's inputs are known
    if user_inputs and not (library == "transformers" and generates(module)):  # a causal LM: llm.resolve's
        return LoadedModel(_Pending(module), kind, None, None, None, missing=[])
    args, missing = derive(module, library)
    if missing:  # the user gives them (--input / --inputs); the error names them only if not
        return LoadedModel(_Pending(module), kind, None, None, None, missing=missing)
    probe = None
    if not probe_generating and library == "transformers" and generates(module):
        args = entries.plain(_in_stored_dtype(module, args))
        probe = lambda: library_model(module, library, kind)  # noqa: E731
    else:
        try:
            args = checked(module, library, _in_stored_dtype(module, args), free=getattr(args, "free", None),
                           others=getattr(args, "others", None))
        except UsageError as e:
            if library != "diffusers" or kind != "pretrained":
                raise
            # a denoiser folder alone: its call is then recorded from a pipeline class that takes it
            # (resolve.call_for, standin.driven); this refusal stands when none does
            return LoadedModel(_Pending(module, refusal=str(e)), kind, None, None, None, missing={})
    adapter = CallAdapter(module, (), args)
    dynamic = {**documented_batch(module, args), **batched_axes(args)}
    notes = []
    if class_name in MASK_READ_AS_VALUES:
        dynamic = {}
        notes.append(fixed_by_mask_note(class_name, args))
    elif class_name in BATCH_LOOP:
        dynamic = {name: [a for a in axes if a != 0] for name, axes in dynamic.items()}
        dynamic = {name: axes for name, axes in dynamic.items() if axes}
        notes.append(f"{class_name}: {BATCH_LOOP[class_name]}, so the file has a static batch ({BATCH} unless --input gives another; no "
                     f"exporter keeps it dynamic); for batch size B export one file per size: "
                     + " ".join(f"--input {_spec(n, t)}" for n, t in args.items() if hasattr(t, "shape")))
    return LoadedModel(adapter, kind, adapter.example_inputs, adapter.input_names, dynamic or None, notes=notes,
                       probe=probe)


def checked(module, library: str, args: dict, given=(), free=None, others=None) -> dict:
    """The derived inputs after one eager forward accepted them (probe.settle: an alternative
    tried for the parameter an error is about; a refusal naming it and --input / --inputs)."""
    def remake(name, kwargs):
        value = make_one(module, library, name, kwargs)
        return _in_stored_dtype(module, {name: value})[name] if value is not None else None

    return settle(module, args, remake, given=given, free=free, others=others)


class _Pending(CallAdapter):
    """A folder's model whose example inputs the user must give: the call is made by with_inputs."""

    def __init__(self, inner, refusal: str | None = None):
        torch.nn.Module.__init__(self)
        self.inner = inner
        self.refusal = refusal  # the eager forward refused the derived inputs (standin.driven tries a pipeline)

    def forward(self, *tensors):
        raise RuntimeError("the inputs of this model are not known yet")


def _in_stored_dtype(module, args: dict) -> dict:
    """A folder loaded in its stored half dtype: floating example inputs alike."""
    dt = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    if dt in (torch.float16, torch.bfloat16):
        return {k: v.to(dt) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in args.items()}
    return args


def documented_batch(module, args: dict) -> dict[str, list[int]]:
    """The batch axis of each tensor input whose documented shape starts with the batch (docs),
    e.g. Whisper's input_features `(batch_size, ...)`."""
    from .dims import BATCH_NAMES
    from .docs import params

    documented = params(module)
    out = {}
    for name, t in args.items():
        doc = documented.get(name)
        if isinstance(t, torch.Tensor) and doc is not None and doc.dims and doc.dims[0].lower() in BATCH_NAMES \
                and t.dim() >= 1 and int(t.shape[0]) > 1:
            out[name] = [0]
    return out


def batched_axes(args: dict) -> dict[str, list[int]]:
    """Dynamic axes of a folder model's inputs by parameter: the batch of every batched input (and
    the sequence of token ids); an axis of size 1 stays static (torch.export specializes it)."""
    from .entries import value_count

    out = {}
    for name, t in args.items():
        # batched by name: the latents, text and mask inputs, and the micro-conditioning values
        # (original_size, crop_coords: entries.value_count), made batch first
        if (name not in BATCHED and value_count(name) is None) or not isinstance(t, torch.Tensor):
            continue
        axes = [0, 1] if name in ("input_ids", "attention_mask", "decoder_input_ids", "token_type_ids") else [0]
        axes = [a for a in axes if a < t.dim() and int(t.shape[a]) > 1]
        if axes:
            out[name] = axes
    batches = {int(args[n].shape[0]) for n in out}
    for name, d in args.items():  # a dict parameter's entries (added_cond_kwargs): batch first, as entries makes them
        if isinstance(d, dict) and len(batches) == 1:
            out.update({f"{name}.{k}": [0] for k, t in d.items() if isinstance(t, torch.Tensor) and t.dim() >= 1
                        and int(t.shape[0]) in batches and int(t.shape[0]) > 1})
    return out


def _spec(name: str, t, batch: str = "B") -> str:
    """--input NAME:DIMS[:DTYPE] of an example tensor, its batch axis written `batch`."""
    dims = "x".join([batch] + [str(d) for d in t.shape[1:]])
    dtype = str(t.dtype).replace("torch.", "")
    return f"{name}:{dims}" + ("" if dtype == "float32" else f":{dtype}")


def fixed_by_mask_note(class_name: str, args: dict) -> str:
    """What a file of a class whose forward reads the text mask's values is fixed to."""
    sizes = ", ".join(f"{n} {'x'.join(map(str, t.shape))}" for n, t in args.items() if hasattr(t, "shape"))
    mask = args.get("encoder_attention_mask")
    valid = "all ones" if mask is not None and bool(mask.all()) else "these values"
    return (f"{class_name} reads encoder_attention_mask's values in python (mask.sum(1).tolist() sizes its joint "
            f"sequence and rotary positions): the file is fixed to static shapes ({sizes}) and to the example "
            f"mask ({valid}: its sequence layout assumes every text token valid; a mask with padding gives wrong "
            f"results): fill prompts to the full text length, export other sizes with --input NAME:DIMS")


def _from_pretrained(cls, path: Path):
    saved = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    _quiet_progress(cls.__module__.split(".", 1)[0])
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = _load_weights(cls, path)
    except UsageError:  # the checkpoint and config.json disagree (checkpoint_keys): its own line
        raise
    except Exception as e:
        raise UsageError(f"cannot load '{path}' as {cls.__name__} ({first_line(e, 160)}): "
                         "check that the folder holds config.json and its weights (save_pretrained)") from None
    finally:
        logging.disable(previous)
        if saved is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved
    refuse_meta_tensors({"": model}, f"cannot load '{path}' as {cls.__name__}",
                        "the folder's weights lack them: re-save the model with save_pretrained")
    config = getattr(model, "config", None)
    if config is not None:
        without_cache(config)  # no KV cache objects among the outputs
    return model.eval()


def _stored_dtype(path: Path):
    """The floating dtype the folder's safetensors hold (read from a file header, no tensor
    loaded), when it is float16 / bfloat16; else None."""
    try:
        import torch
        from safetensors import safe_open

        first = next(iter(sorted(path.glob("*.safetensors"))), None)
        if first is None:
            return None
        with safe_open(str(first), framework="pt") as f:
            for key in f.keys():
                dt = {"BF16": torch.bfloat16, "F16": torch.float16}.get(f.get_slice(key).get_dtype())
                if dt is not None:
                    return dt
    except Exception:  # noqa: BLE001 - then the library's default
        return None
    return None


def _load_weights(cls, path: Path):
    """from_pretrained in the dtype the folder stores (transformers' "auto"; diffusers is given the
    float16 / bfloat16 of its safetensors, else loads float32): a bf16 DiT of 8 GiB is not held
    as 16 GiB of float32 (docs/design.md §8). diffusers without accelerate refuses a class with
    `_keep_in_fp32_modules` ("low_cpu_mem_usage cannot be False when keep_in_fp32_modules is
    True"): those classes load in float32 with the list set aside for the load, then restored (a
    cast to float16 / bfloat16 keeps those modules in float32: normexport.load.resolve.cast)."""
    kwargs = {}
    if cls.__module__.startswith("diffusers") and (stored := _stored_dtype(path)) is not None:
        kwargs["torch_dtype"] = stored
    return load_checked(cls, path, f"'{path}' ({cls.__name__})", **kwargs)


def load_checked(cls, path: Path, what: str, **kwargs):
    """cls.from_pretrained(path, **kwargs), the checkpoint's keys judged against the model's
    (checkpoint_keys: one line, or under --allow-random-weights said on stderr); a class with
    `_keep_in_fp32_modules` that diffusers refuses without accelerate loads in float32 with the
    list set aside for the load (`_load_weights`)."""
    try:
        return checkpoint_keys.from_pretrained(cls, path, what, **kwargs)
    except UsageError:
        raise
    except ValueError as e:
        keep = cls.__dict__.get("_keep_in_fp32_modules")
        if "keep_in_fp32_modules" not in str(e) or not keep:
            raise
    cls._keep_in_fp32_modules = None
    try:
        rest = {k: v for k, v in kwargs.items() if k not in ("torch_dtype", "dtype")}
        model = checkpoint_keys.from_pretrained(cls, path, what, **rest)
    finally:
        cls._keep_in_fp32_modules = keep
    return model


def _quiet_progress(library: str) -> None:
    """No progress bars on the terminal while the weights load."""
    try:
        importlib.import_module(f"{library}.utils.logging").disable_progress_bar()
    except (ImportError, AttributeError):
        pass


def with_inputs(loaded, specs=(), args: tuple = (), kwargs: dict | None = None):
    """A pretrained model called with the user's inputs by forward parameter name: the --inputs
    file's (args, kwargs) bound to the forward's parameters, then each --input over them; the
    parameters neither gives are derived (examples.derive, at the user's batch), and what still
    cannot be made is the one-line error naming --input / --inputs / normexport.capture."""
    module = loaded.module.inner
    params = forward_parameters(module)
    unknown = [s.name for s in specs if s.name not in params]
    if unknown:
        raise UsageError(f"--input {unknown[0]} is not a parameter of {type(module).__name__}.forward: "
                         f"use one of {', '.join(p for p in params if p not in ('self', 'kwargs'))[:200]}")
    given = bind(module, args, kwargs or {})
    given.update(zip([s.name for s in specs], make_inputs(specs)))
    library = getattr(module, "_normexport_library", "transformers")
    out, missing = derive(module, library, given)
    if missing:
        raise UsageError(missing_message(type(module).__name__, missing))
    derived = [n for n in out if n not in given]
    free, others = getattr(out, "free", None), getattr(out, "others", None)
    out = {**_in_stored_dtype(module, {n: v for n, v in out.items() if n in derived}),
           **{n: v for n, v in out.items() if n not in derived}}
    out = checked(module, library, out, given=list(given), free=free, others=others)
    out = {p: out[p] for p in params if p in out}  # forward order
    return CallAdapter(module, (), out)


def bind(module, args: tuple, kwargs: dict) -> dict:
    """(args, kwargs) of a call as {parameter: value} by the forward's signature; a call the
    signature refuses is one line naming the --inputs file's mismatch."""
    import inspect

    if not args:
        return dict(kwargs)
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    except TypeError as e:
        raise UsageError(f"the --inputs call does not fit {type(module).__name__}.forward ({e}): record the call "
                         "of this model (normexport.capture)") from None
    out = {}
    for name, value in bound.arguments.items():
        prm = bound.signature.parameters[name]
        if prm.kind == prm.VAR_KEYWORD:
            out.update(value)
        elif prm.kind == prm.VAR_POSITIONAL:
            raise UsageError(f"the --inputs call passes *{name} to {type(module).__name__}.forward, which normexport "
                             "cannot name: give them by keyword")
        else:
            out[name] = value
    return out
