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
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from ..errors import UsageError, first_line

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


def write(out: Path, manifest: dict) -> None:
    from ..io import write_json

    write_json(manifest, out / NAME)


def read(folder: Path) -> dict:
    """The manifest of an exported pipeline folder; one line naming the fix where it is not one."""
    path = Path(folder) / NAME
    if not path.is_file():
        raise UsageError(f"'{folder}' holds no {NAME}: it is not a pipeline folder written by `normexport convert "
                         "PIPELINE_DIR -o OUT/`; convert the pipeline folder again")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read '{path}' ({first_line(e, 120)}): convert the pipeline folder again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("slots"), dict):
        raise UsageError(f"'{path}' is not a {FORMAT} manifest: convert the pipeline folder again with this normexport")
    return manifest


def is_exported_pipeline(folder) -> bool:
    return Path(folder).is_dir() and (Path(folder) / NAME).is_file()
