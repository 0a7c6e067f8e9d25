"""normexport.load: a MODEL argument -> the module to export, its example inputs, their names and
dynamic axes (docs/design.md §1, §4).

    load(MODEL)           -> LoadedModel  (one entry point for every source)
    call_for(loaded, ...) -> Call         (with --input / --dynamic / --dtype / --module applied)

Sources, one module each: `pt2` (torch.export archives), `torch_file` (TorchScript, trusted
pickle), `factory` (`package.module:callable` + `--weights`), `pretrained` (save_pretrained folders
of transformers / diffusers), `pipeline` (diffusers pipeline folders, run once for a component's
inputs). Example inputs are made in one place, `examples`; `inputs` parses
`--input` / `--dynamic`; `call` adapts keyword / nested calls to flat tensor tuples and names
inputs and outputs; `submodule` captures one block's call (`--module`). Imports go one way:
this file -> resolve -> sources -> examples / call / inputs / model / _util; nothing imports this
file back (tests/test_load_structure.py).

The package is callable: `normexport.load(MODEL)` is `normexport.load.load(MODEL)`.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

from ..errors import UsageError
from .model import TORCH_EXTS, LoadedModel, is_factory
from .pytree_types import import_modules
from . import sniff
from .resolve import Call, call_for


def load(model: str, *, trust_pickle: bool = False, weights: str | None = None,
         imports: list[str] | tuple = (), probe_generating: bool = True, user_inputs: bool = False) -> LoadedModel:
    """Load MODEL; raises UsageError (one line: the problem and the fix) on bad input.
    `imports`: installed modules to import first (`--import`, pytree types of a .pt2).
    `probe_generating=False`: a save_pretrained folder's model that generates comes back with its
    example inputs not yet run in eager (`LoadedModel.probe()` runs them; pretrained.library_model).
    `user_inputs=True` (--input / --inputs given): a folder's model is never called with inputs of
    normexport's making before the user's call is read (pretrained.with_inputs); a component folder
    inside a pipeline repo is then loaded alone, not run through its pipeline."""
    import_modules(list(imports))
    if is_factory(model):
        from .factory import load_factory

        return load_factory(model, weights)
    if weights:
        raise UsageError(f"--weights applies to a `package.module:callable` MODEL, not to the file '{model}'")
    path = Path(model)
    if not path.exists():
        raise UsageError(f"model file not found: '{model}': check the path, or pass `package.module:callable`")
    if path.is_dir():
        from .pipeline import component_of_pipeline, is_pipeline_folder, load_pipeline_folder

        if is_pipeline_folder(path):  # diffusers pipeline (model_index.json): run once when the call is resolved
            return load_pipeline_folder(path)
        if not user_inputs and (parent := component_of_pipeline(path)) is not None:
            # a component folder as the hub lays it out (repo/transformer/ beside repo/model_index.json):
            # the parent pipeline is run and this component kept, called as the pipeline calls it
            return load_pipeline_folder(parent, component=path.name)
        from .pretrained import load_folder

        return load_folder(path, probe_generating=probe_generating, user_inputs=user_inputs)
    kind, what = sniff.kind_of(path)  # by content, whatever the extension (docs/design.md §9)
    if kind == "unknown" and path.suffix in (".pt2",) + TORCH_EXTS:  # damaged: its extension's loader says how
        kind = sniff.EXPORTED if path.suffix == ".pt2" else sniff.TORCH_SAVE
    if kind == sniff.EXPORTED:
        from .pt2 import load_pt2

        return load_pt2(path, trust_pickle)
    if kind in (sniff.TORCHSCRIPT, sniff.TORCH_SAVE, sniff.PICKLE):
        from .torch_file import load_torch_file

        return load_torch_file(path, trust_pickle)
    known = path.suffix in (".pt2",) + TORCH_EXTS
    ext = "" if known or not path.suffix else f"; unknown model extension '{path.suffix}'"
    hint = " (`normexport rewrite` takes ONNX files)" if what == "an ONNX model" else ""
    raise UsageError(f"cannot read '{model}' as a model: it is {what}{hint}{ext}: pass a TorchScript archive "
                     "(torch.jit.save), a .pt2 (torch.export.save), a pickled nn.Module (--trust-pickle), "
                     "a save_pretrained folder or `package.module:callable`")


class _CallableModule(types.ModuleType):
    def __call__(self, model: str, **kwargs) -> LoadedModel:
        return load(model, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["Call", "LoadedModel", "call_for", "is_factory", "load"]
