"""MODEL as a torch.export `.pt2` archive (an ExportedProgram).

The archive is read with the restricted unpickler unless the user trusts it (--trust-pickle); the
pytree types it names are registered first (pytree_types). Its example inputs, input names and
dynamic dims come from the program itself.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import threading
from pathlib import Path

import torch

from ..errors import UsageError
from ._util import quiet, short
from .call import CallAdapter
from .model import LoadedModel
from .pytree_types import register_named_types


def load_pt2(path: Path, trust_pickle: bool = False) -> LoadedModel:
    register_named_types(path)
    guard = contextlib.nullcontext() if trust_pickle else _weights_only_unpickling()
    try:
        with quiet(), guard:
            ep = torch.export.load(str(path))
    except pickle.UnpicklingError as e:
        if trust_pickle or not _refused(e):
            raise UsageError(f"cannot read '{path}' as a torch.export .pt2 archive ({short(e)}): re-save it with torch.export.save") from None
        raise UsageError(f"'{path}' holds pickled data that the safe loader refuses ({_refusal_reason(e)}) and "
                         "unpickling it can run arbitrary code: pass --trust-pickle if you trust the file") from None
    except Exception as e:
        raise UsageError(f"cannot read '{path}' as a torch.export .pt2 archive ({short(e)}): re-save it with torch.export.save") from None
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
        with quiet():
            module = ep.module()
    except Exception as e:
        raise UsageError(f"'{path}' holds an exported program that cannot be run ({short(e)}): re-export the model with torch.export") from None
    example = tuple(args) or None
    # keyword, nested or complex inputs (a complex tensor is fed as a (re, im) pair: load.call)
    if kwargs or any(not isinstance(a, torch.Tensor) or a.is_complex() for a in args):
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
