"""MODEL as a diffusers pipeline folder (`model_index.json` + one folder per component, as
`pipe.save_pretrained` writes it; docs/design.md §9): the pipeline is built from the folder offline and
run once — one step, a small image, a generic call — with `normexport.capture` on its components;
the component exported is called with exactly what the pipeline passed it (lists, dicts, ids,
masks, RoPE tables), as `convert COMPONENT_FOLDER --inputs FILE` would be.

Which component: `--module NAME` names one of model_index.json (`--module NAME.sub.module` one of
its submodules, with the inputs it receives in that call); by default the denoiser, found by
running, not by name or class: the component module the pipeline calls last before its
scheduler's first `step` (the model whose output the scheduler steps with; a ControlNet, called
before the denoiser, is not it; text encoders run earlier; the VAE decodes after the loop).

The call, the same for every pipeline class, from its `__call__` signature: `prompt="a photo"`,
`num_inference_steps=1`, `height` / `width` small (64, or the next multiple of the VAE scale
factor × patch size × 2), `output_type="latent"`, `use_resolution_binning=False` (a bin would
replace the small size), a seeded `generator`, and for image-conditioned pipelines `image` /
`control_image` (random, of that size: a PIL image where the annotation names PIL images, as
diffusers' PipelineImageInput does — a pipeline may resize only PIL / numpy images, SVD to its CLIP
encoder's 224 — else a tensor), `mask_image` (half masked), `strength=1.0` — each only
where the signature takes it; guidance and the rest left at the pipeline's defaults. The
recorded call is the pipeline's, less `return_dict=False` (a tuple of the same tensors), so the
outputs keep their names. The run stops at the scheduler's first step (the
default) or at the named component's first call, so the VAE never decodes; then everything but
the exported component is released (text encoders of several GB do not stay beside the denoiser).

The folder is loaded when the call is resolved (`call_for`), since the component and the run
depend on --module / --inputs: `load_pipeline_folder` only reads model_index.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import importlib.util
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from ..capture import Capture, save
from ..errors import UsageError, first_line
from ._util import quiet, refuse_meta_tensors, without_cache
from .call import CallAdapter
from .examples import BATCH_LOOP, MASK_READ_AS_VALUES
from .model import LoadedModel
from .pipeline_parts import load_components
from .pretrained import _stored_dtype, batched_axes, fixed_by_mask_note

KIND = "diffusers-pipeline"
PROMPT = "a photo"
#: the side of the image the pipeline is run at (pixels), rounded up to what the pipeline accepts
SIDE = 64


@dataclasses.dataclass
class ComponentModel(LoadedModel):
    """The exported component of a pipeline folder; `source`: how its inputs were made, `headline`:
    the line convert prints first."""
    headline: str = ""
    source: str = ""


class _Folder(nn.Module):
    """A pipeline folder not built yet (built and run once by `component_call`); `component`: the
    one kept when MODEL was a component folder inside the pipeline repo."""

    def __init__(self, path: Path, index: dict, component: str | None = None):
        super().__init__()
        self.path, self.index, self.component = path, index, component

    def forward(self, *args, **kwargs):
        raise RuntimeError("a diffusers pipeline folder is run when its call is resolved (normexport.load.call_for)")


def is_pipeline_folder(path: Path) -> bool:
    return (path / "model_index.json").is_file()


def component_of_pipeline(path: Path) -> Path | None:
    """The pipeline folder holding `path` as one of its components (repo/transformer/ beside
    repo/model_index.json naming `transformer`), None otherwise."""
    parent = path.resolve().parent
    if not (path / "config.json").is_file() or not is_pipeline_folder(parent):
        return None
    try:
        index = json.loads((parent / "model_index.json").read_text())
    except (OSError, ValueError):
        return None
    return parent if isinstance(index, dict) and path.resolve().name in components(index) else None


def load_pipeline_folder(path: Path, component: str | None = None) -> LoadedModel:
    """The folder, read (model_index.json) but not built: see component_call. `component`: MODEL
    was that component's folder (the pipeline is run for its inputs, and it alone is exported)."""
    index_file = path / "model_index.json"
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read '{index_file}' ({first_line(e, 120)}): re-save the pipeline with "
                         "save_pretrained") from None
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise UsageError(f"'{index_file}' names no pipeline class ('_class_name'): re-save the pipeline with "
                         "save_pretrained")
    if importlib.util.find_spec("diffusers") is None:
        raise UsageError(f"'{path}' is a diffusers pipeline folder but diffusers is not installed: pip install diffusers")
    return LoadedModel(_Folder(path, index, component), KIND)


def components(index: dict) -> list[str]:
    """The component names of model_index.json (those saved with a library and class)."""
    return [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and len(v) == 2
            and all(isinstance(x, str) for x in v)]


@contextlib.contextmanager
def component_call(loaded: LoadedModel, module_name: str | None, inputs_file: str | None):
    """(component's LoadedModel, submodule name left of --module, --inputs file) for a pipeline
    folder: the folder built and run once, the component's first call recorded to a temporary
    --inputs file (removed on leaving); with --inputs, the component named by --module loaded from
    its own folder with the user's file."""
    folder: _Folder = loaded.module
    path, index = folder.path, folder.index
    names = components(index)
    if folder.component is not None:  # MODEL was repo/COMPONENT/: --module names a submodule of it
        module_name = folder.component + (f".{module_name}" if module_name else "")
    component, rest = _split(module_name, names, index, path)
    if inputs_file:
        if component is None:
            models = _module_components(index) or names
            raise UsageError(f"--inputs with a pipeline folder: name the component the file was recorded on with "
                             f"--module (one of {', '.join(models)}), or convert its folder "
                             f"({path / _likely_denoiser(index)})")
        from .pretrained import load_folder

        yield load_folder(path / component, user_inputs=True), rest, inputs_file
        return
    tmp = tempfile.mkdtemp(prefix="normexport-pipeline-")
    try:
        out = record(path, index, component, Path(tmp) / "inputs.pt")
        if folder.component is not None:  # said first: the folder given was run as part of its pipeline
            out.headline = (f"{path / folder.component} is the {folder.component} of the {index['_class_name']} in "
                            f"{path}: ran that pipeline once and kept {folder.component} ({out.headline})")
        yield out, rest, str(Path(tmp) / "inputs.pt")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _split(module_name: str | None, names: list[str], index: dict, path: Path) -> tuple[str | None, str | None]:
    if not module_name:
        return None, None
    head, _, rest = module_name.partition(".")
    if head not in names:
        raise UsageError(f"--module {module_name}: the pipeline in '{path}' has no component '{head}': name one of "
                         f"model_index.json's ({', '.join(names)}), optionally with a submodule "
                         f"(e.g. {_likely_denoiser(index)}.<submodule>)")
    return head, rest or None


class _Reached(Exception):
    """Ends the pipeline run: the scheduler's first step, or the named component's first call."""


class _Finished(Exception):
    """The pipeline ran to its end (so that every capture exits the same way)."""


def record(path: Path, index: dict, component: str | None, file: Path) -> ComponentModel:
    """Build the pipeline, run it once, save the component's first call to `file`; the component
    as a LoadedModel whose call resolve makes from that file (docs/design.md §9)."""
    cls_name = index["_class_name"]
    start = time.perf_counter()
    pipe = build(path, index, component)
    parts = registered(pipe)
    modules = {n: c for n, c in parts.items() if isinstance(c, nn.Module)}
    if component is not None and component not in modules:
        raise UsageError(f"--module {component}: that component of {cls_name} is a "
                         f"{type(parts.get(component)).__name__}, not a torch module: name one of "
                         f"{', '.join(modules)}")
    kwargs, size = call_arguments(pipe, modules, path, component)
    hatch = _escape(path, component or _likely_denoiser(index))
    schedulers = [c for c in parts.values() if callable(getattr(c, "step", None)) and not isinstance(c, nn.Module)]
    if component is None and not schedulers:
        raise UsageError(f"{cls_name} has no scheduler whose step would tell its denoiser: name the component "
                         f"with --module (one of {', '.join(modules)}), or {hatch}")
    order: list[str] = []  # components in the order the pipeline calls them
    at_step: list[list[str]] = []
    caps: dict[str, Capture] = {}
    try:
        with contextlib.ExitStack() as stack:
            for name, m in modules.items():
                caps[name] = stack.enter_context(Capture(m, file, quiet=True))
                stack.callback(m.register_forward_pre_hook(_order_hook(order, name, component)).remove)
            if component is None:
                for s in schedulers:
                    _stop_at_step(s, order, at_step, stack)
            try:
                with quiet():
                    pipe(**kwargs)
            except _Reached:
                raise
            except Exception as e:  # the pipeline's own error, before the component was reached
                raise UsageError(f"{cls_name} from '{path}' failed in its one-step run with {_show(kwargs)} "
                                 f"({type(e).__name__}: {first_line(e, 160)}): {hatch}") from None
            raise _Finished()
    except (_Reached, _Finished):
        pass
    if component is None:
        component = at_step[0][-1] if at_step and at_step[0] else None
        if component is None:
            raise UsageError(f"{cls_name} from '{path}' called no component module before its scheduler's first step"
                             f"{'' if at_step else ' (it never stepped)'}: name the component with --module (one of "
                             f"{', '.join(modules)}), or {hatch}")
        how = "the denoiser: called last before the scheduler's first step"
    else:
        how = "--module"
    cap = caps[component]
    if cap.args is None:
        raise UsageError(f"--module {component}: {cls_name} does not call that component's forward before the end "
                         f"of its one-step run (output_type='latent': the VAE decodes nothing): convert its folder "
                         f"{path / component} with --input / --inputs")
    # return_dict=False only packs the same tensors as a tuple: left out, the outputs keep their names
    # (`sample`, not `out_0`; docs/design.md §4)
    kwargs_seen = {k: v for k, v in cap.kwargs.items() if not (k == "return_dict" and v is False)}
    save(cap.args, kwargs_seen, file)
    target = modules[component]
    del pipe, parts, modules, caps, cap, kwargs_seen, schedulers  # the text encoders (and all but the component) are released
    gc.collect()
    seconds = time.perf_counter() - start
    steps = kwargs.get("num_inference_steps", "default")
    source = f"recorded from one {cls_name} step ({steps} step, {size}) on component {component}"
    return _component_model(target.eval(), file, source, f"inputs: {source} ({how}; built and run in {seconds:.1f} s)")


def _order_hook(order: list[str], name: str, stop_at: str | None):
    def hook(_module, _args):
        order.append(name)
        if name == stop_at:  # after the capture's hook (registered first) recorded the call
            raise _Reached()
    return hook


def _stop_at_step(scheduler, order: list[str], at_step: list, stack: contextlib.ExitStack) -> None:
    """scheduler.step raises _Reached at its first call (the instance attribute is removed after)."""
    def step(*args, **kwargs):
        at_step.append(list(order))
        raise _Reached()

    had = "step" in vars(scheduler)
    previous = vars(scheduler).get("step")
    scheduler.step = step
    stack.callback(lambda: setattr(scheduler, "step", previous) if had else delattr(scheduler, "step"))


def _component_model(module: nn.Module, file: Path, source: str, headline: str) -> ComponentModel:
    """The component called with the recorded (args, kwargs) exactly (resolve's --inputs path for
    any module): its batched inputs dynamic, as a folder's; the classes whose forward fixes the
    batch or reads the mask's values static, with the note a folder of theirs gets."""
    args, kwargs = torch.load(file, map_location="cpu", weights_only=True)
    adapter = CallAdapter(module, tuple(args), dict(kwargs))
    top = {n: t for n, t in zip(adapter.input_names, adapter.example_inputs) if "." not in n}
    dynamic = batched_axes(top)
    cls = type(module).__name__
    notes = []
    if cls in MASK_READ_AS_VALUES:
        dynamic = {}
        notes.append(fixed_by_mask_note(cls, top))
    elif cls in BATCH_LOOP:
        dynamic = {}
    return ComponentModel(module, "pretrained", dynamic_axes=dynamic or None, notes=notes, headline=headline,
                          source=source)


def build(path: Path, index: dict, component: str | None = None):
    """DiffusionPipeline.from_pretrained(folder), local files only, each component in the dtype its
    safetensors store (a bf16 checkpoint is not held as float32)."""
    import diffusers

    cls_name = index["_class_name"]
    hatch = _escape(path, component or _likely_denoiser(index))
    with quiet():  # the lazy import of the pipeline's module (warnings about optional backends)
        pipeline_cls = getattr(diffusers, cls_name, None)
    if pipeline_cls is None:
        raise UsageError(f"'{path}' names {cls_name}, which this diffusers does not have: upgrade diffusers, or "
                         f"{hatch}")
    absent = [f"{n} ({index[n][1]})" for n in components(index)
              if not (path / n).is_dir() and not _optional(pipeline_cls, n)]
    if absent:  # the libraries would build an empty tokenizer / fail deep in the run instead
        raise UsageError(f"cannot build {cls_name} from '{path}': model_index.json names component(s) with no folder "
                         f"there: {', '.join(absent)}; save the whole pipeline with save_pretrained, or {hatch}")
    dtypes = {name: dt for name in components(index)
              if (dt := _stored_dtype(path / name)) is not None}
    saved = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    for lib in ("diffusers", "transformers"):
        try:
            importlib.import_module(f"{lib}.utils.logging").disable_progress_bar()
        except (ImportError, AttributeError):
            pass
    try:
        with quiet():  # each model component with its checkpoint judged (pipeline_parts, checkpoint_keys)
            parts = load_components(cls_name, path, index, components(index), dtypes)
        try:
            with quiet():
                pipe = _from_pretrained(pipeline_cls, path, dtypes, parts)
        except ValueError as e:
            if "keep_in_fp32_modules" not in str(e):
                raise
            pipe = _without_keep_fp32(pipeline_cls, path, index, dtypes, parts)
    except UsageError:  # a component's config.json and checkpoint disagree: its own line
        raise
    except Exception as e:  # noqa: BLE001 - a missing tokenizer / weights, a class this library lacks
        raise UsageError(f"cannot build {cls_name} from '{path}' ({type(e).__name__}: {first_line(e, 400)}): "
                         f"{hatch}") from None
    finally:
        if saved is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved
    refuse_meta_tensors(registered(pipe), f"cannot build {cls_name} from '{path}'",
                        f"the folder's weights lack them; save the pipeline again with save_pretrained, or {hatch}")
    for module in registered(pipe).values():  # a text encoder's KV cache is no output its file can give back
        if type(module).__module__.startswith("transformers.") and getattr(module, "config", None) is not None:
            without_cache(module.config)
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    return pipe


def registered(pipe) -> dict:
    """{name: object} of every component the pipeline registered (its config's names), those of
    `__init__` parameters with a default included: `pipe.components` leaves those out, so a
    scheduler the class makes itself when none is passed (LongCatAudioDiTPipeline's: model_index.json
    names it, save_pretrained writes no folder for it) or an optional module would be missed."""
    names = [k for k in getattr(pipe, "config", {}) if not k.startswith("_")]
    return {k: v for k in names if (v := getattr(pipe, k, None)) is not None}


def _optional(pipeline_cls, name: str) -> bool:
    """A component save_pretrained may leave without a folder while model_index.json names it, and
    from_pretrained loads without: one the class lists as optional (`_optional_components`), an
    `__init__` parameter with a default, or a name registered on the pipeline that is no `__init__`
    parameter at all (save_pretrained saves only those; from_pretrained passes only those)."""
    if name in (getattr(pipeline_cls, "_optional_components", None) or []):
        return True
    try:
        param = inspect.signature(pipeline_cls.__init__).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return param is None or param.default is not inspect.Parameter.empty


def _from_pretrained(pipeline_cls, path: Path, dtypes: dict, parts: dict):
    """`parts`: the components loaded already (pipeline_parts), used by the pipeline as they are."""
    return pipeline_cls.from_pretrained(str(path), local_files_only=True, **parts,
                                        **({"torch_dtype": {**dtypes, "default": torch.float32}} if dtypes else {}))


def _without_keep_fp32(pipeline_cls, path: Path, index: dict, dtypes: dict, parts: dict):
    """diffusers without accelerate refuses a model class with `_keep_in_fp32_modules` ("low_cpu_mem_usage
    cannot be False when keep_in_fp32_modules is True"): those components load in float32 with the
    list set aside for the load, then restored (as normexport.load.pretrained loads such a folder;
    a --dtype cast keeps those modules in float32)."""
    import diffusers

    classes = {n: getattr(diffusers, index[n][1], None) for n in components(index) if index[n][0] == "diffusers"}
    kept = {n: c for n, c in classes.items() if isinstance(c, type) and c.__dict__.get("_keep_in_fp32_modules")}
    saved = {n: c.__dict__["_keep_in_fp32_modules"] for n, c in kept.items()}
    try:
        for c in kept.values():
            c._keep_in_fp32_modules = None
        with quiet():
            return _from_pretrained(pipeline_cls, path, {n: d for n, d in dtypes.items() if n not in kept}, parts)
    finally:
        for n, c in kept.items():
            c._keep_in_fp32_modules = saved[n]


def call_arguments(pipe, modules: dict, path: Path, component: str | None) -> tuple[dict, str]:
    """The generic one-step call of any pipeline, from its __call__ signature (module doc), and the
    image size it asks for ("64x64")."""
    try:
        params = inspect.signature(pipe.__call__).parameters
    except (TypeError, ValueError):
        params = {}
    side = image_side(pipe, modules)
    gen = torch.Generator().manual_seed(0)
    wanted = {"prompt": PROMPT, "num_inference_steps": 1, "height": side, "width": side, "output_type": "latent",
              "use_resolution_binning": False, "generator": gen,
              # an image-conditioned pipeline (img2img, inpainting, ControlNet): an image of the size, a
              # half mask, and the whole schedule (strength 1: one step stays one step)
              "image": torch.rand(1, 3, side, side, generator=gen), "mask_image": _half_mask(side),
              "control_image": torch.rand(1, 3, side, side, generator=gen), "strength": 1.0}
    kwargs = {k: v for k, v in wanted.items() if k in params}
    for k in ("image", "control_image"):  # a PIL image where the pipeline takes one (module doc)
        if k in kwargs and takes_pil(params[k]):
            kwargs[k] = pil_image(kwargs[k])
    for n, p in params.items():  # a required argument the signature and the folder can fill (DiT's class_labels)
        if p.default is p.empty and n not in kwargs and (value := required_value(p, modules)) is not None:
            kwargs[n] = value
    required = [n for n, p in params.items() if p.default is p.empty and n not in kwargs
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        raise UsageError(f"{type(pipe).__name__}.__call__ needs {', '.join(required)} (no default), which a generic "
                         f"one-step run cannot give: {_escape(path, component or _module_guess(modules))}")
    size = f"{side}x{side}" if "height" in kwargs or "image" in kwargs else "default size"
    return kwargs, size


#: config fields that hold the number of classes of a class-conditional model (an embedding table)
CLASS_COUNTS = ("num_embeds_ada_norm", "num_class_embeds", "num_classes", "class_embed_num")


def required_value(param: inspect.Parameter, modules: dict, count: int = 1):
    """A value for a required __call__ argument from its annotation and the folder: a list of ints
    (class labels) within the number of classes a component's config holds; a str (a prompt);
    None where neither tells."""
    text = str(param.annotation).replace("typing.", "").lower()
    if param.annotation is str or text in ("str", "<class 'str'>"):
        return PROMPT if count == 1 else [PROMPT] * count
    if "int" in text and ("list" in text or "[" in text):
        classes = [v for m in modules.values() for f in CLASS_COUNTS
                   if isinstance(v := getattr(getattr(m, "config", None), f, None), int) and v > 1]
        if not classes:
            return None
        return [(1 + i) % min(classes) for i in range(count)]
    return None


def takes_pil(param: inspect.Parameter) -> bool:
    """The argument's annotation names PIL images (diffusers' PipelineImageInput and SVD's own
    `PIL.Image.Image | list[PIL.Image.Image] | torch.Tensor`): every such pipeline preprocesses a PIL
    image to what its models take (resized to its image encoder's size: SVD's CLIP at 224), where
    some pass a tensor on as it is."""
    return "PIL" in str(param.annotation)


def pil_image(t: torch.Tensor):
    """The RGB PIL image of a (1, 3, H, W) tensor of values in [0, 1]."""
    from PIL import Image

    return Image.fromarray((t[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy())


def _half_mask(side: int) -> torch.Tensor:
    mask = torch.zeros(1, 1, side, side)
    mask[..., side // 2:] = 1.0
    return mask


def image_side(pipe, modules: dict) -> int:
    """SIDE, rounded up to a multiple of image_unit."""
    unit = image_unit(pipe, modules)
    return unit * math.ceil(SIDE / unit)


def image_unit(pipe, modules: dict) -> int:
    """The step of image sizes the pipeline takes: the VAE's scale factor × the largest patch size
    of the diffusers components × 2 (packed latents), and a multiple of 8. A transformers model's
    patch size is not one: an image encoder (SVD's and Wan image-to-video's CLIP vision model) sees
    the image its own processor resized (224 x 224), never the pipeline's size; counted, SVD's patch
    32 made the unit 128 and the recording runs 128 x 128 and 256 x 256 (16x the work of 64 x 64)."""
    scale = next((v for a in ("vae_scale_factor_spatial", "vae_scale_factor")
                  if isinstance(v := getattr(pipe, a, None), int) and v > 0), None)
    if scale is None:
        vae = modules.get("vae")
        blocks = getattr(getattr(vae, "config", None), "block_out_channels", None)
        scale = 2 ** (len(blocks) - 1) if blocks else 8
    patch = 1
    transformers = sys.modules.get("transformers")
    for m in modules.values():
        if transformers is not None and isinstance(m, transformers.PreTrainedModel):
            continue
        p = getattr(getattr(m, "config", None), "patch_size", None)
        if isinstance(p, int):
            patch = max(patch, p)
        elif isinstance(p, (list, tuple)) and all(isinstance(x, int) for x in p):
            patch = max([patch] + list(p))
    return math.lcm(scale * patch * 2, 8)


def _show(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "generator")


def _escape(path: Path, component: str) -> str:
    return (f"record the component's call yourself: `with normexport.capture(pipe.{component}, \"inputs.pt\", "
            f"stop=True): pipe(...)`, then `normexport convert {path / component} --inputs inputs.pt` (or this "
            f"folder with --module {component} --inputs inputs.pt)")


def _module_components(index: dict) -> list[str]:
    """The components whose class (looked up in its library, never imported by name from the file)
    is a torch module."""
    out = []
    for n in components(index):
        library, cls_name = index[n]
        if library not in ("diffusers", "transformers") or importlib.util.find_spec(library) is None:
            continue
        with quiet():
            cls = getattr(importlib.import_module(library), cls_name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            out.append(n)
    return out


def _likely_denoiser(index: dict) -> str:
    """For messages only (before a run tells): the first diffusers component that is not a VAE."""
    names = [n for n in components(index) if index[n][0] == "diffusers" and "vae" not in n.lower()
             and "scheduler" not in n.lower()]
    return names[0] if names else "<component>"


def _module_guess(modules: dict) -> str:
    names = [n for n, m in modules.items() if type(m).__module__.startswith("diffusers") and "vae" not in n.lower()]
    return names[0] if names else "<component>"
