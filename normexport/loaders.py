"""Turn a MODEL argument into an nn.Module (DESIGN §4).

Forms: `x.pt2` (torch.export), `x.pt` / `x.pth` TorchScript archive, a pickled nn.Module (only
with trust_pickle=True), `package.module:callable` (optionally with a weights_only state dict).
A pickle is never unpickled unless the user said --trust-pickle: everything else goes through
torch.load(weights_only=True), whose restricted unpickler runs no code from the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import os
import pickle
import re
import sys
import threading
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import UsageError, first_line

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
        from . import hf

        return hf.load_folder(path)
    if path.suffix == ".pt2":
        return _load_pt2(path, trust_pickle)
    if path.suffix in TORCH_EXTS:
        return _load_torch_file(path, trust_pickle)
    raise UsageError(f"unknown model extension '{path.suffix}' for '{model}': use .pt2 (torch.export), "
                     ".pt/.pth (TorchScript or pickled module) or `package.module:callable`")


def _load_pt2(path: Path, trust_pickle: bool = False) -> LoadedModel:
    from .pytree_types import register_named_types

    register_named_types(path)
    guard = contextlib.nullcontext() if trust_pickle else _weights_only_unpickling()
    try:
        with _quiet(), guard:
            ep = torch.export.load(str(path))
    except pickle.UnpicklingError as e:
        if trust_pickle or not _refused(e):
            raise UsageError(f"cannot read '{path}' as a torch.export .pt2 archive ({_short(e)}): re-save it with torch.export.save") from None
        raise UsageError(f"'{path}' holds pickled data that the safe loader refuses ({_refusal_reason(e)}) and "
                         "unpickling it can run arbitrary code: pass --trust-pickle if you trust the file") from None
    except Exception as e:
        raise UsageError(f"cannot read '{path}' as a torch.export .pt2 archive ({_short(e)}): re-save it with torch.export.save") from None
    args, kwargs = ep.example_inputs or ((), {})
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    dynamic = {}
    for name, spec_node in zip(names, [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in names]):
        shape = getattr(spec_node.meta.get("val"), "shape", None)
        if shape is not None:
            axes = [i for i, d in enumerate(shape) if not isinstance(d, int)]
            if axes:
                dynamic[name] = axes
    try:
        with _quiet():
            module = ep.module()
    except Exception as e:
        raise UsageError(f"'{path}' holds an exported program that cannot be run ({_short(e)}): re-export the model with torch.export") from None
    example = tuple(args) or None
    if kwargs or any(not isinstance(a, torch.Tensor) for a in args):  # keyword or nested inputs
        from .call import CallAdapter

        module = CallAdapter(module, tuple(args), dict(kwargs))
        if len(module.example_inputs) == len(names):
            module.input_names = names  # the names torch.export gave the file's inputs
        example, names = module.example_inputs, module.input_names
        dynamic = {n: a for n, a in dynamic.items() if n in names}
    return LoadedModel(module, "exported-program", example, names, dynamic or None, ep)


class _PickleRefused(pickle.UnpicklingError):
    """Raised instead of unpickling arbitrary objects from an untrusted .pt2."""


def _refused(e: BaseException) -> bool:
    return isinstance(e, _PickleRefused) or "weights only load failed" in str(e).lower()


def _refusal_reason(e: BaseException) -> str:
    text = str(e)
    m = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if m:
        return f"it names the Python object {m.group(1)}"
    if isinstance(e, _PickleRefused):
        return "a pickled Python object"
    m = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    return m.group(1).strip()[:120] if m else "not plain tensors"


def _refuse_pickle(*args, **kwargs):
    raise _PickleRefused("unpickling arbitrary Python objects needs --trust-pickle")


_GUARD_LOCK = threading.Lock()


@contextlib.contextmanager
def _weights_only_unpickling():
    """While torch.export.load runs, unpickle nothing but tensors and plain containers.

    torch.export.load (torch 2.13) falls back to torch.load(weights_only=False) for sample inputs
    (torch/_export/serde/serialize.py, deserialize_torch_artifact), loads `use_pickle` weights and
    constants with weights_only=False and opaque-object constants with pickle.loads
    (torch/export/pt2_archive/_package.py). TORCH_FORCE_WEIGHTS_ONLY_LOAD, which torch.load reads
    on every call, turns each torch.load into the restricted unpickler (it then raises
    UnpicklingError "Weights only load failed"); pickle.load/loads refuse outright. TorchScript
    custom-class constants (torch._C._pickle_load_obj) only build registered C++ classes.
    """
    with _GUARD_LOCK:
        saved_env = {k: os.environ.get(k) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
        saved_pickle = pickle.load, pickle.loads
        os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
        os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
        pickle.load = pickle.loads = _refuse_pickle
        try:
            yield
        finally:
            pickle.load, pickle.loads = saved_pickle
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@contextlib.contextmanager
def _quiet():
    """torch.export.load logs whole tracebacks (logger.warning(exc_info=True)) and warns about
    legacy formats: the user gets our one-line error instead."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def _load_torch_file(path: Path, trust_pickle: bool) -> LoadedModel:
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as zf:
                entries = zf.namelist()
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise UsageError(f"cannot read '{path}': corrupt or truncated archive ({_short(e)}): re-save the model") from None
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
        if _is_state_dict(obj):
            raise UsageError(f"'{path}' is a state dict, not a model: pass the model as `package.module:callable --weights {path}`")
        found = _find_state_dict(obj)
        if found is not None:
            raise UsageError(f"'{path}' is a checkpoint holding a state dict under '{found[0]}', not a model: "
                             f"pass the model as `package.module:callable --weights {path}`")
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
        raise UsageError(f"malformed MODEL '{model}': use `package.module:callable`, e.g. normexport.models.dit:tiny")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise UsageError(f"cannot import '{mod_name}' ({_short(e)}): run from the folder that holds it or add it to PYTHONPATH") from None
    except SyntaxError as e:
        where = f"{Path(e.filename).name}:{e.lineno}" if e.filename else mod_name
        raise UsageError(f"cannot import '{mod_name}': syntax error at {where} ({e.msg}): fix the module") from None
    except Exception as e:
        raise UsageError(f"importing '{mod_name}' raised {type(e).__name__} ({_short(e)}): fix the module") from None
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
    if not isinstance(state, dict):
        raise UsageError(f"--weights '{weights}' holds a {type(state).__name__}, not a state dict: save model.state_dict()")
    if not _is_state_dict(state):
        found = _find_state_dict(state)
        if found is None:
            keys = ", ".join(repr(k) for k in list(state)[:6])
            raise UsageError(f"--weights '{weights}' is a dict ({keys}) with no state dict of tensors in it: "
                             "save model.state_dict()")
        state = found[1]
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        detail = " ".join(s.strip() for s in first[1:3]) if len(first) > 1 else first[0]
        raise UsageError(f"--weights '{weights}' does not fit the model ({detail[:200]}): use weights saved from this model") from None


#: keys under which training checkpoints usually keep the model's state dict, most likely first
CHECKPOINT_KEYS = ("state_dict", "model_state_dict", "model", "module", "net", "network", "weights", "params")


def _is_state_dict(obj) -> bool:
    return (isinstance(obj, dict) and bool(obj) and all(isinstance(k, str) for k in obj)
            and all(isinstance(v, torch.Tensor) for v in obj.values()))


def _find_state_dict(obj, depth: int = 2) -> tuple[str, dict] | None:
    """(key path, state dict) of the model's state dict nested in a checkpoint dict such as
    {'model': sd, 'epoch': 3} or {'state_dict': sd}; None when there is none."""
    if not isinstance(obj, dict) or depth == 0:
        return None
    keys = [k for k in CHECKPOINT_KEYS if k in obj] + [k for k in obj if k not in CHECKPOINT_KEYS]
    for k in keys:
        v = obj[k]
        if _is_state_dict(v):
            return str(k), v
    for k in keys:
        inner = _find_state_dict(obj[k], depth - 1)
        if inner is not None:
            return f"{k}.{inner[0]}", inner[1]
    return None


def _declared_inputs(module: nn.Module):
    """Example inputs, names and dynamic axes a module may declare (see normexport/models/)."""
    fn = getattr(module, "example_inputs", None)
    example = None
    if callable(fn):
        name = type(module).__name__
        try:
            example = fn()
        except Exception as e:
            raise UsageError(f"{name}.example_inputs() raised {type(e).__name__} ({_short(e)}): fix it, "
                             "or remove it and pass --input NAME:DIMS[:DTYPE]") from None
        if isinstance(example, torch.Tensor):
            example = (example,)
        if not isinstance(example, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in example):
            got = type(example).__name__ if not isinstance(example, (tuple, list)) else \
                "a " + type(example).__name__ + " of " + ", ".join(sorted({type(t).__name__ for t in example}))
            raise UsageError(f"{name}.example_inputs() returned {got}, not a tuple of tensors: "
                             "return tensors, or pass --input NAME:DIMS[:DTYPE]")
        example = tuple(example)
    return example, getattr(module, "input_names", None), getattr(module, "dynamic_axes", None)


def _short(e: BaseException) -> str:
    return first_line(e, 160)
