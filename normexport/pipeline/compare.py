"""`normexport check OUT --reference PIPELINE_DIR [--steps N]`: the exported pipeline against the
eager one, end to end (docs/convert.md, "A pipeline folder out").

Three runs of the same call (the generic call of normexport.load.pipeline at the size the folder
was exported at, N steps, one seed): the exported pipeline (onnxruntime, or with `--backend trt` the
TensorRT engines `normexport build OUT/` wrote), the eager pipeline in
its own dtype, and the eager pipeline in float64. Every run draws its noise in float32 from the
same generator (diffusers' `randn_tensor`, cast after the draw), so the three start from the
same latents and add the same noise.

Reported (and in --json): per component, its first call in the exported run fed to the eager
component too (max abs error of the file and of eager against float64); the final latents (what
the VAE decodes) and the decoded image (max abs error, PSNR against eager and against float64).
The verdict is the project's (docs/design.md §7), for the image, the final latents and each
component: (1) "2x eager": no farther from the float64 run than twice the eager pipeline is (or
within the dtype's floor); where that fails, (2) "plain export": no farther than 1.25x the same
pipeline with every component exported by plain torch.onnx (no normexport changes) is — the
runtime's and the exporter's own error (torch.onnx folds a DiT's timestep frequencies one ulp off
eager's, which at t = 999 moves the embedding by ~5e-5) is not normexport's. The plain pipeline is
built only when rule 1 fails.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.utils._pytree as pytree

from ..errors import ParityError, UsageError, first_line
from ..load import pipeline as folder_pipeline
from ..load._util import quiet
from ..parity.reference import kept_in_float64
from ..parity.tolerances import eager_limit_for, floor_for, plain_limit_for, tolerance_for
from ..parity.verdict import abs_diff
from . import buffers
from . import manifest as manifest_mod
from . import optimum_names


def run(args) -> int:
    out, ref = Path(args.onnx_model), Path(args.reference)
    manifest = manifest_mod.read(out)
    _refuse_single_model_options(args)
    if args.backend == "all":
        raise UsageError("--backend all: an exported pipeline folder is checked on one backend at a time: "
                         "--backend ort, ort-cuda or trt")
    if args.plugin and args.backend != "trt":
        raise UsageError(f"--plugin {args.plugin}: the plugin library is TensorRT's; add --backend trt (the engines "
                         "`normexport build OUT/` wrote) or leave --plugin out")
    if not folder_pipeline.is_pipeline_folder(ref):
        raise UsageError(f"--reference {ref}: an exported pipeline folder is checked against the diffusers pipeline "
                         "folder it was converted from (model_index.json): pass that folder")
    index = folder_pipeline.load_pipeline_folder(ref).module.index
    if index["_class_name"] != manifest["pipeline"]:
        raise UsageError(f"--reference {ref} is a {index['_class_name']}, {out} a {manifest['pipeline']}: pass the "
                         "folder it was converted from")
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: give at least 1 step")
    from .runtime import load

    exported = load(out, backend=args.backend, plugin=args.plugin)  # refuses a backend that cannot run here
    result = compare(out, ref, index, manifest, steps=args.steps, exported=exported, backend=args.backend)
    _print(result)
    if args.json:
        from ..io import write_json

        write_json(result, args.json, "--json")
    return 0 if result["passed"] else 1


#: check's options that an exported pipeline folder's check takes (the others are a single file's)
PIPELINE_OPTIONS = ("onnx_model", "reference", "steps", "backend", "plugin", "json")


def _refuse_single_model_options(args) -> None:
    """An option of the single-file check given to a pipeline folder's check is refused, not ignored."""
    import argparse

    from ..parity import add_arguments

    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    given = [a.option_strings[0] for a in p._actions if a.option_strings and a.dest not in PIPELINE_OPTIONS
             and getattr(args, a.dest, a.default) != a.default]
    if given:
        raise UsageError(f"{', '.join(given)}: not options of an exported pipeline folder's check (it runs the "
                         "pipeline's own call end to end; it takes --steps, --backend, --plugin, --json): leave "
                         f"{'them' if len(given) > 1 else 'it'} out")


def compare(out: Path, ref: Path, index: dict, manifest: dict, steps: int, exported=None, backend: str = "ort") -> dict:
    from .runtime import load

    side = int(manifest.get("side") or folder_pipeline.SIDE)
    if exported is None:
        exported = load(out, backend=backend)
    runs = {}
    calls: dict = {}
    with _float32_noise():
        try:
            runs["exported"] = _run(exported, ref, side, steps, calls=calls)
        except Exception as e:  # noqa: BLE001 - a component file that cannot take the pipeline's call
            raise ParityError(f"the exported {manifest['pipeline']} failed in its {steps}-step run "
                              f"({type(e).__name__}: {first_line(e, 300)})") from None
        eager = folder_pipeline.build(ref, index)
        dtype = getattr(eager, "dtype", torch.float32)
        runs["eager"] = _run(eager, ref, side, steps)
        components = _components(calls, eager, manifest)
        del eager
        runs["float64"], float64_note = _float64_run(ref, index, side, steps, components, calls, manifest)
    latents = _latents_row(runs, dtype)
    image = _judge(runs["exported"]["image"], runs["eager"]["image"], runs["float64"]["image"], psnr=True, dtype=dtype)
    if not (latents["passed"] and image["passed"] and all(c.get("passed", True) for c in components.values())):
        _plain_rule(out, ref, index, manifest, side, steps, calls, runs, components, latents, image)
    for c in components.values():
        c.pop("_ref", None)
    passed = latents["passed"] and image["passed"] and all(c.get("passed", True) for c in components.values())
    return {"command": "check", "pipeline": manifest["pipeline"], "exported": str(out), "reference": str(ref),
            "backend": backend, "steps": steps, "size": f"{side}x{side}", "components": components, "latents": latents, "image": image,
            "rules": ["2x eager: |exported - float64| <= max(2 x |eager - float64|, floor)",
                      "plain export: |exported - float64| <= 1.25 x |plain export's pipeline - float64| + floor"],
            "passed": passed, **({"float64_note": float64_note} if float64_note else {})}


def _float64_run(ref: Path, index: dict, side: int, steps: int, components: dict, calls: dict,
                 manifest: dict) -> tuple[dict, str | None]:
    """The eager pipeline in float64, its components run as the single-file float64 reference runs
    (parity.reference.kept_in_float64: lower-float casts kept in float64; a float64 text encoder's
    masked rows are otherwise NaN where float32 eager is finite), then each exported component's
    call fed to it (_components_fp64). Returns (the run, None), or, where the components cannot run
    that way, the run with the float64 copy's own casts and a note saying so."""
    eager64 = folder_pipeline.build(ref, index)
    with quiet():  # diffusers warns of modules kept in float32 (none in float64)
        eager64.to(torch.float64)
    modules = [c for c in eager64.components.values() if isinstance(c, torch.nn.Module)]
    try:
        with kept_in_float64(modules):
            run = _run(eager64, ref, side, steps)
            _components_fp64(components, calls, eager64, manifest)
        return run, None
    except Exception as e:  # noqa: BLE001 - as the single-file reference: then the float64 copy as it is
        note = (f"the float64 run with lower-float casts kept in float64 failed ({type(e).__name__}: "
                f"{first_line(e, 160)}): the float64 pipeline ran with its own casts")
        run = _run(eager64, ref, side, steps)
        _components_fp64(components, calls, eager64, manifest)
        return run, note


@contextlib.contextmanager
def _float32_noise():
    """diffusers' randn_tensor, wherever a pipeline or scheduler module imported it, draws in
    float32 and casts: a float64 run starts from the same noise as a float32 one."""
    from diffusers.utils import torch_utils

    original = torch_utils.randn_tensor

    def randn_tensor(shape, generator=None, device=None, dtype=None, layout=None, **kwargs):
        want = dtype or torch.float32
        t = original(shape, generator=generator, device=device, dtype=torch.float32 if want == torch.float64 else want,
                     layout=layout, **kwargs)
        return t.to(want)

    patched = [m for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("diffusers")
               and getattr(m, "randn_tensor", None) is original]
    for m in patched:
        m.randn_tensor = randn_tensor
    try:
        yield
    finally:
        for m in patched:
            m.randn_tensor = original


def _run(pipe, ref: Path, side: int, steps: int, calls: dict | None = None) -> dict:
    """The generic call, N steps, output_type np: the image and what the VAE decoded; `calls`
    collects each exported component's first call (args, kwargs, output)."""
    modules = {n: c for n, c in folder_pipeline.registered(pipe).items() if isinstance(c, torch.nn.Module)}
    kwargs, _ = folder_pipeline.call_arguments(pipe, modules, ref, None)
    kwargs.update(num_inference_steps=steps, output_type="np", generator=torch.Generator().manual_seed(0))
    if "height" in kwargs:
        kwargs["height"] = kwargs["width"] = side
    seen: dict = {}
    with contextlib.ExitStack() as stack:
        for name, m in modules.items():
            for method in ("decode",):
                if callable(getattr(m, method, None)):
                    _spy(stack, m, method, lambda a, k, r: seen.setdefault("decoded", _first_tensor(a, k)))
            if calls is not None and hasattr(m, "_slots"):  # an exported component (runtime.OrtComponent)
                for method in m._slots:
                    # by the slot whose file ran (one per attention-processor state the pipeline set, and per argument set), with the
                    # processors the component held: the eager component is called with them too
                    _spy(stack, m, method, lambda a, k, r, m=m, method=method: calls.setdefault(
                        m.session(method, a, k).slot, (_clone(a), _clone(k), _clone(r), m.changed_processors())))
        with torch.no_grad(), quiet():
            result = pipe(**kwargs)
    images = getattr(result, "images", None)
    if images is None:
        images = result[0]
    image = np.asarray(images, dtype=np.float64)
    decoded = seen.get("decoded")
    return {"image": image, "latents": decoded.double().numpy() if decoded is not None else None}


def _spy(stack: contextlib.ExitStack, obj, attr: str, after) -> None:
    original = getattr(obj, attr)

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        after(args, kwargs, result)
        return result

    previous = vars(obj).get(attr)  # an instance attribute already there (reference.kept_in_float64's), or None
    setattr(obj, attr, wrapped)
    stack.callback(lambda: vars(obj).pop(attr, None) if previous is None else setattr(obj, attr, previous))


def _first_tensor(args, kwargs):
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
    return None


def _clone(x):
    return pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, x)


def _tensors(x) -> list[torch.Tensor]:
    """The tensors of an output; a distribution (the VAE's encode) by its parameters."""
    out = []
    for t in pytree.tree_leaves(x):
        if not isinstance(t, torch.Tensor):
            t = getattr(t, "parameters", None)
        if isinstance(t, torch.Tensor):
            out.append(t)
    return out


@contextlib.contextmanager
def processors_set(module, processors: dict):
    """`module` (a diffusers model, or a loaded one: its meta module's) holding the attention
    processors `processors` ({layer path: processor}) on those layers, its own back after."""
    if not processors:
        yield module
        return
    own = dict(module.attn_processors)
    module.set_attn_processor({**own, **processors})
    try:
        yield module
    finally:
        module.set_attn_processor(own)


def _components(calls: dict, eager, manifest: dict) -> dict:
    """Each exported slot's first call of the exported run, fed to the eager component (holding the
    attention processors the exported one held)."""
    out = {}
    for slot, (args, kwargs, got, processors) in calls.items():
        name, method = manifest["slots"][slot]["component"], manifest["slots"][slot]["method"]
        module = eager.components.get(name)
        try:
            with torch.no_grad(), quiet(), processors_set(module, processors):
                want = getattr(module, method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            out[slot] = {"error": f"eager {name}.{method} refused the exported run's call ({first_line(e, 120)})",
                         "passed": False}
            continue
        out[slot] = {"_got": _tensors(got), "_eager": _tensors(want)}
    return out


def _components_fp64(components: dict, calls: dict, eager64, manifest: dict) -> None:
    for slot, (args, kwargs, _, processors) in calls.items():
        entry = components.get(slot)
        if entry is None or "_got" not in entry:
            continue
        name, method = manifest["slots"][slot]["component"], manifest["slots"][slot]["method"]
        to64 = lambda v: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
        with torch.no_grad(), quiet(), processors_set(eager64.components[name], processors) as module:
            ref = getattr(module, method)(*pytree.tree_map(to64, args), **pytree.tree_map(to64, kwargs))
        got, eager = entry.pop("_got"), entry.pop("_eager")
        rows = [_judge(g.double().numpy(), e.double().numpy(), r.double().numpy(),
                       dtype=e.dtype if e.is_floating_point() else torch.float32)
                for g, e, r in zip(got, eager, _tensors(ref))]
        if not rows or len(got) != len(eager):
            entry.update(passed=False, error=f"{len(got)} outputs from the file, {len(eager)} from eager {name}.{method}")
            continue
        entry.update({"outputs": len(rows), "max_abs_err": max(r["max_abs_err"] for r in rows),
                      "eager_err": max(r["eager_err"] for r in rows), "passed": all(r["passed"] for r in rows),
                      "rule": "2x eager", "_ref": [t.double().numpy() for t in _tensors(ref)]})
        orphans = [r["no_float64"] for r in rows if "no_float64" in r]
        if orphans:  # outputs where the float64 run is non-finite and eager finite (_judge)
            entry["no_float64"] = {"elements": sum(o["elements"] for o in orphans),
                                   "max_abs_diff_vs_eager": max(o["max_abs_diff_vs_eager"] for o in orphans),
                                   "passed": all(o["passed"] for o in orphans)}
            entry["note"] = "; ".join(r["note"] for r in rows if "note" in r)


def _plain_rule(out: Path, ref: Path, index: dict, manifest: dict, side: int, steps: int, calls: dict, runs: dict,
                components: dict, latents: dict, image: dict) -> None:
    """Rule 2 where rule 1 failed: the same pipeline with every component a plain torch.onnx export
    of the eager component (its call from the exported run), run the same way."""
    import shutil
    import tempfile

    from ..export import convert_module
    from ..io import save_onnx
    from . import stepped_export
    from .exporting import MethodCall, _copy_rest
    from .runtime import load
    from .recording import slot_name
    from ..load.call import CallAdapter

    eager = folder_pipeline.build(ref, index)
    tmp = Path(tempfile.mkdtemp(prefix="normexport-plain-pipeline-"))
    try:
        # the plain pipeline is the reference folder's (its configs, scheduler, tokenizers), each component a
        # plain export: nothing of OUT's but the call descriptions in its manifest
        (tmp / "out").mkdir()
        _copy_rest(ref, index, tmp / "out", {e["component"] for e in manifest["slots"].values()})
        plain_manifest = copy.deepcopy(manifest)  # the plain files' own fixed sizes (below)
        # a slot the check's run never called (a PAG pipeline's file without perturbed attention) has no call to
        # export from: left out (the run does not need it)
        plain_manifest["slots"] = {s: e for s, e in plain_manifest["slots"].items() if s in calls}
        for slot, entry in plain_manifest["slots"].items():
            entry.pop("text_padding", None)  # the plain file is exported from the check run's own call (its text length)
            (tmp / "out" / slot).mkdir(exist_ok=True)
            shutil.copy2(ref / entry["component"] / "config.json", tmp / "out" / slot / "config.json")
            buffers.write(eager.components[entry["component"]], tmp / "out" / slot)
            args, kwargs, _, processors = calls[slot]
            module = eager.components[entry["component"]]
            if "steps" in entry:  # a method cut at its children: each kind of the run's call, plain (stepping.py)
                plain_manifest["slots"][slot] = stepped_export.plain_twin(module, slot, entry, args, kwargs, tmp / "out")
                continue
            if entry["method"] != "forward":
                module = MethodCall(module, entry["method"], entry.get("renames") or {})
                kwargs = {(entry.get("renames") or {}).get(k, k): v for k, v in
                          _bound(getattr(type(module.inner), entry["method"]).__get__(module.inner), args, kwargs).items()
                          if not isinstance(v, torch.Generator)}
                args = ()
            kwargs = {k: v for k, v in kwargs.items() if k != "return_dict"}
            adapter = CallAdapter(module, tuple(args), kwargs)
            dynamic = {n: i["dynamic"] for n, i in entry["inputs"].items() if i.get("dynamic")}
            with quiet(), processors_set(eager.components[entry["component"]], processors):
                model = convert_module(adapter, adapter.example_inputs, target="onnx", input_names=adapter.input_names,
                                       output_names=entry["outputs"], dynamic_axes=dynamic or None, fold_bn=False,
                                       swap_norms=False, rewrite=False)
            save_onnx(model, tmp / "out" / entry["file"])
            optimum_names.rename_file(tmp / "out" / entry["file"], slot_name(entry["component"], entry["method"]))
            _fixed_sizes(entry, tmp / "out" / entry["file"])
        manifest_mod.write(tmp / "out", plain_manifest)
        del eager
        plain_pipe = load(tmp / "out", backend="ort")
        for slot, c in components.items():  # each component: the plain file on the same call
            entry = manifest["slots"].get(slot)
            if c.get("passed", True) or "_ref" not in c or entry is None:
                continue
            args, kwargs, _, processors = calls[slot]
            component = folder_pipeline.registered(plain_pipe)[entry["component"]]
            with torch.no_grad(), processors_set(component, processors):
                got = _tensors(getattr(component, entry["method"])(*args, **kwargs))
            _plain_judge(c, max(_finite_err(g.double().numpy(), r) for g, r in zip(got, c["_ref"])),
                         max(_max_ref(r) for r in c["_ref"]))
        with _float32_noise():
            plain = _run(plain_pipe, ref, side, steps)
    except Exception as e:  # noqa: BLE001 - the plain export could not be made: rule 1 stands
        note = f"the plain-export pipeline could not be built ({type(e).__name__}: {first_line(e, 160)})"
        for row in (latents, image):
            row.setdefault("note", note)
        return
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for what, row in (("latents", latents), ("image", image)):
        if row.get("passed") or plain[what] is None or "max_abs_err" not in row:
            continue
        _plain_judge(row, _finite_err(plain[what], runs["float64"][what]), _max_ref(runs["float64"][what]))


def _fixed_sizes(entry: dict, file: Path) -> None:
    """The manifest entry's input shapes where the plain file fixes a size (it is exported from the
    check run's call, whose batch may not be the batch OUT's file was exported at: a one-prompt call
    without batched guidance gives batch 1, where OUT's file holds 2), so that the runtime calls it in
    pieces of the batch it takes (pipeline/batching.split) and never pads to a batch it refuses."""
    import onnx

    for v in onnx.load(str(file), load_external_data=False).graph.input:
        i = entry["inputs"].get(v.name)
        dims = v.type.tensor_type.shape.dim
        if i is not None and len(dims) == len(i.get("shape") or ()):
            i["shape"] = [d.dim_value if d.HasField("dim_value") else s for d, s in zip(dims, i["shape"])]


def _bound(fn, args, kwargs) -> dict:
    import inspect

    return dict(inspect.signature(fn).bind_partial(*args, **kwargs).arguments)


#: the floor of both rules is float32's (docs/design.md §7: 4 x eps32 x max|float64 run|), whatever the
#: pipeline's dtype: the exported and eager runs are compared in float32 arrays
FLOOR_DTYPE = torch.float32


def _latents_row(runs: dict, dtype: torch.dtype = torch.float32) -> dict:
    """Rule 1 on what the VAE decoded; where no run decoded anything (a pixel-space pipeline: DDPM,
    DDIM, consistency models) the row does not apply and the image alone is judged. One run without
    the latents the others have still fails."""
    if all(r["latents"] is None for r in runs.values()):
        return {"passed": True, "not_applicable": True,
                "note": "no VAE decode in any run (a pixel-space pipeline): the image alone is judged"}
    return _judge(runs["exported"]["latents"], runs["eager"]["latents"], runs["float64"]["latents"], dtype=dtype)


def _judge(got, eager, ref64, psnr: bool = False, dtype: torch.dtype = torch.float32) -> dict:
    """Rule 1 ("2x eager") on one output: |got - ref64| <= max(2 x |eager - ref64|, floor), errors as
    the single-file verdict takes them (parity.verdict.abs_diff: matching non-finite values count 0,
    any other non-finite difference inf; eager's own error where eager is finite). Where the float64
    run is non-finite and eager (in `dtype`) finite there is no float64 reference: those elements
    are judged against eager by `dtype`'s tolerance (docs/design.md §7, rule 'tolerance'), the rest
    by rule 1, both must pass. PSNR (against eager and against float64, peak 1) is reported with the
    image; it decides nothing."""
    if got is None or eager is None or ref64 is None:
        return {"passed": False, "note": "not produced by every run"}
    got, eager, ref64 = (np.asarray(a, dtype=np.float64) for a in (got, eager, ref64))
    if got.shape != ref64.shape or eager.shape != ref64.shape:
        return {"passed": False, "note": f"shapes differ: {got.shape} / {eager.shape} / {ref64.shape}"}
    orphan = ~np.isfinite(ref64) & np.isfinite(eager)  # no float64 reference there
    rest = ~orphan
    diff, eager_diff = abs_diff(got, ref64)[rest], abs_diff(eager, ref64)[rest]
    eager_diff = eager_diff[np.isfinite(eager_diff)]
    err = float(diff.max()) if diff.size else 0.0
    eager_err = float(eager_diff.max()) if eager_diff.size else 0.0
    max_ref = _max_ref(ref64)
    limit = eager_limit_for(FLOOR_DTYPE, max_ref, eager_err)
    with np.errstate(invalid="ignore"):
        vs_eager = float(abs_diff(got, eager).max()) if got.size else 0.0
    row = {"max_abs_err": err, "eager_err": eager_err, "max_abs_diff_vs_eager": vs_eager,
           "floor": floor_for(FLOOR_DTYPE, max_ref), "limit": limit, "passed": bool(err <= limit), "rule": "2x eager"}
    if orphan.any():
        n = int(np.count_nonzero(orphan))
        off = float(abs_diff(got[orphan], eager[orphan]).max())
        tol = tolerance_for(dtype, max(max_ref, float(np.abs(eager[orphan]).max())))
        row["no_float64"] = {"elements": n, "max_abs_diff_vs_eager": off, "tolerance": tol, "passed": bool(off <= tol)}
        row["note"] = (f"the float64 run is non-finite at {n} of {got.size} element(s) where eager is finite: no float64 "
                       f"reference there, judged against eager: |exported - eager| {off:.3g} "
                       f"{'<=' if off <= tol else '>'} the {str(dtype).replace('torch.', '')} tolerance {tol:.3g}")
        if not rest.any():
            row["rule"] = "tolerance"
        row["passed"] = row["passed"] and row["no_float64"]["passed"]
    if psnr:
        row["psnr_vs_eager_db"] = _psnr(got, eager)
        row["psnr_vs_float64_db"] = _psnr(got, ref64)
    return row


def _max_ref(ref64) -> float:
    """max |ref64| over its finite elements (0 when none is)."""
    ref64 = np.asarray(ref64, dtype=np.float64)
    finite = np.abs(ref64[np.isfinite(ref64)])
    return float(finite.max()) if finite.size else 0.0


def _finite_err(got, ref64) -> float:
    """max |got - ref64| (abs_diff) over the elements where ref64 is finite: the plain export's error
    (elements without a float64 reference are judged against eager, not by rule 2)."""
    got, ref64 = np.asarray(got, dtype=np.float64), np.asarray(ref64, dtype=np.float64)
    d = abs_diff(got, ref64)[np.isfinite(ref64)]
    return float(d.max()) if d.size else 0.0


def _plain_judge(row: dict, plain_err: float, max_ref: float) -> None:
    """Rule 2 ("plain export") on a row rule 1 failed: passes when its error is within
    1.25 x the plain export's pipeline's (or component's) error + floor."""
    row["plain_err"] = plain_err
    row["plain_limit"] = plain_limit_for(FLOOR_DTYPE, max_ref, plain_err)
    if not math.isfinite(plain_err):  # NaN / inf in the plain export's run where float64 is finite
        row["plain_note"] = f"the plain export's error is {plain_err}: it excuses nothing"
        return
    if row["max_abs_err"] <= row["plain_limit"] and row.get("no_float64", {}).get("passed", True):
        row.update(passed=True, rule="plain export")


def _psnr(a: np.ndarray, b: np.ndarray, peak: float = 1.0) -> float:
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(peak * peak / mse)


def _print(result: dict) -> None:
    runtime = {"ort": "onnxruntime", "ort-cuda": "onnxruntime CUDA", "trt": "TensorRT"}.get(result.get("backend"), "?")
    print(f"pipeline {result['pipeline']}: {result['exported']} ({runtime}) vs {result['reference']} ({result['steps']} steps, "
          f"{result['size']}; errors against the float64 run of the eager pipeline)")
    if result.get("float64_note"):
        print(f"note: {result['float64_note']}")
    print(f"{'what':<22}{'file_err':>11}{'eager_err':>11}{'limit':>11}  result")
    for slot, c in result["components"].items():
        if "error" in c:
            print(f"{slot:<22}{'-':>11}{'-':>11}{'-':>11}  FAIL ({c['error']})")
            continue
        print(f"{slot:<22}{c['max_abs_err']:>11.2e}{c['eager_err']:>11.2e}{'':>11}  {'PASS' if c['passed'] else 'FAIL'} "
              f"{c.get('rule', '2x eager')}")
        if c.get("note"):
            print(f"{'':<22}  {c['note']}")
    for what in ("latents", "image"):
        r = result[what]
        if "max_abs_err" not in r:
            print(f"{what:<22}  {'-' if r.get('not_applicable') else 'FAIL'} ({r.get('note')})")
            continue
        extra = f"  PSNR {r['psnr_vs_eager_db']:.1f} dB vs eager" if "psnr_vs_eager_db" in r else ""
        if "plain_err" in r:
            extra += f"  (plain export's pipeline: {r['plain_err']:.2e}, limit {r['plain_limit']:.2e})"
        print(f"{what:<22}{r['max_abs_err']:>11.2e}{r['eager_err']:>11.2e}{r['limit']:>11.2e}  "
              f"{'PASS' if r['passed'] else 'FAIL'} {r.get('rule', '')}{extra}")
        if r.get("note"):
            print(f"{'':<22}  {r['note']}")
    print(("PASSED" if result["passed"] else "FAILED") + f": the exported {result['pipeline']} "
          + ("is" if result["passed"] else "is not") + " within the verdict's limits (2x the eager pipeline's distance "
          "from float64, or 1.25x the plain export's)")
