"""`--module NAME`: export one submodule (`model.layers.0`, `transformer_blocks.3`) with the inputs
it receives when the whole model runs once on its example inputs.

Tensors among the captured positional and keyword arguments (nested ones too, e.g.
`position_embeddings=(cos, sin)`) become the block's ONNX inputs, named after its forward
parameters; everything else (None, flags, ints) is fixed as a constant of the call. Dynamic axes:
an axis of a captured tensor is a candidate when its size is the size of a dynamic axis of the
whole model's inputs (batch, sequence); torch.export keeps those it can (Dim.AUTO) and the
exported file's symbolic dims say which stayed dynamic.
"""

from __future__ import annotations

import difflib

import torch
from torch import nn

from ..errors import UsageError, first_line
from ._util import quiet
from .call import CallAdapter, unwrap


def find(model: nn.Module, name: str) -> nn.Module:
    """The submodule called `name`; a wrong name is one line listing close names."""
    modules = dict(unwrap(model).named_modules())
    if name in modules and name:
        return modules[name]
    names = [n for n in modules if n]
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    if not close:  # same parent, or the first few top-level names
        parent = name.rsplit(".", 1)[0]
        close = [n for n in names if n.startswith(parent + ".") and n.count(".") == name.count(".")][:5] or \
            [n for n in names if "." not in n][:5]
    raise UsageError(f"--module {name}: the model has no submodule of that name: close names: {', '.join(close)}")


def capture(model: nn.Module, name: str, inputs: tuple, dynamic: dict[str, list[int]] | None, input_names: list[str],
            loaded=None):
    """(CallAdapter of the submodule, its inputs, names, dynamic axes) from one forward of `model`.
    For a .pt2 (`loaded.exported_program`), whose module is one flat graph, the program is
    unflattened first (torch.export.unflatten): its submodules are the model's, called as in it."""
    if loaded is not None and getattr(loaded, "exported_program", None) is not None:
        model = _unflattened(model, loaded.exported_program)
    block = find(model, name)
    if isinstance(block, torch.jit.ScriptModule):  # TorchScript calls its submodules in C++: no hook sees them
        raise UsageError(f"--module {name}: the model is TorchScript (scripted or traced), whose calls to its submodules "
                         "cannot be recorded: save the submodule as its own file (`torch.jit.load(FILE)."
                         f"{name}.save('part.pt')`) and convert that with --input, or convert the whole model")
    seen: list = []

    def hook(_module, args, kwargs):
        if not seen:
            seen.append((args, dict(kwargs)))

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(*inputs)
    except Exception as e:
        raise UsageError(f"the model rejected the inputs of its call ({first_line(e, 160)}): give the inputs it takes "
                         "with --input NAME:DIMS[:DTYPE], or record a real call with `with normexport.capture(model, "
                         "\"inputs.pt\"): ...` and pass --inputs inputs.pt") from None
    finally:
        handle.remove()
    if not seen:
        raise UsageError(f"--module {name}: the submodule is not called in a forward of the model on its inputs: "
                         "name a submodule that runs")
    args, kwargs = seen[0]
    adapter = CallAdapter(block, tuple(_detach(a) for a in args), {k: _detach(v) for k, v in kwargs.items()})
    if not adapter.example_inputs:
        raise UsageError(f"--module {name}: the submodule receives no tensor inputs: name a block that takes tensors")
    sizes = _dynamic_sizes(inputs, input_names, dynamic)
    block_dynamic = {}
    for n, t in zip(adapter.input_names, adapter.example_inputs):
        axes = [i for i, d in enumerate(t.shape) if int(d) in sizes and int(d) > 1]
        if axes:
            block_dynamic[n] = axes
    return adapter, adapter.example_inputs, adapter.input_names, block_dynamic or None


def _detach(x):
    return torch.utils._pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, x)


def _dynamic_sizes(inputs, names, dynamic) -> set[int]:
    sizes = set()
    for n, t in zip(names, inputs):
        for a in (dynamic or {}).get(n, []):
            if a < t.dim():
                sizes.add(int(t.shape[a]))
    return sizes


def _unflattened(model: nn.Module, program) -> nn.Module:
    """`model` (the program's flat module, perhaps inside a CallAdapter) with the hierarchy of
    the module that was exported restored."""
    try:
        with quiet():
            tree = torch.export.unflatten(program)
    except Exception as e:
        raise UsageError(f"--module: the exported program cannot be unflattened into its submodules ({first_line(e, 160)}): "
                         "export the submodule itself with torch.export, or convert the model from Python or a folder") from None
    tree.eval = tree.train = _no_train.__get__(tree)  # eval form already; UnflattenedModule refuses train()
    return model.with_inner(tree) if isinstance(model, CallAdapter) else tree


def _no_train(self, mode: bool = True):
    return self
