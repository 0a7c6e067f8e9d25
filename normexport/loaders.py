"""Turn a MODEL argument into an nn.Module (DESIGN §4).

Forms: `x.pt2` (torch.export), `x.pt` / `x.pth` TorchScript archive, a pickled nn.Module (only
with trust_pickle=True), `package.module:callable` (optionally with a weights_only state dict).
A pickle is never unpickled unless the user said --trust-pickle: everything else goes through
torch.load(weights_only=True), whose restricted unpickler runs no code from the file.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pickle
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import UsageError

TORCH_EXTS = (".pt", ".pth", ".bin", ".ckpt")


@dataclasses.dataclass
class LoadedModel:
    module: nn.Module
    kind: str  # "exported-program" | "torchscript" | "pickle" | "factory"
    example_inputs: tuple | None = None
    input_names: list[str] | None = None
    dynamic_axes: dict[str, list[int]] | None = None
    exported_program: Any = None  # torch.export.ExportedProgram for .pt2
    output_names: list[str] | None = None


def is_factory(model: str) -> bool:
    return ":" in model and not os.path.exists(model) and not model.endswith((".pt2",) + TORCH_EXTS)


def load(model: str, *, trust_pickle: bool = False, weights: str | None = None) -> LoadedModel:
    """Load MODEL; raises UsageError (one line: the problem and the fix) on bad input."""
    if is_factory(model):
        return _load_factory(model, weights)
    if weights:
        raise UsageError(f"--weights applies to a `package.module:callable` MODEL, not to the file '{model}'")
    path = Path(model)
    if not path.exists():
        raise UsageError(f"model file not found: '{model}': check the path, or pass `package.module:callable`")
    if path.is_dir():
        raise UsageError(f"'{model}' is a directory: pass a .pt2, .pt/.pth file or `package.module:callable`")
    if path.suffix == ".pt2":
        return _load_pt2(path)
    if path.suffix in TORCH_EXTS:
        return _load_torch_file(path, trust_pickle)
    raise UsageError(f"unknown model extension '{path.suffix}' for '{model}': use .pt2 (torch.export), "
                     ".pt/.pth (TorchScript or pickled module) or `package.module:callable`")


def _load_pt2(path: Path) -> LoadedModel:
    try:
        ep = torch.export.load(str(path))
    except Exception as e:
        raise UsageError(f"cannot read '{path}' as a torch.export .pt2 archive ({_short(e)}): re-save it with torch.export.save") from None
    args, kwargs = ep.example_inputs or ((), {})
    if kwargs:
        raise UsageError(f"'{path}' was exported with keyword inputs: export it with positional inputs only")
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    dynamic = {}
    for name, spec_node in zip(names, [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in names]):
        val = spec_node.meta.get("val")
        if val is not None:
            axes = [i for i, d in enumerate(val.shape) if not isinstance(d, int)]
            if axes:
                dynamic[name] = axes
    return LoadedModel(ep.module(), "exported-program", tuple(args) or None, names, dynamic or None, ep)


def _load_torch_file(path: Path, trust_pickle: bool) -> LoadedModel:
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            entries = zf.namelist()
        if any(e.endswith("/constants.pkl") or "/code/" in e for e in entries):
            try:
                module = torch.jit.load(str(path), map_location="cpu")
            except Exception as e:
                raise UsageError(f"cannot load TorchScript archive '{path}' ({_short(e)}): re-save it with torch.jit.save") from None
            return LoadedModel(module.eval(), "torchscript")
    # A torch.save file: look at it with the restricted unpickler first (runs no code).
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only load failed" not in str(e).lower() or "global" not in str(e).lower():
            raise UsageError(f"cannot read '{path}': corrupt or not a torch.save file ({_short(e)})") from None
        obj = _UNSAFE  # it names Python classes or functions: a real pickle
    except Exception as e:
        raise UsageError(f"cannot read '{path}': not a TorchScript archive or torch.save file ({_short(e)})") from None
    if obj is not _UNSAFE:
        if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise UsageError(f"'{path}' is a state dict, not a model: pass the model as `package.module:callable --weights {path}`")
        raise UsageError(f"'{path}' holds a {type(obj).__name__}, not an nn.Module: save the model with torch.jit.save or torch.export.save")
    if not trust_pickle:
        raise UsageError(f"'{path}' is a pickled Python object and unpickling can run arbitrary code: "
                         "pass --trust-pickle if you trust it, or save the model with torch.export.save")
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=False)
    except Exception as e:
        raise UsageError(f"cannot unpickle '{path}' ({_short(e)}): make the model's classes importable (PYTHONPATH) or save it with torch.export.save") from None
    if not isinstance(obj, nn.Module):
        raise UsageError(f"'{path}' holds a {type(obj).__name__}, not an nn.Module: save the model itself")
    return LoadedModel(obj.eval(), "pickle", *_declared_inputs(obj), output_names=getattr(obj, "output_names", None))


_UNSAFE = object()


def _load_factory(model: str, weights: str | None) -> LoadedModel:
    mod_name, _, attr = model.partition(":")
    if not mod_name or not attr:
        raise UsageError(f"malformed MODEL '{model}': use `package.module:callable`, e.g. models.dit:tiny")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise UsageError(f"cannot import '{mod_name}' ({_short(e)}): run from the folder that holds it or add it to PYTHONPATH") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"'{mod_name}' has no callable '{attr}': name a function or class that returns an nn.Module")
    try:
        obj = factory()
    except Exception as e:
        raise UsageError(f"'{model}' failed when called with no arguments ({_short(e)}): give it defaults") from None
    if not isinstance(obj, nn.Module):
        raise UsageError(f"'{model}' returned a {type(obj).__name__}, not an nn.Module")
    if weights:
        _load_weights(obj, weights)
    return LoadedModel(obj.eval(), "factory", *_declared_inputs(obj), output_names=getattr(obj, "output_names", None))


def _load_weights(module: nn.Module, weights: str) -> None:
    if not os.path.isfile(weights):
        raise UsageError(f"weights file not found: '{weights}': check the --weights path")
    try:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(f"cannot read --weights '{weights}' as a state dict ({_short(e)}): save it with torch.save(model.state_dict(), path)") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise UsageError(f"--weights '{weights}' holds a {type(state).__name__}, not a state dict: save model.state_dict()")
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        detail = " ".join(s.strip() for s in first[1:3]) if len(first) > 1 else first[0]
        raise UsageError(f"--weights '{weights}' does not fit the model ({detail[:200]}): use weights saved from this model") from None


def _declared_inputs(module: nn.Module):
    """Example inputs, names and dynamic axes a module may declare (see models/)."""
    fn = getattr(module, "example_inputs", None)
    example = tuple(fn()) if callable(fn) else None
    return example, getattr(module, "input_names", None), getattr(module, "dynamic_axes", None)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:160]
