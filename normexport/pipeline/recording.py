"""A diffusers pipeline run to its end with every neural component recorded (docs/convert.md, "A
pipeline folder out"): the first call of each component's forward, and of an autoencoder's
`decode` / `encode` (the VAE decoder and encoder slots, named as optimum names them), exactly as
the pipeline made it. The same generic call as `normexport convert PIPELINE_DIR` uses
(normexport.load.pipeline.call_arguments), run twice — at the small size, and one latent unit
larger with two images per prompt — so that the dims that vary between the runs (batch, latent
size, token count) are the dims each file keeps dynamic, whatever the model family.

A diffusers model whose attention processors the pipeline switches inside its own call (the PAG
pipelines, pag_utils.PAGMixin: the perturbed layers' processors set before the denoising loop,
restored after it) is recorded per processor state: a call made with processors other than the
model's own (by class, per layer) is a slot of its own, `<component>_<processor classes>`, whose
file is exported with those processors set (exporting.py) and which the loaded pipeline runs
while its component holds them (runtime.py). A PAG pipeline is run a second time in each run with
`pag_scale=0`, so that the call without perturbed attention (the model's own processors, the
batch of plain guidance) is recorded too.

A component called with different sets of arguments in one run (StableAudio's projection_model:
`text_hidden_states` in encode_prompt, `start_seconds` / `end_seconds` in encode_duration) is
recorded per argument set (the parameters given a tensor, `arguments_given`): the first set keeps the
slot's name, each other one is a slot of its own, `<slot>_<its arguments>`, exported from its own
first call; the loaded component runs the file of the arguments it is called with (runtime.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import sys
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..capture import save
from ..errors import UsageError, first_line
from ..load import pipeline as folder_pipeline
from ..load._util import quiet
from . import batching

#: autoencoder methods the pipeline calls instead of forward: the slot's suffix, and the input names
#: optimum's ORTDiffusionPipeline feeds (`latent_sample` for the decoder, `sample` for the encoder)
METHODS = {"decode": ("decoder", {"z": "latent_sample"}), "encode": ("encoder", {"x": "sample"})}
#: the VAE encoder file's output: the latent distribution's parameters (optimum's name)
LATENT_PARAMETERS = "latent_parameters"


@dataclasses.dataclass
class Slot:
    """One exported file: `component` (model_index.json's name) called through `method`."""
    name: str
    component: str
    method: str
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    shapes: list = dataclasses.field(default_factory=list)  # per call, every run's: {input path: shape}
    renames: dict = dataclasses.field(default_factory=dict)  # method parameter -> file input name
    single: tuple | None = None  # (args, kwargs) of the one-prompt run's call
    at_size: int | None = None  # shapes[:at_size]: the calls at the converted image size (the rest: one size up)
    batch: dict = dataclasses.field(default_factory=dict)  # what follows the batch (pipeline/batching.recorded)
    processors: dict = dataclasses.field(default_factory=dict)  # {layer path: processor} not the model's own (module doc)
    arguments: tuple = ()  # the method's parameters given a tensor in this slot's calls (module doc)

    def batch_axes(self) -> dict[str, list[int]]:
        """{input path: [0]} for the recorded tensors whose first axis follows the batch (and is
        over 1 in the call the file is exported from: a size-1 axis cannot stay dynamic); empty where
        a list's length follows the batch: the file holds that many list inputs, so the tensors of
        the same batch are fixed with it (load() serves other batches in pieces, batching.py)."""
        if self.batch.get("lists"):
            return {}
        first = self.shapes[0] if self.shapes else {}
        return {self.renames.get(p.split(".")[0], p.split(".")[0]) + p[len(p.split(".")[0]):]: [0]
                for p in self.batch.get("inputs", []) if first.get(p) and first[p][0] > 1}

    def dynamic(self, at_size: bool = False) -> dict[str, list[int]]:
        """{input path: axes whose size differs between the recorded calls (of one run, as Sana's
        text encoder for the prompt with its instruction and for the negative prompt, or of two)};
        `at_size`: between the calls at the converted image size only (batch, text length: not the
        latent's size)."""
        shapes = self.shapes[:self.at_size] if at_size and self.at_size is not None else self.shapes
        if len(shapes) < 2:
            return {}
        first, *rest = shapes
        out = {}
        for name, shape in first.items():
            others = [r.get(name) for r in rest]
            if any(o is None or len(o) != len(shape) for o in others):
                continue
            axes = [i for i, d in enumerate(shape) if any(o[i] != d for o in others)]
            if axes:
                out[self.renames.get(name.split(".")[0], name.split(".")[0]) +
                    name[len(name.split(".")[0]):]] = axes
        return out


def slot_name(component: str, method: str) -> str:
    """optimum's folder names: `vae` -> `vae_decoder` / `vae_encoder`; forward keeps the name."""
    if method == "forward":
        return component
    return f"{component}_{METHODS[method][0]}"


class _Run:
    """The hooks of one run: first calls per slot, the shapes of every call."""

    def __init__(self, modules: dict[str, nn.Module], signatures: dict | None = None):
        self.modules = modules
        # per slot, the argument sets its calls gave, in the order first seen (shared by the runs of one
        # recording, so that each run names a call's slot the same)
        self.signatures = {} if signatures is None else signatures
        self.own = {n: processor_classes(m) for n, m in modules.items()}  # each model's own processors, before any call
        self.slots: dict[str, Slot] = {}
        self.order: list[str] = []
        self.shapes: dict[str, dict] = {}  # the first call's
        self.later: dict[str, list] = {}  # the later calls' shapes that differ from every one seen
        self.decoded: torch.Tensor | None = None  # what the VAE decoded (the final latents, scaled)
        self.latents: torch.Tensor | None = None  # prepare_latents' result (the initial noise)

    @contextlib.contextmanager
    def hooks(self, pipe, first: bool):
        with contextlib.ExitStack() as stack:
            for name, m in self.modules.items():
                stack.callback(m.register_forward_pre_hook(self._forward_hook(name, first), with_kwargs=True).remove)
                for method in METHODS:
                    if callable(getattr(type(m), method, None)) and _is_autoencoder(m):
                        _wrap(stack, m, method, self._method_hook(name, method, m, first))
            if callable(getattr(pipe, "prepare_latents", None)):
                _wrap_result(stack, pipe, "prepare_latents", self._latents_hook)
            yield self

    def _note(self, slot: str, component: str, method: str, bound: dict, args, kwargs, first: bool, renames=None,
              processors=None):
        shapes = {n: list(t.shape) for n, t in _leaves(bound)}
        given = arguments_given(bound, renames)
        slot = signature_slot(slot, given, self.signatures.setdefault(slot, []))
        if slot in self.shapes:
            seen = self.later.setdefault(slot, [])
            if shapes != self.shapes[slot] and shapes not in seen:
                seen.append(shapes)
            return
        self.order.append(slot)
        self.shapes[slot] = shapes
        if first:
            self.slots[slot] = Slot(slot, component, method, _plain(args), _plain(kwargs), renames=renames or {},
                                    processors=processors or {}, arguments=given)

    def _forward_hook(self, name: str, first: bool):
        def hook(module, args, kwargs):
            changed = changed_processors(module, self.own[name])
            self._note(processor_slot(name, changed), name, "forward", bind_call(module.forward, args, kwargs), args,
                       kwargs, first, processors=changed)
        return hook

    def _method_hook(self, name: str, method: str, module: nn.Module, first: bool):
        renames = METHODS[method][1]

        def hook(args, kwargs):
            bound = bind_call(getattr(type(module), method).__get__(module), args, kwargs)  # not the wrapper
            if method == "decode" and self.decoded is None:
                z = bound.get("z", next(iter(bound.values()), None))
                if isinstance(z, torch.Tensor):
                    self.decoded = z.detach().clone()
            # the file's call: by name, optimum's input names, no generator (decode ignores it)
            call = {renames.get(k, k): v for k, v in bound.items() if not isinstance(v, torch.Generator)}
            self._note(slot_name(name, method), name, method, call, (), call, first, renames)
        return hook

    def _latents_hook(self, result):
        if self.latents is None:
            t = result[0] if isinstance(result, tuple) else result
            if isinstance(t, torch.Tensor):
                self.latents = t.detach().clone()


def arguments_given(bound: dict, renames: dict | None = None) -> tuple[str, ...]:
    """The call's signature: the (sorted) parameters of a bound call that hold a tensor (at any depth),
    by the method's own names (`renames`: the file's input names back to them); an argument left out
    or None is not given."""
    back = {v: k for k, v in (renames or {}).items()}
    return tuple(sorted({back.get(n, n) for n, v in bound.items()
                         if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(v))}))


def signature_slot(slot: str, given: tuple, seen: list) -> str:
    """The slot of a call with the argument set `given` (module doc): the slot's first argument set
    keeps its name; any other is a slot of its own, `<slot>_<its arguments>` (StableAudio's
    projection_model: `projection_model` for text_hidden_states, `projection_model_end_seconds_start_seconds`).
    `seen`: the slot's argument sets so far (appended to)."""
    if given not in seen:
        seen.append(given)
    return slot if seen.index(given) == 0 else f"{slot}_{'_'.join(given) or 'no_tensors'}"


def processor_classes(m) -> dict[str, str]:
    """{layer path: processor class name} of a diffusers model's attention processors (its
    `attn_processors`); empty for a module without them."""
    try:
        processors = getattr(m, "attn_processors", None)
    except Exception:  # noqa: BLE001 - a model whose property cannot walk its layers: no processors to follow
        return {}
    return {k: type(v).__name__ for k, v in processors.items()} if isinstance(processors, dict) else {}


def changed_processors(m, own: dict[str, str]) -> dict:
    """{layer path: processor} of the layers whose processor is not of the class `own` (the model's
    own, {path: class name}) names: the state a pipeline switched the model to (module doc)."""
    if not own:
        return {}
    processors = m.attn_processors
    return {k: v for k, v in processors.items() if type(v).__name__ != own.get(k)}


def processor_slot(name: str, changed: dict) -> str:
    """The slot of a component called with the processors `changed` ({} : the component's own name)."""
    if not changed:
        return name
    return f"{name}_" + "_".join(sorted({type(v).__name__ for v in changed.values()}))


def _is_autoencoder(m: nn.Module) -> bool:
    """A diffusers model whose class has `decode` / `encode` (what pipelines call instead of its
    forward: AutoencoderKL, VQModel, LongCatAudioDiTVae...), by what it has, not by its class name;
    a method the pipeline never calls records nothing."""
    import sys

    diffusers = sys.modules.get("diffusers")
    return diffusers is not None and isinstance(m, diffusers.ModelMixin) and \
        any(callable(getattr(type(m), method, None)) for method in METHODS)


def _wrap(stack: contextlib.ExitStack, obj, attr: str, before) -> None:
    """obj.attr(...) calls before(args, kwargs) first; the instance attribute removed on leaving."""
    original = getattr(obj, attr)

    def wrapped(*args, **kwargs):
        before(args, kwargs)
        return original(*args, **kwargs)

    setattr(obj, attr, wrapped)
    stack.callback(lambda: delattr(obj, attr) if attr in vars(obj) else None)


def _wrap_result(stack: contextlib.ExitStack, obj, attr: str, after) -> None:
    original = getattr(obj, attr)

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        after(result)
        return result

    setattr(obj, attr, wrapped)
    stack.callback(lambda: delattr(obj, attr) if attr in vars(obj) else None)


def bind_call(fn, args, kwargs) -> dict:
    """(args, kwargs) by parameter name (a **kwargs parameter's items spread)."""
    try:
        bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return {**{f"input_{i}": a for i, a in enumerate(args)}, **kwargs}
    sig = inspect.signature(fn).parameters
    out = {}
    for k, v in bound.items():
        if sig[k].kind == inspect.Parameter.VAR_KEYWORD:
            out.update(v)
        else:
            out[k] = v
    return out


def _leaves(bound: dict):
    """(dotted path, tensor) of every tensor in a bound call."""
    for path, leaf in pytree.tree_flatten_with_path(bound)[0]:
        if isinstance(leaf, torch.Tensor):
            yield ".".join(key_text(k) for k in path), leaf


key_text = batching.key_text  # the dotted paths of a call's leaves (runtime names its inputs the same way)


def _plain(x):
    """Tensors detached and cloned on the CPU; a torch.Generator (not data) dropped to None."""
    return pytree.tree_map(lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor)
                           else None if isinstance(v, torch.Generator) else v, x)


@dataclasses.dataclass
class Recording:
    pipeline: str
    slots: dict[str, Slot]  # in the order the pipeline first called them
    side: int
    skipped: list[str]  # module components the pipeline never called
    seconds: float
    text_limit: int | None = None  # the pipeline's max_sequence_length default: a padded text axis's length (padding.py)


def record(path: Path, index: dict) -> Recording:
    """Build the pipeline, run it twice to its end (one step each), record every slot."""
    import time

    start = time.perf_counter()
    pipe = folder_pipeline.build(path, index)
    modules = {n: c for n, c in folder_pipeline.registered(pipe).items() if isinstance(c, nn.Module)}
    kwargs, size = folder_pipeline.call_arguments(pipe, modules, path, None)
    side = kwargs.get("height", folder_pipeline.image_side(pipe, modules))
    # three runs: the files are exported from the batch-2 run at the small size (a size-1 dim cannot
    # stay dynamic; a file whose sizes cannot stay dynamic serves the size the pipeline is run at);
    # the batch-1 run and the one-unit-larger run tell which dims vary
    cls = index["_class_name"]
    try:
        runs = _runs(pipe, kwargs, modules, cls, path)
    except UsageError:
        if kwargs.get("num_inference_steps") != 1:
            raise
        # a schedule that cannot be one step long (Mochi's linear-quadratic sigmas divide by steps // 2):
        # the same runs two steps long (every call of a slot is recorded, the first one exported)
        runs = _runs(pipe, {**kwargs, "num_inference_steps": 2}, modules, cls, path)
    first = runs[0][0]
    for name, slot in first.slots.items():
        at_size = call_shapes([r for r, _, _ in runs[:2]], name)
        slot.shapes, slot.at_size = at_size + call_shapes([r for r, _, _ in runs[2:]], name), len(at_size)
        slot.batch = batching.recorded(runs[0][0].shapes[name], runs[1][0].shapes.get(name))
        single = runs[1][0].slots.get(name)
        if single is not None:  # the one-prompt call: a file that cannot keep even the batch dynamic serves it
            slot.single = (single.args, single.kwargs)
    slots = {n: first.slots[n] for n in first.order if n in first.slots}
    called = {s.component for s in slots.values()}
    skipped = [n for n in modules if n not in called]
    limit = inspect.signature(pipe.__call__).parameters.get("max_sequence_length")
    limit = limit.default if limit is not None and type(limit.default) is int and limit.default > 0 else None
    del pipe, modules, first, runs
    gc.collect()
    return Recording(cls, slots, side, skipped, time.perf_counter() - start, limit)


def _runs(pipe, kwargs: dict, modules: dict, cls: str, path: Path) -> list:
    """The three recording runs of record(): (run, call, saved) each."""
    signatures: dict = {}  # one naming of the argument sets for the three runs (_Run)
    runs = [(_Run(modules, signatures), _batched(pipe, kwargs, modules), True),
            (_Run(modules, signatures), _longer(kwargs), True),
            (_Run(modules, signatures), _larger(pipe, kwargs, modules), False)]
    for i, (run, call, saved) in enumerate(runs):
        try:
            try:
                with run.hooks(pipe, first=saved), torch.no_grad(), quiet():
                    for one in [call, *_switched(pipe, call)]:
                        pipe(**one)
            except (ValueError, TypeError):  # a pipeline that takes one image for its prompts (Wan image-to-video
                one_image = _one_image(call)  # checks `image` is a tensor or one PIL image): the prompts' batch alone
                if one_image is None:
                    raise
                run = _Run(modules, signatures)
                with run.hooks(pipe, first=saved), torch.no_grad(), quiet():
                    for one in [one_image, *_switched(pipe, one_image)]:
                        pipe(**one)
                runs[i] = (run, one_image, saved)
        except Exception as e:  # noqa: BLE001 - the pipeline's own error
            steps = call.get("num_inference_steps")
            raise UsageError(f"{cls} from '{path}' failed in its {'one' if steps == 1 else steps}-step run with "
                             f"{_show(call)} ({type(e).__name__}: {first_line(e, 160)}): convert one component with "
                             f"--module NAME, or record its call with normexport.capture") from None
    return runs


def is_pag(pipe) -> bool:
    """A pipeline that switches its denoiser's attention processors in its call (diffusers' PAGMixin,
    module doc); the mixin's module is loaded with any pipeline class built on it."""
    pag = sys.modules.get("diffusers.pipelines.pag.pag_utils")
    return pag is not None and isinstance(pipe, pag.PAGMixin)


def _switched(pipe, call: dict) -> list[dict]:
    """The same call with the pipeline's processor switch off, where it has one (module doc): a PAG
    pipeline with `pag_scale=0`; [] for any other pipeline."""
    if not is_pag(pipe) or "pag_scale" not in inspect.signature(pipe.__call__).parameters:
        return []
    return [_call(call, pag_scale=0.0)]


def call_shapes(runs: list[_Run], name: str) -> list[dict]:
    """Every recorded call's input shapes of slot `name` (the first run's first call first, then
    its later calls of other shapes, then the other runs')."""
    return [s for r in runs if name in r.shapes for s in (r.shapes[name], *r.later.get(name, []))]


def _call(kwargs: dict, **over) -> dict:
    out = {**kwargs, **over}
    if "generator" in out:
        out["generator"] = torch.Generator().manual_seed(0)
    return out


#: what the one-prompt run's prompt adds (several tokens in any tokenizer)
LONGER = ", a red bicycle leaning on a wall at dusk"


def _longer(kwargs: dict) -> dict:
    """The one-prompt run's call: batch 1, the prompt longer than the two-prompt run's, so a text axis that
    follows the prompt (a tokenizer padding to the longest: UMT5 in LongCatAudioDiT, Qwen2.5-VL in
    QwenImage) varies at the converted size and the files keep it dynamic where their exporter can."""
    call = _call(kwargs, output_type="np")
    if isinstance(call.get("prompt"), str):
        call["prompt"] += LONGER
    return call


def _larger(pipe, kwargs: dict, modules: dict) -> dict:
    """One latent unit larger (where the call takes a size), batch 1."""
    call = _call(kwargs, output_type="np")
    if "height" in call and "width" in call:
        unit = folder_pipeline.image_unit(pipe, modules)
        call["height"], call["width"] = call["height"] + unit, call["width"] + unit
    return call


def _batched(pipe, kwargs: dict, modules: dict) -> dict:
    """Two prompts (or two images / videos per prompt: SVD takes no prompt; a class-conditional pipeline: two class
    labels)."""
    params = inspect.signature(pipe.__call__).parameters
    call = _call(kwargs, output_type="np")
    if isinstance(call.get("prompt"), str):  # two prompts: the text encoders' batch is 2 as well
        call["prompt"] = [call["prompt"], call["prompt"]]
        for k in ("image", "mask_image", "control_image"):
            if isinstance(call.get(k), torch.Tensor):
                call[k] = torch.cat([call[k], call[k]])
            elif type(call.get(k)).__module__.startswith("PIL."):  # a PIL image (load.pipeline.call_arguments)
                call[k] = [call[k], call[k]]
    elif "num_images_per_prompt" in params:
        call["num_images_per_prompt"] = 2
    elif "num_videos_per_prompt" in params:  # an image-to-video pipeline without text (SVD): else no batch varies
        call["num_videos_per_prompt"] = 2
    else:
        for n, p in params.items():
            if p.default is p.empty and isinstance(call.get(n), list):
                call[n] = folder_pipeline.required_value(p, modules, count=2)
    return call


def _one_image(call: dict) -> dict | None:
    """The two-prompt call with each image that _batched listed per prompt given once (None: none was)."""
    listed = {k: v[0] for k, v in call.items() if k in ("image", "mask_image", "control_image") and isinstance(v, list)
              and v and type(v[0]).__module__.startswith("PIL.")}
    return {**call, **listed} if listed and isinstance(call.get("prompt"), list) else None


def _show(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "generator" and not isinstance(v, torch.Tensor))


def save_call(slot: Slot, file: Path, single: bool = False) -> Path:
    """The slot's recorded call as an --inputs file (return_dict=False left out: the outputs keep
    their names); `single`: the one-prompt run's call."""
    args, kwargs = slot.single if single and slot.single is not None else (slot.args, slot.kwargs)
    kwargs = {k: v for k, v in kwargs.items() if not (k == "return_dict" and v is False)}
    return save(args, kwargs, file)
