"""The exported pipeline folder's manifest, `OUT/normexport_pipeline.json` (docs/convert.md, "A
pipeline folder out"): what each slot's file is and how the pipeline calls it, so that
`normexport.pipeline.load(OUT)` puts an onnxruntime session behind the same call, `normexport
build OUT/` makes engines with profiles from the recorded shapes, and `normexport check OUT
--reference DIR` knows the pipeline class.

    {"format": "normexport-pipeline/1", "pipeline": "FluxPipeline",
     "slots": {"transformer": {"component": "transformer", "method": "forward",
                               "file": "transformer/model.onnx", "dtype": "float32",
                               "inputs": {"hidden_states": {"shape": [2, 16, 16], "dtype": "float32",
                                                            "dynamic": [0, 1]}, ...},
                               "constants": {"joint_attention_kwargs": "None", ...},
                               "outputs": ["sample"], "structure": {...}, "fused": {...}}, ...}}

`structure` (normexport.load.call.describe) describes the component's own output (a ModelOutput / BaseOutput, a tuple, a dict),
its tensors numbered in the exported file's output order (load.call.output_names walks the same
way), so the runtime returns what the eager component returns.

`attn_processors` ({layer path: processor class}), on a slot exported with attention processors
other than its component's own (a PAG pipeline's perturbed layers, pipeline/recording.py): the
runtime runs that file while the pipeline has set those processors on the component, the slot
without it while the component holds its own; several slots may so share a component and method.

`text_padding` (pipeline/padding.py): the inputs of a text axis the file fixes, the mask over it and
the file's text length; the runtime pads shorter texts with masked rows and cuts the outputs back.

`arguments` (the method's parameters its recorded call gave a tensor): a component the pipeline
calls with several sets of arguments has a slot per set (pipeline/recording.py); the runtime runs
the file whose set the call gives.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ..errors import UsageError

NAME = "normexport_pipeline.json"
FORMAT = "normexport-pipeline/1"
#: the libraries whose output classes the runtime rebuilds (any other mapping comes back as a dict)
LIBRARIES = ("diffusers.", "transformers.")


def rebuild(structure: dict | None, tensors: list, return_dict: bool = True):
    """The component's output from the file's outputs, as load.call.describe saw it; `return_dict=False`
    gives a library output class as its tuple of values (what diffusers / transformers return)."""
    def walk(node):
        if node is None:
            return None
        if "tensor" in node:
            return tensors[node["tensor"]]
        if "sequence" in node:
            items = [walk(v) for v in node["items"]]
            return items if node["sequence"] == "list" else tuple(items)
        if "mapping" in node:
            values = {k: walk(v) for k, v in zip(node["keys"], node["values"])}
            if node["mapping"] == "dict":
                return values
            if not return_dict:
                return tuple(values.values())
            return output_class(node["mapping"])(**values)
        raise RuntimeError(f"the exported component returned a {node.get('other')}, which its file cannot give back")

    return walk(structure)


def output_class(path: str):
    """A diffusers / transformers output class by its `module:qualname` (other modules are never
    imported from a manifest: a dict stands in)."""
    module, _, qualname = path.partition(":")
    if not module.startswith(LIBRARIES):
        return dict
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return dict
    return obj


def files(entry: dict) -> list[dict]:
    """The file entries of a slot: its own, or each step's of a method cut at its children
    (pipeline/stepping.py)."""
    if "steps" in entry:
        return [k for kinds in entry["steps"].values() for k in kinds]
    return [entry]


def parity_summary(report: dict) -> dict:
    """A file's parity in its entry: whether its convert report's onnxruntime rows ran and passed, the worst error."""
    rows = [r for per in (report.get("results") or {}).get("ort", {}).values() for r in per]
    if not rows:
        return {"checked": False, "note": report.get("parity")}
    return {"checked": True, "passed": all(r.get("passed") for r in rows),
            "max_abs_err": max((r.get("max_abs_err") or 0.0) for r in rows), "rows": len(rows)}


def write(out: Path, manifest: dict) -> None:
    from ..io import write_json

    write_json(manifest, out / NAME)


def read(folder: Path) -> dict:
    """The manifest of an exported pipeline folder; one line naming the fix where it is not one."""
    path = Path(folder) / NAME
    if not path.is_file():
        raise UsageError(f"'{folder}' holds no {NAME}: it is not a pipeline folder written by `normexport convert "
                         "PIPELINE_DIR -o OUT/`; convert the pipeline folder again")
    from ..jsonfile import read_json_object

    manifest = read_json_object(path, "convert the pipeline folder again")
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("slots"), dict):
        raise UsageError(f"'{path}' is not a {FORMAT} manifest: convert the pipeline folder again with this normexport")
    problem = _problem(Path(folder), manifest)
    if problem:
        raise UsageError(f"'{path}' is damaged: {problem}; convert the pipeline folder again")
    return manifest


#: the methods a slot may call (recording.METHODS and forward) and the dtypes an input may have
SLOT_METHODS = ("forward", "decode", "encode")
INPUT_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "bool", "uint8", "int8")


def _problem(folder: Path, manifest: dict) -> str | None:
    """What is wrong in a manifest that parses (one phrase), or None: every slot names a component
    folder and a method, a file inside the folder that exists, inputs with integer shapes, a known
    dtype and dynamic axes within their rank, text constants and outputs, and an output structure
    whose tensor numbers are the file's outputs. Nothing of a manifest is trusted beyond this."""
    root = folder.resolve()
    if not manifest["slots"]:
        return "it lists no slot"
    for slot, e in manifest["slots"].items():
        where = f"slot {slot!r}"
        if not isinstance(e, dict):
            return f"{where} is not an object"
        comp, method = e.get("component"), e.get("method")
        if not isinstance(comp, str) or not comp.isidentifier():
            return f"{where} names no component folder"
        if method not in SLOT_METHODS:
            return f"{where} has method {method!r} (one of {', '.join(SLOT_METHODS)})"
        # a method cut at its children (pipeline/stepping.py): a file per kind of call; else one file
        bad = _steps_problem(folder, root, where, e["steps"], e.get("dynamic")) if "steps" in e else \
            _file_problem(folder, root, where, e)
        if bad:
            return bad
        for key in ("constants", "renames", "attn_processors"):
            table = e.get(key) or {}
            if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
                return f"{where} {key} are not a table of text"
        arguments = e.get("arguments", [])  # the parameters its call gave a tensor (pipeline/recording.py)
        if not isinstance(arguments, list) or not all(isinstance(a, str) for a in arguments):
            return f"{where} arguments are not a list of names"
        batch = e.get("batch", {})  # what follows the batch (pipeline/batching.py)
        if not isinstance(batch, dict) or not all(k in ("inputs", "lists") and isinstance(v, list) and all(
                isinstance(n, str) for n in v) for k, v in batch.items()):
            return f"{where} batch is not lists of input names"
    return None


def _file_problem(folder: Path, root: Path, where: str, e: dict) -> str | None:
    """What is wrong in one file's entry (a slot's, or a step's of a cut method), or None."""
    file = e.get("file")
    if not isinstance(file, str) or not file:
        return f"{where} names no file"
    target = (folder / file).resolve()
    if not target.is_relative_to(root):
        return f"{where} file {file!r} points outside the folder"
    if not target.is_file():
        return f"{where} file {file!r} is missing"
    if e.get("dtype") is not None and e.get("dtype") not in INPUT_DTYPES:
        return f"{where} has dtype {e.get('dtype')!r}"
    inputs = e.get("inputs")
    if not isinstance(inputs, dict):
        return f"{where} has no inputs table"
    for name, i in inputs.items():
        shape = i.get("shape") if isinstance(i, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            return f"{where} input {name!r} has no shape of sizes"
        if i.get("dtype") not in INPUT_DTYPES:
            return f"{where} input {name!r} has dtype {i.get('dtype')!r}"
        dyn = i.get("dynamic", [])
        if not isinstance(dyn, list) or not all(isinstance(a, int) and 0 <= a < len(shape) for a in dyn):
            return f"{where} input {name!r} has dynamic axes {dyn!r} outside its rank {len(shape)}"
        values = i.get("values")
        if values is not None and (not isinstance(values, list) or dyn or len(values) != _size(shape) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in values)):
            return f"{where} input {name!r} has values that are not its static shape's integers"
    outputs = e.get("outputs")
    if not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs):
        return f"{where} has no list of output names"
    bad = _padding_problem(e.get("text_padding", []), inputs, len(outputs))
    if bad:
        return f"{where} text_padding {bad}"
    bad = _structure_problem(e.get("structure"), len(outputs))
    if bad:
        return f"{where} output structure {bad}"
    return None


def _steps_problem(folder: Path, root: Path, where: str, steps, dynamic) -> str | None:
    """What is wrong in a cut method's steps ({child: [step entry]}, pipeline/stepping.py), or None: each
    child names its kinds of call (a key, a file entry, the lists after the call) and the dims its calls
    vary in are a table of axes."""
    if not isinstance(steps, dict) or not steps or not all(isinstance(k, str) and k.isidentifier() and
                                                           isinstance(v, list) and v for k, v in steps.items()):
        return f"{where} steps are not a table of children and their files"
    if not isinstance(dynamic, dict) or not all(isinstance(v, dict) and all(
            isinstance(a, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in a) for a in v.values())
            for v in dynamic.values()):
        return f"{where} has no table of dynamic dims"
    for child, kinds in steps.items():
        for n, k in enumerate(kinds):
            at = f"{where} step {child}.{n}"
            if not isinstance(k, dict) or not isinstance(k.get("key"), str):
                return f"{at} has no key"
            bad = _file_problem(folder, root, at, k)
            if bad:
                return bad
            after = k.get("after")
            if not isinstance(after, dict) or not all(isinstance(v, list) for v in after.values()):
                return f"{at} has no lists after the call"
            names = set(_structure_keys(k.get("structure")))
            for values in after.values():
                for v in values:
                    if isinstance(v, dict) and v.get("tensor") not in names:
                        return f"{at} keeps a list entry {v!r} that its outputs do not have"
                    if not isinstance(v, (dict, str, int, type(None))) or isinstance(v, bool):
                        return f"{at} keeps a list entry {v!r}"
    return None


def _structure_keys(node) -> list[str]:
    return list(node.get("keys") or []) if isinstance(node, dict) and "mapping" in node else []


def _padding_problem(plans, inputs: dict, n_outputs: int) -> str | None:
    """What is wrong in a slot's text_padding (pipeline/padding.py), or None: each plan pads inputs of
    the file on an axis within their rank to a positive length, with a mask input of the file."""
    def whole(v, low=0):
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    if not isinstance(plans, list):
        return "is not a list"
    for p in plans:
        if not isinstance(p, dict) or not isinstance(p.get("inputs"), dict) or not p["inputs"]:
            return "has a plan without inputs"
        for name, axis in p["inputs"].items():
            if name not in inputs or not whole(axis) or axis >= len(inputs[name].get("shape", [])):
                return f"pads {name!r} on axis {axis!r}, which the file's inputs do not have"
        mask = p.get("mask")
        if mask not in inputs or not whole(p.get("mask_axis")) or p["mask_axis"] >= len(inputs[mask]["shape"]):
            return f"names a mask {mask!r} (axis {p.get('mask_axis')!r}) the file's inputs do not have"
        if p.get("mask_dtype") not in INPUT_DTYPES or not isinstance(p.get("mask_made"), bool) or \
                not isinstance(p.get("mask_pad", 0), (int, float)) or not isinstance(p.get("mask_from"), str):
            return "has a mask without a dtype, a pad value or its source"
        if not whole(p.get("length"), 1):
            return f"has length {p.get('length')!r}"
        outs = p.get("outputs", {})
        if not isinstance(outs, dict) or not all(
                isinstance(k, str) and k.isdigit() and int(k) < n_outputs and whole(a) for k, a in outs.items()):
            return "cuts outputs the file does not have"
    return None


def _size(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _structure_problem(node, n_outputs: int) -> str | None:
    if node is None:
        return None
    if not isinstance(node, dict):
        return "holds a non-object"
    if "tensor" in node:
        t = node["tensor"]
        ok = isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_outputs
        return None if ok else f"names tensor {t!r} of {n_outputs} outputs"
    if "sequence" in node:
        items = node.get("items")
        if node["sequence"] not in ("list", "tuple") or not isinstance(items, list):
            return "has a sequence without items"
        return next((p for p in (_structure_problem(v, n_outputs) for v in items) if p), None)
    if "mapping" in node:
        keys, values = node.get("keys"), node.get("values")
        if (not isinstance(node["mapping"], str) or not isinstance(keys, list) or not isinstance(values, list)
                or len(keys) != len(values) or not all(isinstance(k, str) for k in keys)):
            return "has a mapping whose keys and values do not pair"
        return next((p for p in (_structure_problem(v, n_outputs) for v in values) if p), None)
    if "other" in node:
        return None
    return "holds an unknown entry"


def is_exported_pipeline(folder) -> bool:
    return Path(folder).is_dir() and (Path(folder) / NAME).is_file()
