"""`normexport.pipeline.load(OUT)`: an exported pipeline folder back as the diffusers pipeline of
its model_index.json, each neural component an onnxruntime session behind the component's own
call (docs/convert.md, "A pipeline folder out").

`OrtComponent` stands where the torch module stood: `forward(*args, **kwargs)` (and the VAE's
`decode` / `encode`) binds the call to the original method's signature, names the tensors as the
export named them (load.call: parameter names, nested leaves by their path), feeds the session,
and rebuilds the component's own output (a ModelOutput / BaseOutput, or its tuple with
`return_dict=False`) from the manifest's structure. A plain value that differs from the one the
file was exported with, or a tensor the file has no input for, is an error naming it — never a
silently different computation. Attributes the pipeline reads from the model (`config`, and the
odd submodule such as SDXL's `add_embedding.linear_1.in_features`) come from the original class
built on the meta device (no weights; its own buffers' values from the slot's buffers.safetensors,
pipeline/buffers.py; any other tensor read from it refused in one line): its `dtype` is the
exported one, its device the CPU.
Schedulers, tokenizers and the other non-module components are loaded from their folders by the
classes model_index.json names (diffusers / transformers only).

Where the components run (`backend`): "ort" (onnxruntime, `providers` or its CPU provider),
"ort-cuda" (onnxruntime's CUDA provider), "trt" (the TensorRT engines `normexport build OUT/` wrote
beside the files, OUT/<slot>/model.engine, with the normexport plugin where one is found). Left out:
a folder converted for TensorRT (convert's default --target trt) whose engines are all built runs
them where TensorRT can run engines, anything else in onnxruntime, and a trt folder that runs in
onnxruntime says why on the terminal. A backend asked for that cannot run here is refused in one
line naming the reason.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import nn

from ..errors import UsageError, first_line
from . import batching, buffers, padding, stepping
from . import manifest as manifest_mod
from .recording import LATENT_PARAMETERS, arguments_given, bind_call, changed_processors, is_pag, key_text, \
    processor_classes

#: the libraries model_index.json may name a class of (nothing else is imported from a folder)
LIBRARIES = ("diffusers", "transformers")
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}
ORT_TYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(double)": torch.float64,
             "tensor(bfloat16)": torch.bfloat16, "tensor(int64)": torch.int64, "tensor(int32)": torch.int32,
             "tensor(bool)": torch.bool}
#: the same, by ONNX element type (a file's declared inputs and outputs)
ELEM_TYPES = {1: torch.float32, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16, 7: torch.int64,
              6: torch.int32, 9: torch.bool}


#: load's backends (module doc)
BACKENDS = ("ort", "ort-cuda", "trt")


def load(folder, providers: list[str] | None = None, backend: str | None = None, plugin=None):
    """The pipeline of an exported folder, ready to call: `pipe(prompt, num_inference_steps=N,
    generator=g)` runs as the eager pipeline does, every component in onnxruntime or TensorRT
    (`backend`, module doc; `plugin`: the TensorRT plugin library, default normexport's own where
    it is built)."""
    folder = Path(folder)
    manifest = manifest_mod.read(folder)
    backend = _backend(folder, manifest, backend)
    if backend == "ort-cuda":
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    engine_plugin = _engine_plugin(plugin) if backend == "trt" else None
    index = _model_index(folder)
    pipeline_cls = _library_class("diffusers", index.get("_class_name"), folder / "model_index.json")
    parts: dict = {}
    by_component: dict[str, dict] = {}  # component -> method -> [(slot, entry)]: one per processor state
    for slot, entry in manifest["slots"].items():
        by_component.setdefault(entry["component"], {}).setdefault(entry["method"], []).append((slot, entry))
    for name, value in index.items():
        if name.startswith("_"):
            continue
        if name in by_component:
            parts[name] = OrtComponent(folder, name, index[name], by_component[name], providers,
                                       engines=backend == "trt", plugin=engine_plugin)
        elif isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
            if (folder / name).is_dir():
                cls = _library_class(value[0], value[1], folder / "model_index.json")
                try:  # a tokenizer, scheduler, feature extractor; a model folder here is one the manifest lost
                    with _quiet():
                        parts[name] = cls.from_pretrained(str(folder / name))
                except Exception as e:  # noqa: BLE001 - a damaged folder (docs/design.md §14): one line
                    raise UsageError(f"'{folder / name}' cannot be loaded as {value[1]} ({type(e).__name__}: "
                                     f"{first_line(e, 160)}), and the manifest has no file for it: convert the "
                                     "pipeline folder again") from None
            elif _has_default(pipeline_cls, name):  # no folder (LongCat's scheduler, made by its __init__): the
                continue  # class's own default, as diffusers' from_pretrained leaves such a parameter out
            else:
                parts[name] = None  # a module the pipeline never called (safety checker): not exported
        elif isinstance(value, list) and len(value) == 2 and all(v is None for v in value):
            parts[name] = None  # an optional component saved as absent ([null, null])
        elif value is None or isinstance(value, (bool, int, float, str)):
            parts[name] = value  # the pipeline's own config (SDXL's force_zeros_for_empty_prompt): as saved
        else:
            raise UsageError(f"'{folder / 'model_index.json'}' gives {name!r} the value {str(value)[:80]}, neither a "
                             "[library, class] pair nor a plain value: convert the pipeline folder again")
    params = inspect.signature(pipeline_cls.__init__).parameters
    kwargs = {k: v for k, v in parts.items() if k in params}
    try:
        pipe = pipeline_cls(**kwargs)
    except Exception as e:  # noqa: BLE001 - the class refuses what the folder holds
        raise UsageError(f"cannot build {pipeline_cls.__name__} from '{folder}' ({type(e).__name__}: "
                         f"{first_line(e, 200)}): convert the pipeline folder again") from None
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    _switch_on_meta(pipe)
    return pipe


def _switch_on_meta(pipe) -> None:
    """A PAG pipeline (diffusers' PAGMixin) sets its perturbed layers' processors on the denoiser's
    modules, found by name (`_set_pag_attn_processor`); the loaded denoiser has no modules but its
    class on the meta device: the mixin's own method runs on a view of the pipeline whose exported
    components are their meta modules, and OrtComponent runs the file of the processors they hold.
    The restore (`denoiser.set_attn_processor(...)`) reaches the meta module as any attribute does."""
    if not is_pag(pipe):
        return
    original = type(pipe)._set_pag_attn_processor

    def set_pag_attn_processor(*args, **kwargs):
        return original(_MetaView(pipe), *args, **kwargs)

    pipe._set_pag_attn_processor = set_pag_attn_processor


class _MetaView:
    """The pipeline as its methods read it, each exported component (OrtComponent) its meta module."""

    def __init__(self, pipe):
        object.__setattr__(self, "_pipe", pipe)

    def __getattr__(self, name: str):
        value = getattr(self._pipe, name)
        meta = vars(value).get("_meta") if type(value) is OrtComponent else None
        return meta if meta is not None else value


def _has_default(pipeline_cls, name: str) -> bool:
    """`name` is an `__init__` parameter with a default that the class does not list as optional:
    diffusers' from_pretrained passes such a component only when it loads one."""
    try:
        param = inspect.signature(pipeline_cls.__init__).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is not param.empty and \
        name not in (getattr(pipeline_cls, "_optional_components", None) or [])


def _backend(folder: Path, manifest: dict, backend: str | None) -> str:
    """The backend the components run on (module doc); a UsageError for one asked for that cannot run."""
    from ..parity.runners import RUNNERS

    missing = [slot for slot, e in manifest["slots"].items()
               if not all((folder / f["file"]).with_suffix(".engine").is_file() for f in manifest_mod.files(e))]
    if backend is None:
        if manifest.get("target") != "trt":
            return "ort"
        if missing:
            built = "no TensorRT engines built" if len(missing) == len(manifest["slots"]) else \
                f"no TensorRT engine for {', '.join(missing)}"
            print(f"  {folder}: {built} (`normexport build {folder}` makes them): the components run in onnxruntime")
            return "ort"
        why = RUNNERS["trt"].availability()
        if why:
            print(f"  {folder}: TensorRT cannot run its engines here ({why}): the components run in onnxruntime")
            return "ort"
        print(f"  {folder}: the components run as the TensorRT engines beside their files")
        return "trt"
    if backend not in BACKENDS:
        raise UsageError(f"backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if backend == "trt" and missing:
        raise UsageError(f"'{folder}' has no TensorRT engine for {', '.join(missing)}: build them with "
                         f"`normexport build {folder}` first")
    why = RUNNERS[backend].availability()
    if why:
        raise UsageError(f"backend '{backend}' cannot run here ({why}): load '{folder}' with backend 'ort'")
    return backend


def _engine_plugin(plugin):
    """The plugin library TensorRT loads before the engines: the one given, else normexport's own
    where it is built (engines built without it do not need it; loading it is harmless)."""
    from ..trt import cli as trt_cli

    if plugin is not None:
        return trt_cli.check_plugin(Path(plugin))
    found = trt_cli.find_plugin()
    return trt_cli.check_plugin(found) if found is not None else None


def _model_index(folder: Path) -> dict:
    from ..jsonfile import read_json_object

    return read_json_object(folder / "model_index.json", "convert the pipeline folder again")


class _quiet:
    def __enter__(self):
        from ..load._util import quiet

        self._q = quiet()
        return self._q.__enter__()

    def __exit__(self, *exc):
        return self._q.__exit__(*exc)


def _pipeline_module(library) -> str | None:
    """`diffusers.pipelines.<library>` where model_index.json names a diffusers pipeline module as the
    library (a component class defined beside its pipeline, as StableAudioPipeline's
    ["stable_audio", "StableAudioProjectionModel"]): diffusers' own from_pretrained looks there."""
    import importlib.util

    if not isinstance(library, str) or not library.isidentifier():
        return None
    try:
        found = importlib.util.find_spec(f"diffusers.pipelines.{library}") is not None
    except ImportError:
        return None
    return f"diffusers.pipelines.{library}" if found else None


def _library_class(library: str, name, where: Path):
    module = library if library in LIBRARIES else _pipeline_module(library)
    if module is None or not isinstance(name, str) or not name.isidentifier():
        raise UsageError(f"'{where}' names {library}.{name}, which normexport does not load (only diffusers / "
                         "transformers classes): convert the pipeline folder again")
    with _quiet():
        cls = getattr(importlib.import_module(module), name, None)
    if cls is None:
        raise UsageError(f"'{where}' names {name}, which this {library} does not have: upgrade {library}")
    return cls


class OrtComponent(nn.Module):
    """One component of the pipeline in onnxruntime (module doc)."""

    def __init__(self, folder: Path, name: str, library_class: list, slots: dict, providers=None, engines=False,
                 plugin=None):
        super().__init__()
        slots = {m: v if isinstance(v, list) else [v] for m, v in slots.items()}  # method -> [(slot, entry)]
        meta = _meta_module(folder, library_class, {m: files[0] for m, files in slots.items()})
        object.__setattr__(self, "_meta", meta)
        self.component = name
        # the processors the component's class has ({layer path: class name}): a file with "attn_processors" in
        # its entry runs while the meta module holds those instead (module doc of pipeline/recording.py)
        self._own = processor_classes(meta) if meta is not None else {}
        def opened(slot, entry):  # one file's runner
            return _EngineSession(folder, slot, entry, plugin) if engines else _Session(folder, slot, entry, providers)

        # a method cut at its children (a video VAE's frame loop, pipeline/stepping.py): its files behind the
        # children of the meta-device component, the library's method run around them
        self._slots = {method: [(entry.get("attn_processors") or {},
                                 _stepped(meta, method, slot, entry, opened) if "steps" in entry else
                                 opened(slot, entry)) for slot, entry in files]
                       for method, files in slots.items()}
        first = next(iter(slots.values()))[0][1]
        # the component's own dtype (the manifest's; a folder written before it had one: its first float input's)
        dtypes = [TORCH_DTYPES.get(first.get("dtype"))] + [TORCH_DTYPES.get(i["dtype"])
                                                            for i in first.get("inputs", {}).values()]
        self._dtype = next((d for d in dtypes if d is not None), torch.float32)
        # an empty parameter of that dtype on the CPU: a pipeline that reads a component's dtype from its
        # parameters (SVD's `next(self.image_encoder.parameters()).dtype`) gets the exported one
        self.register_parameter("dtype_of_file", nn.Parameter(torch.empty(0, dtype=self._dtype), requires_grad=False))
        # each exported method with its library method's signature: a pipeline that passes what the method
        # takes (SVD's `"num_frames" in inspect.signature(self.vae.forward).parameters`) passes it here too
        for method in ("forward", "decode", "encode"):  # forward too where only decode was exported (SVD's VAE)
            original = getattr(meta, method, None) if meta is not None else None
            if callable(original):
                call = _Signed(getattr(type(self), method).__get__(self), inspect.signature(original))
                object.__setattr__(self, method, call)

    @property
    def __class__(self):
        """The component's library class where it could be built (on meta): a pipeline's own type checks
        (StableDiffusionControlNetPipeline's `isinstance(self.controlnet, ControlNetModel)`, else `assert
        False`) hold for the loaded component, as they do for a unittest.mock spec; type() stays OrtComponent."""
        meta = self.__dict__.get("_meta")
        return type(meta) if meta is not None else type(self)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            meta = self.__dict__.get("_meta")
            if meta is None or name.startswith("__"):
                raise
            return buffers.refuse_meta(self.component, name, getattr(meta, name))  # a tensor without values: refused

    def to(self, *args, **kwargs):  # the sessions stay where they are (the pipeline's .to(device) is a no-op)
        return self

    def forward(self, *args, **kwargs):
        return self._call("forward", args, kwargs)

    def decode(self, *args, **kwargs):
        return self._call("decode", args, kwargs)

    def encode(self, *args, **kwargs):
        return self._call("encode", args, kwargs)

    def session(self, method: str, args=None, kwargs=None):
        """The file that serves `method` now: the one exported with the attention processors the
        component holds (the pipeline may have switched them, pipeline/recording.py), and, where the
        component has files for several argument sets, the one of the arguments the call (`args`,
        `kwargs`) gives a tensor; a RuntimeError naming them where no file was exported with them."""
        files = self._slots.get(method)
        if files is None:
            raise RuntimeError(f"{self.component}.{method} was not exported (the pipeline did not call it when the "
                               "folder was converted)")
        now = self.changed_processors()
        state = {k: type(v).__name__ for k, v in now.items()}
        held = [session for processors, session in files if processors == state]
        if len(held) > 1 and (args or kwargs):  # a file per argument set (pipeline/recording.py)
            given = list(arguments_given(self._bind(method, args or (), kwargs or {})))
            chosen = [s for s in held if s.entry.get("arguments") == given]
            if not chosen:
                raise RuntimeError(f"{self.component}.{method} called with tensors for {', '.join(given) or 'none'}, "
                                   "which no exported file takes (its files take "
                                   f"{'; '.join(', '.join(s.entry.get('arguments') or []) for s in held)}): convert "
                                   "the pipeline with a call that gives them")
            return chosen[0]
        if held:
            return held[0]

        def shown(classes: dict) -> str:
            return (f"{', '.join(sorted(set(classes.values())))} on {len(classes)} layers" if classes
                    else "its own attention processors")

        raise RuntimeError(f"{self.component}.{method} called with {shown(state)}, which no exported file holds "
                           f"(its files: {'; '.join(shown(p) for p, _ in files)}): convert the pipeline with a call "
                           "that sets them")

    def changed_processors(self) -> dict:
        """{layer path: processor} of the layers whose processor the pipeline set to another class than
        the component's own ({} where it holds its own, or has no attention processors)."""
        return changed_processors(self._meta, self._own) if self._own else {}

    def _call(self, method: str, args, kwargs):
        session = self.session(method, args, kwargs)
        return session(self.component, method, self._bind(method, args, kwargs))

    def _bind(self, method: str, args, kwargs) -> dict:
        """The call by the original method's parameter names."""
        original = getattr(type(self._meta), method, None) if self._meta is not None else None
        if original is None and args:
            raise RuntimeError(f"{self.component}.{method} called positionally; its class could not be built to name "
                               "the arguments: call it by keyword")
        return bind_call(original.__get__(self._meta), args, kwargs) if original is not None else dict(kwargs)


class _Signed:
    """A loaded component's method that inspect reads as its library method (`__signature__`)."""

    def __init__(self, fn, signature: inspect.Signature):
        self.fn, self.__signature__ = fn, signature

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class _Session:
    """One file: the session, its input / output names and the manifest's call description."""

    def __init__(self, folder: Path, slot: str, entry: dict, providers=None):
        from ..ortrun import file_session

        self.slot, self.entry = slot, entry
        self.renames = entry.get("renames") or {}
        self.constants = entry.get("constants") or {}
        self.runner = None  # a bfloat16 file on the CPU provider: parity's onnxruntime runner, widened
        path = folder / entry["file"]
        try:
            self.session = file_session(path, providers=providers)
        except Exception as e:  # noqa: BLE001 - onnxruntime refuses a damaged file with its own exception types
            if "NOT_IMPLEMENTED" not in str(e) or (providers and providers[0] != "CPUExecutionProvider") \
                    or not _has_bf16(path):
                raise UsageError(f"onnxruntime cannot open '{path}' ({type(e).__name__}: {first_line(e, 160)}): the "
                                 "file is damaged; convert the pipeline folder again") from None
            self._widened(path)
            return
        self.inputs = {i.name: ORT_TYPES.get(i.type) for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.output_types = {}

    def _widened(self, path: Path) -> None:
        """onnxruntime's CPU provider has no bfloat16 kernels for this file: the one onnxruntime
        runner of normexport (parity.runners.OrtRunner, docs/design.md §8) runs it widened to
        float32 (piece by piece where widened whole it would not fit); the inputs go in and the
        outputs come back in the file's own dtypes, so the pipeline sees what eager gives."""
        from ..parity.runners import OrtRunner, _ModelSource

        source = _ModelSource(path)
        self.runner = OrtRunner(source)
        self.runner.activate()
        types = self._read_io(source.proto.graph)
        self.inputs = {n: types.get(n) for n in self.runner.names}
        self.session = None
        print(f"  {self.slot}: {WIDENED_NOTE}")

    def _read_io(self, graph) -> dict:
        """The file's outputs (names, dtypes) set from its graph; every input's and output's dtype."""
        types = {v.name: ELEM_TYPES.get(v.type.tensor_type.elem_type) for v in list(graph.input) + list(graph.output)}
        self.outputs = [o.name for o in graph.output]
        self.output_types = {n: types.get(n) for n in self.outputs}
        return types

    def __call__(self, component: str, method: str, bound: dict):
        return_dict = bound.pop("return_dict", True)
        bound.pop("generator", None)  # the VAE's decode takes and ignores it
        bound = {self.renames.get(k, k): v for k, v in bound.items()}
        cuts = {}
        if self.entry.get("text_padding"):  # a text axis the file fixes: padded with masked rows (pipeline/padding.py)
            bound, cuts = padding.pad(bound, self.entry["text_padding"], f"{component}.{method}")
        pieces = batching.split(self.entry, bound, self.renames)
        if pieces is not None:  # a batch the file does not hold: run in pieces of its batch (pipeline/batching.py)
            calls, sizes = pieces
            return batching.merge([self._call_file(component, method, c, return_dict, cuts) for c in calls], sizes)
        return self._call_file(component, method, bound, return_dict, cuts)

    def _call_file(self, component: str, method: str, bound: dict, return_dict, cuts=None):
        """One run of the file on a call of the batch it holds, its outputs as the component gives them
        (`cuts`: the padded text axes cut back, padding.cut)."""
        feeds = {}
        for path, leaf in pytree.tree_flatten_with_path(bound)[0]:
            name = ".".join(key_text(k) for k in path)
            name = self.renames.get(name, name)  # a nested entry fed by its own name (added_cond_kwargs.time_ids)
            if isinstance(leaf, torch.Tensor):
                if name in self.inputs:
                    t = leaf.detach().cpu()
                    if t.is_complex():  # exported as (re, im) pairs (load.call.CallAdapter)
                        t = torch.view_as_real(t)
                    want = self.inputs[name]
                    feeds[name] = t.to(want) if want is not None and t.dtype != want else t
                elif name not in self.entry["inputs"]:  # the export had no tensor there
                    raise RuntimeError(f"{component}.{method} called with a tensor {name}, which its file "
                                       f"{self.entry['file']} was not exported with: convert the pipeline again")
            elif leaf is not None and name in self.constants and repr(leaf) != self.constants[name]:
                raise RuntimeError(f"{component}.{method} called with {name}={leaf!r}; its file {self.entry['file']} "
                                   f"was exported with {self.constants[name]}: convert the pipeline with that call")
        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise RuntimeError(f"{component}.{method} called without {', '.join(missing)}, which its file "
                               f"{self.entry['file']} needs")
        valued = [n for n, i in self.entry["inputs"].items() if i.get("values") is not None and n in feeds
                  and list(feeds[n].shape) == i["shape"] and feeds[n].to(torch.int64).flatten().tolist() != i["values"]]
        if valued:
            raise RuntimeError(f"{component}.{method} called with {', '.join(valued)} of other values than its file "
                               f"{self.entry['file']} was exported with: {component} reads them in python (token "
                               "counts), so the file serves the prompt the pipeline was converted with; convert the "
                               "pipeline with this call")
        fixed = [f"{n} {list(feeds[n].shape)} (the file takes {i['shape']})" for n, i in self.entry["inputs"].items()
                 if n in feeds and len(i["shape"]) == feeds[n].ndim and any(
                     a != b and k not in i.get("dynamic", []) for k, (a, b) in enumerate(zip(feeds[n].shape, i["shape"])))]
        if fixed:
            raise RuntimeError(f"{component}.{method} called with {', '.join(fixed[:3])}: {self.entry['file']} keeps "
                               "those sizes static; generate at the size the pipeline was converted at, or convert it "
                               "at this size")
        tensors = padding.cut(self._run(feeds), cuts or {})
        if method == "encode" and self.outputs == [LATENT_PARAMETERS]:  # the distribution, rebuilt as diffusers has it
            from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
            from diffusers.models.modeling_outputs import AutoencoderKLOutput

            dist = DiagonalGaussianDistribution(tensors[0])
            return AutoencoderKLOutput(latent_dist=dist) if return_dict else (dist,)
        return manifest_mod.rebuild(self.entry.get("structure"), tensors, return_dict=bool(return_dict))


    def _run(self, feeds: dict) -> list[torch.Tensor]:
        """The file's outputs, in its output order, for the named input tensors."""
        if self.runner is not None:  # widened: float32 out, back to the file's dtypes
            outs = self.runner.infer([feeds[n] for n in self.runner.names])
            return [_tensor(a, self.output_types.get(n)) for n, a in zip(self.outputs, outs)]
        from ..ortrun import run_session

        out = run_session(self.session, {n: _numpy(t) for n, t in feeds.items()})
        return [_tensor(out[n]) for n in self.outputs]


class _EngineSession(_Session):
    """One slot as its TensorRT engine (OUT/<slot>/model.engine, `normexport build OUT/`): the same
    call as _Session, the file's input and output names and dtypes from the ONNX graph (no weights
    read), run by normexport.trt.run_engine (bfloat16 goes in and comes back as float32, then the
    file's dtype)."""

    def __init__(self, folder: Path, slot: str, entry: dict, plugin=None):
        import onnx

        from .. import trt as ntrt

        self.slot, self.entry = slot, entry
        self.renames = entry.get("renames") or {}
        self.constants = entry.get("constants") or {}
        self.runner = self.session = None
        path = folder / entry["file"]
        engine_path = path.with_suffix(".engine")
        try:
            self.engine = ntrt.deserialize(engine_path.read_bytes(), plugin)
        except Exception as e:  # noqa: BLE001 - TensorRT's own reason (another GPU, another TensorRT, no plugin)
            raise UsageError(f"TensorRT cannot load '{engine_path}' ({type(e).__name__}: {first_line(e, 200)}): "
                             f"build the engines again on this machine with `normexport build {folder}`") from None
        graph = onnx.load(str(path), load_external_data=False).graph
        types = self._read_io(graph)
        weights = {t.name for t in graph.initializer}
        self.inputs = {v.name: types[v.name] for v in graph.input if v.name not in weights}
        trt = ntrt.load().module
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.engine_outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        lost = sorted(set(self.outputs) - set(self.engine_outputs))
        if lost:
            raise UsageError(f"'{engine_path}' has no output {', '.join(lost)} of {entry['file']}: build the engines "
                             f"again with `normexport build {folder}`")

    def _run(self, feeds: dict) -> list[torch.Tensor]:
        from .. import trt as ntrt
        from ..parity._util import _to_numpy

        outs = dict(zip(self.engine_outputs, ntrt.run_engine(self.engine, {n: _to_numpy(t) for n, t in feeds.items()})))
        return [_tensor(outs[n], self.output_types.get(n)) for n in self.outputs]


def _tensor(a: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a).astype(np.float32) if a.dtype.name == "bfloat16" else
                         np.ascontiguousarray(a))
    return t.to(dtype) if dtype is not None and t.dtype != dtype else t


def _has_bf16(path: Path) -> bool:
    """Whether the file (its graph, not its external data) holds bfloat16 tensors or values."""
    import onnx

    from ..parity.widen import _has_bf16 as has

    try:
        return has(onnx.load(str(path), load_external_data=False))
    except Exception:  # noqa: BLE001 - a file that does not parse is damaged, said by the caller
        return False


#: said once per slot that runs widened (the parity report's words)
WIDENED_NOTE = ("bfloat16 file run widened to float32 in onnxruntime (its CPU provider has no bfloat16 kernels "
                "for it); inputs and outputs stay bfloat16")


def _numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        from ..dtypes import BF16

        return t.contiguous().view(torch.uint16).numpy().view(BF16)
    return t.contiguous().numpy()


def _stepped(meta, method: str, slot: str, entry: dict, opened) -> stepping.Stepped:
    if meta is None:
        raise UsageError(f"{slot}: its class could not be built on the meta device, and its {method} runs the "
                         "library's own loop around its files: install the diffusers it was converted with")
    return stepping.Stepped(meta, slot, method, entry, {child: [(e, opened(f"{slot}/{child}", e)) for e in kinds]
                                                  for child, kinds in entry["steps"].items()})


def stepped_method(folder: Path, slot: str, entry: dict, library_class: list, providers=None) -> stepping.Stepped:
    """A method cut at its children, from `folder`'s files of `slot` (convert's check of the composed method,
    pipeline/stepped_export.py, runs it as load() does)."""
    meta = _meta_module(folder, library_class, {entry["method"]: (slot, entry)})
    return _stepped(meta, entry["method"], slot, entry, lambda s, e: _Session(folder, s, e, providers))


def _meta_module(folder: Path, library_class: list, slots: dict):
    """The component's class built from the copied config.json on the meta device (no weights), or
    None where the class cannot be built so (then only config-free calls by keyword work)."""
    slot = next(iter(slots.values()))[0]
    if not (isinstance(library_class, list) and len(library_class) == 2):
        raise UsageError(f"'{folder / 'model_index.json'}' gives {slot!r} no [library, class] pair: convert the "
                         "pipeline folder again")
    library, cls_name = library_class
    config_dir = folder / slot
    try:
        cls = _library_class(library, cls_name, folder / "model_index.json")
        with torch.device("meta"), _quiet():
            if library == "diffusers" or _pipeline_module(library):  # a diffusers class (ConfigMixin)
                meta = cls.from_config(cls.load_config(str(config_dir)))
            else:
                meta = cls._from_config(cls.config_class.from_pretrained(str(config_dir)))
        buffers.load_into(meta, config_dir)  # its own buffers' values, written by convert (buffers.py)
        return meta
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - a class that cannot be built without weights
        print(f"  {slot}: {cls_name} not built on the meta device ({type(e).__name__}: {first_line(e, 100)}): its "
              "config and submodules are not available to the pipeline")
        return None
