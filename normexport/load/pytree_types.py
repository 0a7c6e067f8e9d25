"""Output and input types a .pt2 names in its pytree specs (e.g.
`transformers.modeling_outputs.CausalLMOutputWithPast`) must be registered with torch's pytree
before torch.export.load can read the file. Their libraries register them when imported.

A file is untrusted: it never decides what gets imported. Types of the known libraries below are
registered by importing that library's module; any other type needs `--import MODULE` from the
user. A type that stays unregistered is a one-line error naming it and the fix.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import zipfile
from pathlib import Path

import torch.utils._pytree as pytree

from ..errors import UsageError, first_line

#: libraries whose pytree types (model output classes) a .pt2 commonly names; importing them runs
#: only installed, well-known code
KNOWN_LIBRARIES = ("transformers", "diffusers", "timm", "torchvision", "peft", "sentence_transformers")

_TYPE = re.compile(rb'\\*"type\\*":\s*\\*"([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)+)\\*"')


def import_modules(names: list[str]) -> None:
    """`--import MODULE`: import each installed module the user named."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise UsageError(f"--import {name}: cannot import it ({first_line(e, 120)}): install it or fix the name") from None
        except Exception as e:
            raise UsageError(f"--import {name} raised {type(e).__name__} ({first_line(e, 120)}): fix the module") from None


def named_types(path: Path) -> list[str]:
    """Type names in the pytree specs of a .pt2 archive (its models/*.json)."""
    found: list[str] = []
    try:
        with zipfile.ZipFile(path) as zf:
            for entry in zf.namelist():
                if "/models/" in entry and entry.endswith(".json"):
                    for m in _TYPE.finditer(zf.read(entry)):
                        name = m.group(1).decode()
                        if name not in found:
                            found.append(name)
    except (zipfile.BadZipFile, OSError, ValueError):
        return []  # torch.export.load reports the unreadable archive
    return found


def register_named_types(path: Path) -> None:
    """Make every pytree type the archive names known, importing its module when it belongs to a
    known library; raise UsageError for a type nothing registers."""
    for name in named_types(path):
        if name in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            continue
        module = name.rsplit(".", 1)[0]
        top = module.split(".", 1)[0]
        if top in KNOWN_LIBRARIES:
            if importlib.util.find_spec(top) is None:
                raise UsageError(f"'{path}' returns or takes {name}, from {top}, which is not installed: "
                                 f"pip install {top.replace('_', '-')}")
            try:
                importlib.import_module(module)
            except Exception:  # e.g. a module path of another version of the library
                importlib.import_module(top)
        if name not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            raise UsageError(f"'{path}' uses the pytree type {name}, which no imported module registers: "
                             f"pass --import {module} (the module that defines and registers it)")
