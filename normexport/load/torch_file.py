"""MODEL as a `.pt` / `.pth` file: a TorchScript archive, or a pickled nn.Module (only with
trust_pickle=True). A pickle is never unpickled unless the user said --trust-pickle: the file is
first read with torch.load(weights_only=True), whose restricted unpickler runs no code from it.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch
from torch import nn

from ..errors import UsageError
from ._util import short
from .examples import declared_inputs
from .model import LoadedModel
from .pretrained import library_model, library_of
from .state_dict import find_state_dict, is_state_dict


def load_torch_file(path: Path, trust_pickle: bool) -> LoadedModel:
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as zf:
                entries = zf.namelist()
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise UsageError(f"cannot read '{path}': corrupt or truncated archive ({short(e)}): re-save the model") from None
        if any(e.endswith("/constants.pkl") or "/code/" in e for e in entries):
            try:
                module = torch.jit.load(str(path), map_location="cpu")
            except Exception as e:
                raise UsageError(f"cannot load TorchScript archive '{path}' ({short(e)}): re-save it with torch.jit.save") from None
            return LoadedModel(module.eval(), "torchscript")
    # A torch.save file: look at it with the restricted unpickler first (runs no code).
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only load failed" not in str(e).lower() or "global" not in str(e).lower():
            raise UsageError(f"cannot read '{path}': corrupt or not a torch.save file ({short(e)})") from None
        obj = _UNSAFE  # it names Python classes or functions: a real pickle
    except Exception as e:
        raise UsageError(f"cannot read '{path}': not a TorchScript archive or torch.save file ({short(e)})") from None
    if obj is not _UNSAFE:
        if is_state_dict(obj):
            raise UsageError(f"'{path}' is a state dict, not a model: pass the model as `package.module:callable --weights {path}`")
        found = find_state_dict(obj)
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
        raise UsageError(f"cannot unpickle '{path}' ({short(e)}): make the model's classes importable (PYTHONPATH) or save it with torch.export.save") from None
    if not isinstance(obj, nn.Module):
        raise UsageError(f"'{path}' holds a {type(obj).__name__}, not an nn.Module: save the model itself")
    declared = declared_inputs(obj)
    if declared[0] is None and (lib := library_of(obj)) is not None:  # a transformers / diffusers model: as a folder's
        return library_model(obj.eval(), lib, "pickle")
    return LoadedModel(obj.eval(), "pickle", *declared, output_names=getattr(obj, "output_names", None))


_UNSAFE = object()


