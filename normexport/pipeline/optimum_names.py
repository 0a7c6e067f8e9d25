"""The names optimum's ORTDiffusionPipeline reads in an exported folder (docs/convert.md, "A
pipeline folder out"), applied to each written file and to model_index.json. Read from
optimum-onnx 0.1.0 (optimum/onnxruntime/modeling_diffusion.py, exporters/onnx/model_configs.py):

- the denoiser's output: `out_sample` (UNet), `out_hidden_states` (transformers);
- a UNet's `added_cond_kwargs` entries are fed by their own names (`text_embeds`, `time_ids`);
- an output dim is an input dim's name or a space-separated expression of them (`s68 * 8`;
  optimum evaluates it with io binding);
- tokenizer classes by their fast names (a transformers 5 folder holds tokenizer.json only, which
  the slow classes of the transformers optimum pins cannot read).

Only names change: the graph, its weights (external data untouched) and its numbers do not.
"""

from __future__ import annotations

import re
from pathlib import Path

import onnx

#: slot -> {output name: optimum's}
OUTPUTS = {"unet": {"sample": "out_sample", "sample_out": "out_sample"},
           "transformer": {"sample": "out_hidden_states", "sample_out": "out_hidden_states"}}
#: dict parameters whose entries optimum feeds by their own names
SPREAD = ("added_cond_kwargs",)
#: tokenizer classes optimum's transformers can read from tokenizer.json alone
FAST = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def rename_file(path: Path, slot: str) -> dict[str, str]:
    """Rename the file's inputs / outputs as optimum reads them; {old input name: new} (the
    runtime feeds by the new names)."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    outputs = OUTPUTS.get(slot, {})
    inputs = {i.name: i.name.split(".", 1)[1] for i in graph.input if i.name.split(".", 1)[0] in SPREAD}
    taken = {i.name for i in graph.input} | {o.name for o in graph.output}
    inputs = {k: v for k, v in inputs.items() if v not in taken}
    outputs = {k: v for k, v in outputs.items() if v not in taken and k in {o.name for o in graph.output}
               and k not in {i.name for i in graph.input}}  # UNet's `sample` in stays `sample`
    mapping = {**inputs, **outputs}
    if mapping:
        _rename(graph, mapping)
    _spaced_dims(graph)
    onnx.save(model, str(path))
    return inputs


def _rename(graph, mapping: dict[str, str]) -> None:
    for v in list(graph.input) + list(graph.output) + list(graph.value_info):
        v.name = mapping.get(v.name, v.name)
    for node in graph.node:
        node.input[:] = [mapping.get(x, x) for x in node.input]
        node.output[:] = [mapping.get(x, x) for x in node.output]
        for attr in node.attribute:  # subgraphs (If / Loop) read outer names
            if attr.type == onnx.AttributeProto.GRAPH:
                _rename(attr.g, mapping)


def _spaced_dims(graph) -> None:
    """Output dims written as expressions of input dims with spaces between tokens; an output's
    leading dim named by no input takes the first input's batch name when their sizes are one
    symbol in both (the exporter's own names, e.g. `Mullast_hidden_state_dim_0`)."""
    names = {d.dim_param for v in graph.input for d in v.type.tensor_type.shape.dim if d.dim_param}
    batch = next((v.type.tensor_type.shape.dim[0].dim_param for v in graph.input
                  if v.type.tensor_type.shape.dim and v.type.tensor_type.shape.dim[0].dim_param), None)
    for v in graph.output:
        for i, d in enumerate(v.type.tensor_type.shape.dim):
            p = d.dim_param
            if not p or p in names:
                continue
            tokens = re.findall(r"[A-Za-z_]\w*|\d+|//|\*\*|[-+*/%()]", p)
            symbols = [t for t in tokens if re.match(r"[A-Za-z_]", t)]
            if symbols and all(s in names for s in symbols):
                d.dim_param = " ".join(tokens)
            elif i == 0 and batch and len(symbols) == 1:
                d.dim_param = batch


def tokenizer_classes(index: dict, folder: Path) -> dict:
    """model_index.json with tokenizers saved as tokenizer.json alone named by a fast class."""
    import importlib

    out = dict(index)
    for name, value in index.items():
        if not (isinstance(value, list) and len(value) == 2 and value[0] == "transformers"):
            continue
        cls = value[1]
        if not isinstance(cls, str) or cls.endswith("Fast") or not (folder / name / "tokenizer.json").is_file():
            continue
        if cls in FAST:
            out[name] = ["transformers", FAST[cls]]
            continue
        transformers = importlib.import_module("transformers")
        if cls.endswith("Tokenizer") and getattr(transformers, cls + "Fast", None) is not None:
            out[name] = ["transformers", cls + "Fast"]
    return out
