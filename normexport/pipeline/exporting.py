"""`normexport convert PIPELINE_DIR -o OUT/`: every neural component a diffusers pipeline runs,
exported into one folder that loads back as the same pipeline (docs/convert.md, "A pipeline
folder out").

1. The pipeline is run twice to its end (normexport.pipeline.recording): each component's first
   call recorded — text encoders, the denoiser, the VAE's decode (and encode where the pipeline
   encodes an image) — and the dims that differ between the runs made dynamic.
2. The pipeline is released; each component is loaded alone from its folder (one in memory at a
   time) and goes through the same convert stages as a single model (normexport.convert.convert:
   prepare, the exporter ladder, the rewrite, parity against eager, the streaming writer), with the
   recorded call as its --inputs. A failed component fails the whole folder.
3. The folder is laid out as optimum's (`text_encoder*/`, `unet/` or `transformer/`,
   `vae_decoder/`, `vae_encoder/`, each `model.onnx` + `config.json`; `model_index.json`; the
   scheduler, tokenizer and other non-module folders copied) plus normexport_pipeline.json, built
   in a temporary folder beside OUT and renamed into place: no half-written folder is left.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from .. import convert as convert_stages
from .. import llm
from ..capture import save
from ..errors import AxesFixed, ExportError, UsageError, first_line
from ..load import pipeline as folder_pipeline
from ..load.call import CallAdapter
from ..load.examples import MASK_READ_AS_VALUES
from ..load.pretrained import batched_axes, load_module
from . import buffers, padding, stepped_export, stepping
from . import manifest as manifest_mod
from . import optimum_names
from .recording import LATENT_PARAMETERS, METHODS, Slot, record, save_call, slot_name



def wants_folder(args) -> bool:
    """convert MODEL -o OUT/ with MODEL a pipeline folder and no --module / --inputs: the whole pipeline."""
    out = getattr(args, "output", None)
    return (bool(out) and out.endswith(("/", os.sep)) and not args.module and not getattr(args, "inputs", None)
            and not args.input and folder_pipeline.is_pipeline_folder(Path(args.model)))


class MethodCall(nn.Module):
    """A component's method (the VAE's decode / encode) as a module whose call the exporters take;
    inputs by the names optimum gives them (`latent_sample`), passed under the method's own."""

    def __init__(self, inner: nn.Module, method: str, renames: dict):
        super().__init__()
        self.inner, self.method = inner, method
        self.back = {v: k for k, v in renames.items()}

    def forward(self, **kwargs):
        out = getattr(self.inner, self.method)(**{self.back.get(k, k): v for k, v in kwargs.items()})
        dist = getattr(out, "latent_dist", None)
        if dist is not None and isinstance(getattr(dist, "parameters", None), torch.Tensor):
            # encode's distribution, as optimum's vae_encoder gives it: its parameters (mean, logvar)
            return {LATENT_PARAMETERS: dist.parameters}
        return out


def run(args) -> int:
    src = Path(args.model)
    out = Path(args.output.rstrip("/" + os.sep))
    index = folder_pipeline.load_pipeline_folder(src).module.index
    if args.report:
        from ..io import check_writable

        check_writable(args.report, "--report")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not manifest_mod.is_exported_pipeline(out))):
        raise UsageError(f"-o {args.output}: '{out}' exists and is not an exported pipeline folder: choose a new or "
                         "empty folder")
    if not out.parent.is_dir():
        raise UsageError(f"-o {args.output}: the parent folder '{out.parent}' does not exist: make it first")
    start = time.perf_counter()
    rec = record(src, index)
    print(f"pipeline {rec.pipeline}: {len(rec.slots)} components recorded from three runs to the end ({rec.side}x"
          f"{rec.side}: two prompts, one, one size up; {rec.seconds:.1f} s): {', '.join(rec.slots)}")
    if rec.skipped:
        print(f"  not called by the pipeline, not exported: {', '.join(rec.skipped)}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.normexport-", dir=out.parent))
    try:
        slots, failed = {}, []
        seen: dict[tuple, str] = {}  # (weights, method, call signature) -> the slot that wrote that file
        for slot in rec.slots.values():
            key = _same_file_key(src, slot)
            if key in seen and _digest(src / slot.component) == _digest(src / slots[seen[key]]["component"]):
                # the same component in two slots (identical weights, same call): written once
                entry = {**slots[seen[key]], "component": slot.component, "shared_with": seen[key]}
                (tmp / slot.name).mkdir()
                shutil.copy2(src / slot.component / "config.json", tmp / slot.name / "config.json")
                if (tmp / seen[key] / buffers.FILE).is_file():
                    shutil.copy2(tmp / seen[key] / buffers.FILE, tmp / slot.name / buffers.FILE)
                print(f"[{slot.name}] {slot.component}: the same weights and call as {seen[key]}: "
                      f"uses {entry['file']}")
                slots[slot.name] = entry
                continue
            entry = _export_slot(args, src, slot, tmp, rec.text_limit)
            if key is not None:
                seen[key] = slot.name
            if entry is None:
                failed.append(slot.name)
                continue
            slots[slot.name] = entry
        if failed:
            print(f"pipeline FAILED: {', '.join(failed)} did not pass (see above): {out} not written")
            return 1
        _copy_rest(src, index, tmp, {s.component for s in rec.slots.values()})
        manifest = {"format": manifest_mod.FORMAT, "pipeline": rec.pipeline, "source": str(src), "side": rec.side,
                    "target": args.target, "slots": slots}
        manifest_mod.write(tmp, manifest)
        _replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.report:
        from ..io import write_json

        write_json(manifest, args.report, "--report")
    print(f"wrote {out}/ ({len(slots)} files, {time.perf_counter() - start:.1f} s): load it with "
          f"normexport.pipeline.load('{out}'); check it with `normexport check {out} --reference {src}`")
    return 0


def _export_slot(args, src: Path, slot: Slot, tmp: Path, text_limit: int | None = None) -> dict | None:
    """One component, loaded alone, through the convert stages; its manifest entry (None: failed).
    `text_limit`: the pipeline's longest text (its max_sequence_length), a padded file's length."""
    print(f"[{slot.name}]" + (f" {slot.component}.{slot.method}" if slot.method != "forward" else ""))
    folder = tmp / slot.name
    folder.mkdir()
    calls = tmp / ".calls"
    calls.mkdir(exist_ok=True)
    file = save_call(slot, calls / f"{slot.name}.pt")
    module, _ = load_module(src / slot.component)
    module.eval()
    if slot.processors:  # the attention processors the pipeline had set at this slot's call (recording.py)
        print(f"  {slot.name}: {slot.component} exported with the attention processors the pipeline set at this call: "
              f"{_processors_text(slot.processors)}")
        module.set_attn_processor({**module.attn_processors, **slot.processors})
    component = module
    if slot.method != "forward" and stepping.may_loop(component):
        # a method that runs a child in a python loop over a state list (a video VAE's frame loop): cut at its
        # children, a file per kind of call, the loop run at load (pipeline/stepping.py)
        cut = stepping.plan(component, slot.method, slot.args, _method_kwargs(slot, slot.kwargs), _other_calls(slot))
        if isinstance(cut, stepping.Plan):
            print(f"  {slot.name}: {slot.component}.{slot.method} runs {', '.join(cut.children)} in a python loop "
                  f"over {cut.loop_axis[0]} axis {cut.loop_axis[1]} with a state list: a file per kind of call "
                  f"({len(cut.kinds)}), the loop run at load")
            return stepped_export.export_slot(args, src, slot, tmp, component, cut, _module_dtype(component),
                                              _method_kwargs(slot, slot.kwargs))
        if cut is not None:
            print(f"  {slot.name}: {slot.component}.{slot.method} runs a child in a loop over a state list that "
                  f"cannot be cut ({cut}): exported whole (the loop unrolled, its length fixed)")
    if slot.method != "forward":
        module = MethodCall(module, slot.method, METHODS[slot.method][1])
    constants = CallAdapter(module, slot.args, {k: v for k, v in slot.kwargs.items() if k != "return_dict"}).constants()
    source = f"recorded from a {slot.component} call of the pipeline run"
    by_values = type(module).__name__ in MASK_READ_AS_VALUES and slot.single is not None
    if by_values:  # its forward reads the text mask's values in python: one static file for the one-prompt call
        print(f"  {slot.name}: {type(module).__name__} reads its text mask's values in python (token counts): "
              "exported static from the one-prompt call; the loaded pipeline refuses a mask of other values")
        save_call(slot, file, single=True)
    switched = bool(slot.processors) and slot.single is not None and not by_values
    if switched:  # PAG's processors cut the batch in thirds (uncond, cond, perturbed): torch.export specializes it
        # (`chunk(3)`'s guards), and its samples are not computed apart (no pieces): one static file for one prompt
        print(f"  {slot.name}: its processors split the batch by its position (guidance and perturbed thirds): "
              "exported static from the one-prompt call; the loaded pipeline refuses other batches and sizes")
        save_call(slot, file, single=True)
    static = by_values or switched
    loaded = folder_pipeline._component_model(module, file, source, "")
    # the batch by name (latents, text, masks) and by recording: every tensor whose first axis differs between the
    # two-prompt and the one-prompt run (the VAE's latent_sample), so the fallback rungs below keep at least it
    batch = {} if static else {**(loaded.dynamic_axes or {}), **batched_axes(dict(slot.kwargs)), **slot.batch_axes()}
    # the union, axis by axis: an input whose batch follows the batch and whose other sizes vary keeps both (SVD's
    # unet `sample`: batch and latent height / width; a dict merge kept the latter alone, so torch.export fixed the
    # batch of every input that follows it, encoder_hidden_states and added_time_ids too)
    loaded.dynamic_axes = None if static else _union(batch, slot.dynamic()) or None
    ns = argparse.Namespace(**vars(args))
    ns.model, ns.output, ns.inputs, ns.module = str(src / slot.component), str(folder) + os.sep, str(file), None
    # a component is exported for the call its pipeline makes (docs/design.md §9), not for its class's default task:
    # a causal LM read for its hidden states (HiDream's LlamaForCausalLM text encoder) is the recorded call, not
    # the KV-cache graph (§10) that takes no attention_mask / output_hidden_states
    ns.input, ns.dynamic, ns.task = [], [], llm.PLAIN if llm.causal_lm(loaded) is not None else None
    ns.report = str(folder / "normexport_report.json")
    ns.shown_output = str(Path(args.output.rstrip("/" + os.sep)) / slot.name / "model.onnx")  # not the temp folder
    # where no exporter keeps every size that varies dynamic, the ladder tries (exporter/ladder.py "fewer axes")
    # the sizes that vary at this image size (batch, text length; the file serves the recorded image size),
    # then the batch and the image sizes without the text length, then the batch alone (one file for any batch
    # at the recorded size), before a static file
    at_size = slot.dynamic(at_size=True)
    sizes = {n: [a for a in axes if a not in at_size.get(n, [])] for n, axes in slot.dynamic().items()}
    loaded.fewer_axes = [] if static else [_union(batch, at_size), _union(batch, sizes), batch]
    # a text axis that follows the prompt: where the model fixes it, the ladder stops (no file made in vain) and
    # the file is exported padded to one text length where padding is exact for the model (padding.py)
    loaded.required_axes = {} if static else padding.text_axes(slot, module, loaded.dynamic_axes)
    plans: list[dict] = []
    try:
        try:
            rec = convert_stages.convert(ns, loaded)
        except AxesFixed as e:
            rec, plans = _padded(ns, slot, module, loaded, e, file, source, text_limit)
        if rec.exit_code == 0 and batch and not rec.kept and slot.single is not None and not static and \
                not _same_shapes(slot.single, (slot.args, slot.kwargs)):
            # not even the batch: a static file of the one-prompt call (what a pipeline call of one prompt makes)
            print(f"  {slot.name}: no exporter kept the batch dynamic either: exported again, static, from the "
                  "one-prompt call (it serves the recorded size; load() runs other batches in pieces)")
            save_call(slot, file, single=True)
            loaded = folder_pipeline._component_model(module, file, source, "")
            loaded.dynamic_axes = None
            rec = convert_stages.convert(ns, loaded)
    except (UsageError, ExportError) as e:
        print(f"  {slot.name}: {first_line(e, 300)}")
        return None
    if rec.exit_code:
        return None
    if not static and not plans:
        _say_unpadded(slot, module, rec.kept)
    shutil.copy2(src / slot.component / "config.json", folder / "config.json")
    buffers.write(component, folder)  # the values the pipeline may read from the component (buffers.py)
    base = slot_name(slot.component, slot.method)  # a processor state's slot is named as its component's own
    spread = optimum_names.rename_file(folder / "model.onnx", base)  # the names optimum reads
    report = json.loads((folder / "normexport_report.json").read_text())
    outputs = [optimum_names.OUTPUTS.get(base, {}).get(n, n) for n in rec.output_names or []]
    entry = {"component": slot.component, "method": slot.method, "file": f"{slot.name}/model.onnx",
             "dtype": _module_dtype(module),
             "inputs": {spread.get(n, n): {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                                          "dynamic": list((rec.kept or {}).get(n, [])),
                                          **({"values": t.to(torch.int64).flatten().tolist()} if by_values and not
                                             t.is_floating_point() and not t.is_complex() else {})}
                        for n, t in zip(rec.names, rec.inputs)},
             "constants": {k: repr(v) for k, v in constants.items()},
             "outputs": outputs, "structure": rec.output_structure,
             "renames": {**slot.renames, **spread}, "op_counts": report.get("op_counts", {}),
             # what follows the batch: load() runs a file that holds another batch in pieces (pipeline/batching.py);
             # not a file with switched processors: PAG's split its batch in thirds (uncond, cond, perturbed), so
             # its samples are not computed apart
             **({"batch": padding.batch_with_masks(slot.batch, plans)} if slot.batch and not by_values
                and not slot.processors else {}),
             # a text axis the file fixes, served padded with masked rows (pipeline/padding.py)
             **({"text_padding": padding.renamed(plans, spread)} if plans else {}),
             # the processors it was exported with where not the component's own: load() runs this file while
             # the pipeline has set them ({layer path: class name}, runtime.py)
             **({"attn_processors": {k: type(v).__name__ for k, v in slot.processors.items()}}
                if slot.processors else {}),
             # the parameters its call gave a tensor: load() runs the file of the arguments a call gives, where
             # the pipeline calls the component with several sets (pipeline/recording.py)
             "arguments": list(slot.arguments),
             "parity": manifest_mod.parity_summary(report)}
    del module, loaded, rec
    gc.collect()
    return entry


def _method_kwargs(slot: Slot, kwargs: dict) -> dict:
    """A recorded call's kwargs by the method's own parameter names (the slot keeps optimum's:
    `latent_sample` for the VAE's `z`), return_dict left out."""
    back = {v: k for k, v in slot.renames.items()}
    return {back.get(k, k): v for k, v in kwargs.items() if k != "return_dict"}


def _other_calls(slot: Slot) -> list[tuple]:
    """The slot's recorded calls of other shapes as (args, kwargs): the one-prompt call, and each recorded
    shape set of its top-level tensors that differs from the call's (the size-up run: its shapes only were
    kept, so its float tensors are drawn like the call's)."""
    out = []
    if slot.single is not None:
        out.append((tuple(slot.single[0]), _method_kwargs(slot, slot.single[1])))
    for shapes in slot.shapes[1:]:  # by the file's input names, as the slot's kwargs
        made, changed = dict(slot.kwargs), False
        for name, t in slot.kwargs.items():
            shape = shapes.get(name)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and shape and list(t.shape) != list(shape):
                made[name] = torch.randn(shape, dtype=t.dtype, generator=torch.Generator().manual_seed(0)) * \
                    t.float().std().to(t.dtype) + t.float().mean().to(t.dtype)
                changed = True
        if changed and not slot.args:
            out.append(((), _method_kwargs(slot, made)))
    return out


def _padded(ns, slot: Slot, module, loaded, fixed: AxesFixed, file: Path, source: str, text_limit: int | None):
    """The model fixes a text axis that varies with the prompt (`fixed`: the ladder's AxesFixed): where
    padding it with masked rows is exact for the eager module (pipeline/padding.py), the file exported
    from the call padded to the text length served (the pipeline's max_sequence_length, or the longest
    recorded text), with the text axis static; else (or where that file fails) the recorded call as
    before, the text axis made static. (the convert record, the padding plans: [] where none)."""
    args, kwargs = torch.load(file, map_location="cpu", weights_only=True)  # the call being exported
    plans = []
    for group in padding.groups(slot):
        if not any(a in fixed.axes.get(n, []) for n, a in group.items()):
            continue
        length = max(padding.longest(slot, group), text_limit or 0)
        names = ", ".join(f"{n}:{a}" for n, a in group.items())
        plan, why = padding.plan_for(module, tuple(args), dict(kwargs), group, length)
        if plan is None:
            print(f"  {slot.name}: the model fixes its text length ({names}), and padding it is not exact for it "
                  f"({why}): the file serves the recorded text lengths only")
            continue
        print(f"  {slot.name}: the model fixes its text length ({names}): {why} (checked on eager): exported at "
              f"length {length}, shorter texts padded by the loaded pipeline")
        plans.append(plan)
    loaded.required_axes = {}
    if plans:
        bound, _ = padding.pad(padding.bind(module, tuple(args), dict(kwargs)), plans, slot.name)
        save((), bound, file)
        padded = folder_pipeline._component_model(module, file, source, "")
        # the axes the ladder already saw the model fix (the padded call has the same sizes but the text's) not asked
        known = {n: [a for a in ax if a not in fixed.fixed.get(n, [])] for n, ax in (loaded.dynamic_axes or {}).items()}
        others = padding.without_text(fixed.fixed, plans)
        if others:
            print(f"  {slot.name}: the model also fixes {', '.join(f'{n}:{a}' for n, a in others.items())} (torch.export): "
                  "static in the padded file")
        padded.dynamic_axes = padding.without_text(known, plans) or None
        padded.fewer_axes = [padding.without_text(f, plans) for f in loaded.fewer_axes]
        try:
            rec = convert_stages.convert(ns, padded)
            if rec.exit_code == 0:
                return rec, plans
            print(f"  {slot.name}: the padded file did not pass (above): exported from the recorded call instead")
        except (UsageError, ExportError) as e:
            print(f"  {slot.name}: the padded file failed ({first_line(e, 200)}): exported from the recorded call "
                  "instead")
        save(tuple(args), dict(kwargs), file)
    return convert_stages.convert(ns, loaded), []


def _say_unpadded(slot: Slot, module, kept: dict | None) -> None:
    """A text axis that varies with the prompt but that the file fixes and no mask serves padded: why,
    on the terminal (the loaded pipeline serves the recorded text lengths only)."""
    for group in padding.groups(slot):
        if all(a in (kept or {}).get(n, []) for n, a in group.items()):
            continue
        why = padding.maskable(module, slot.args, slot.kwargs, group)
        if why is not None:
            names = ", ".join(f"{n}:{a}" for n, a in group.items())
            print(f"  {slot.name}: its file fixes the text length ({names}), not padded ({why}): the loaded pipeline "
                  "serves the recorded text lengths only")


def _module_dtype(module) -> str | None:
    """The component's floating dtype as the pipeline reads it (`component.dtype`: diffusers' and
    transformers' first floating parameter), e.g. "bfloat16"; None for a module without one."""
    inner = getattr(module, "inner", module)  # MethodCall wraps the autoencoder
    dtype = getattr(inner, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        dtype = next((p.dtype for p in inner.parameters() if p.is_floating_point()), None)
    return str(dtype).replace("torch.", "") if dtype is not None else None


def _weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".bin"))


def _same_file_key(src: Path, slot: Slot) -> tuple | None:
    """What may make two slots one file: the component's files (names and sizes; the contents are
    compared, _digest, only when these match), the method, the recorded call's names and shapes."""
    files = _weight_files(src / slot.component)
    if not files:
        return None
    call = tuple(sorted((n, tuple(s)) for n, s in (slot.shapes[0] if slot.shapes else {}).items()))
    processors = tuple(sorted((k, type(v).__name__) for k, v in slot.processors.items()))
    return tuple((p.name, p.stat().st_size) for p in files), slot.method, call, processors


def _processors_text(processors: dict) -> str:
    """'PAGCFGIdentitySelfAttnProcessor2_0 on mid_block.attentions.0.transformer_blocks.0.attn1' (the
    layers of each class, the first two named)."""
    by_class: dict[str, list[str]] = {}
    for path, proc in processors.items():
        by_class.setdefault(type(proc).__name__, []).append(path.removesuffix(".processor"))
    return "; ".join(f"{c} on {', '.join(p[:2])}" + (f" and {len(p) - 2} more" if len(p) > 2 else "")
                     for c, p in by_class.items())


def _digest(folder: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    for p in _weight_files(folder):
        digest.update(p.name.encode())
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


def _copy_rest(src: Path, index: dict, tmp: Path, exported: set[str]) -> None:
    """model_index.json and every component folder that is not an exported module (scheduler,
    tokenizers, feature extractors), as they are."""
    (tmp / "model_index.json").write_text(json.dumps(optimum_names.tokenizer_classes(index, src), indent=2) + "\n")
    for name in folder_pipeline.components(index):
        if name in exported or not (src / name).is_dir():
            continue
        if _is_module_folder(src / name):
            continue  # a module the pipeline never calls (a safety checker, an image encoder): said above
        shutil.copytree(src / name, tmp / name)


def _is_module_folder(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("*.bin"))


def _replace(tmp: Path, out: Path) -> None:
    """tmp renamed to out (an earlier export there removed first)."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def _same_shapes(a, b) -> bool:
    """Two recorded calls whose tensors have the same shapes, in the same places: a static file of one serves the
    other (SVD's one-video call was the unet's call itself, and its static file was exported twice)."""
    import torch.utils._pytree as pytree

    def shapes(call):
        leaves, spec = pytree.tree_flatten(call)
        return spec, [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in leaves]

    return shapes(a) == shapes(b)


def _union(*axes: dict) -> dict[str, list[int]]:
    """{input: axes} of several such mappings together (axes sorted, once each)."""
    out: dict[str, set] = {}
    for a in axes:
        for n, ax in a.items():
            out.setdefault(n, set()).update(ax)
    return {n: sorted(ax) for n, ax in out.items() if ax}
