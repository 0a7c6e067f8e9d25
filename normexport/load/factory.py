"""MODEL as `package.module:callable` returning an nn.Module (optionally with a weights_only
state dict, `--weights FILE`)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from torch import nn

from ..errors import UsageError
from ._util import short
from .examples import declared_inputs
from .model import LoadedModel
from .pretrained import library_model, library_of
from .state_dict import load_weights


def load_factory(model: str, weights: str | None) -> LoadedModel:
    mod_name, _, attr = model.partition(":")
    if not mod_name or not attr:
        raise UsageError(f"malformed MODEL '{model}': use `package.module:callable`, e.g. normexport.models.dit:tiny")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise UsageError(f"cannot import '{mod_name}' ({short(e)}): run from the folder that holds it or add it to PYTHONPATH") from None
    except SyntaxError as e:
        where = f"{Path(e.filename).name}:{e.lineno}" if e.filename else mod_name
        raise UsageError(f"cannot import '{mod_name}': syntax error at {where} ({e.msg}): fix the module") from None
    except Exception as e:
        raise UsageError(f"importing '{mod_name}' raised {type(e).__name__} ({short(e)}): fix the module") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"'{mod_name}' has no callable '{attr}': name a function or class that returns an nn.Module")
    try:
        obj = factory()
    except Exception as e:
        raise UsageError(f"'{model}' failed when called with no arguments ({short(e)}): give it defaults") from None
    if not isinstance(obj, nn.Module):
        raise UsageError(f"'{model}' returned a {type(obj).__name__}, not an nn.Module")
    if weights:
        load_weights(obj, weights)
    declared = declared_inputs(obj)
    if declared[0] is None and (lib := library_of(obj)) is not None:  # a transformers / diffusers model: as a folder's
        return library_model(obj.eval(), lib, "factory")
    return LoadedModel(obj.eval(), "factory", *declared, output_names=getattr(obj, "output_names", None))


