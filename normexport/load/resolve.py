"""From a loaded model and the flags to the call that is exported: the module, its example inputs,
their names and dynamic axes (docs/design.md §4). `--input` overrides what the model declares (by forward
parameter name for a pretrained folder); `--dtype` casts module and inputs; `--module NAME` narrows
the call to one submodule with the inputs it receives in a forward of the whole model.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn

from ..errors import UsageError
from . import pipeline, pretrained, standin, submodule
from .call import CallAdapter, forward_parameter_names, input_names, unwrap
from .examples import BATCH_LOOP, MASK_READ_AS_VALUES, missing_message
from .inputs import DTYPES, for_parameter, make_inputs, parse_dynamic, parse_input
from .inputs_file import load_inputs_file
from .model import LoadedModel


@dataclasses.dataclass
class Call:
    """What gets exported: `module(*inputs)`, inputs named `names`, `dynamic` axes by name."""
    module: nn.Module
    inputs: tuple
    names: list[str]
    dynamic: dict[str, list[int]]
    loaded: LoadedModel


def call_for(loaded: LoadedModel, model: str, input_args=(), dynamic_args=(), dtype: str | None = None,
             module_name: str | None = None, inputs_file: str | None = None) -> Call:
    """The exported call for `loaded` and the convert flags (`inputs_file`: --inputs FILE)."""
    if loaded.kind == pipeline.KIND:  # a diffusers pipeline folder: its component, called as the pipeline calls it
        with pipeline.component_call(loaded, module_name, inputs_file) as (component, rest, recorded):
            return call_for(component, model, input_args, dynamic_args, dtype, rest, recorded)
    if not input_args and not inputs_file and (refusal := _derived_refused(loaded)) is not None:
        # a diffusers denoiser folder alone whose derived inputs failed: a pipeline class that takes
        # it records its call (standin, issue 46 item 7); else this refusal, naming that pipeline
        with standin.driven(loaded, refusal) as (component, recorded):
            return call_for(component, model, (), dynamic_args, dtype, module_name, recorded)
    if dtype and loaded.kind == "exported-program":
        _check_pt2_dtype(loaded, model, dtype)
    inputs, names, dynamic, module = resolve_inputs(loaded, model, list(input_args), list(dynamic_args), dtype,
                                                    inputs_file)
    if dtype:
        module = cast(module, DTYPES[dtype])
    if module_name:
        module, inputs, names, dynamic = submodule.capture(module, module_name, inputs, dynamic, names,
                                                           loaded=loaded)
    return Call(module, tuple(inputs), list(names), dict(dynamic or {}), loaded)


def _derived_refused(loaded: LoadedModel) -> str | None:
    """The refusal of a diffusers folder's derived inputs (forward refused them, or some could not be
    made), None for every other model."""
    module = loaded.module
    if loaded.kind != "pretrained" or not isinstance(module, pretrained._Pending) \
            or getattr(module.inner, "_normexport_library", None) != "diffusers":
        return None
    if module.refusal:
        return module.refusal
    return missing_message(type(module.inner).__name__, loaded.missing) if loaded.missing else None


def keep_fp32(module: nn.Module) -> list[str]:
    """Names of the modules / parameters the model's class keeps in float32 in any dtype
    (transformers' and diffusers' `_keep_in_fp32_modules`, e.g. T5's `wo`, Wan's time embedder)."""
    keep = getattr(unwrap(module), "_keep_in_fp32_modules", None)
    return [k for k in (keep or []) if isinstance(k, str)]


def cast(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """module.to(dtype), except what the class keeps in float32 (keep_fp32): those parameters and
    buffers stay float32 in a float16 / bfloat16 export, as from_pretrained(torch_dtype=...) keeps them."""
    module = module.to(dtype)
    keep = keep_fp32(module) if dtype in (torch.float16, torch.bfloat16) else []
    if keep:
        inner = unwrap(module)
        for name, t in list(inner.named_parameters()) + list(inner.named_buffers()):
            if t.is_floating_point() and any(k in name.split(".") for k in keep):
                t.data = t.data.float()
    return module


def resolve_inputs(loaded: LoadedModel, model: str, input_args: list[str], dynamic_args: list[str],
                   dtype: str | None = None, inputs_file: str | None = None):
    """(inputs, names, dynamic_axes, module) from the flags, or from what the model declares
    (docs/design.md §9: --inputs FILE, then --input per parameter, then the derived / declared inputs); the
    module is the loaded one, or one called with the user's inputs by forward parameter name
    (a CallAdapter: keyword and nested inputs reach their parameter, plain values are constants)."""
    module = loaded.module
    library_call = isinstance(module, CallAdapter) and getattr(module.inner, "_normexport_library", None)
    specs = [for_parameter(parse_input(s), unwrap(module), library=bool(library_call)) for s in input_args]
    dynamic = dict(parse_dynamic(d) for d in dynamic_args)
    recorded = load_inputs_file(inputs_file) if inputs_file else None
    if library_call and (specs or recorded):  # a folder's (or a library model's) call: by forward parameter name
        module = pretrained.with_inputs(loaded, specs, *(recorded or ((), {})))
        inputs, names = module.example_inputs, module.input_names
        if recorded and not dynamic:  # a recorded call: its batch dynamic, as a folder's derived inputs
            dynamic = _batched(module, loaded)
    elif recorded and isinstance(unwrap(module), torch.jit.ScriptModule):
        module = unwrap(module)  # TorchScript: called positionally (no adapter, no hooks: its calls run in C++)
        inputs, names = _scripted_call(module, recorded, specs)
        dynamic = dynamic or {n: a for n, a in (loaded.dynamic_axes or {}).items() if n in names}
    elif recorded:
        module = _recorded_call(unwrap(module), recorded, specs)
        inputs, names = module.example_inputs, module.input_names
        dynamic = dynamic or {n: a for n, a in (loaded.dynamic_axes or {}).items() if n in names}
    elif specs and (keyword := _by_keyword(module, specs)) is not None:
        module = keyword
        inputs, names = module.example_inputs, module.input_names
    elif specs:
        inputs, names = make_inputs(specs), [s.name for s in specs]
    elif loaded.example_inputs is not None:
        inputs = loaded.example_inputs
        names = list(loaded.input_names or input_names(module, len(inputs)))
        dynamic = dynamic or dict(loaded.dynamic_axes or {})
    elif loaded.missing:
        raise UsageError(missing_message(type(unwrap(module)).__name__, loaded.missing))
    else:
        hint = " (TorchScript files carry no input shapes)" if loaded.kind == "torchscript" else ""
        raise UsageError(f"cannot tell the inputs of '{model}'{hint}: add --input NAME:DIMS[:DTYPE] for each forward input, "
                         "or --inputs FILE recorded with `with normexport.capture(model, \"inputs.pt\"): ...`")
    if isinstance(module, CallAdapter):
        _note_constants(loaded, module)
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"input {i} of '{model}' is a {type(t).__name__}, not a tensor: normexport exports tensor "
                             "inputs only; give each forward input as --input NAME:DIMS[:DTYPE]")
    if dtype:
        inputs = tuple(t.to(DTYPES[dtype]) if t.is_floating_point() else t for t in inputs)
    _check_arity(module, len(inputs))
    return tuple(inputs), names, dynamic, module


def _batched(adapter: CallAdapter, loaded: LoadedModel) -> dict[str, list[int]]:
    """Dynamic axes of a folder model called with recorded inputs: the batch of its batched inputs
    (pretrained.batched_axes), none for the classes whose forward fixes it (examples)."""
    cls = type(adapter.inner).__name__
    if cls in MASK_READ_AS_VALUES or cls in BATCH_LOOP:
        return {}
    axes = pretrained.batched_axes({n.split(".")[0]: t for n, t in zip(adapter.input_names, adapter.example_inputs)
                                    if n.split(".")[0] == n})
    return axes


def _recorded_call(module: nn.Module, recorded: tuple, specs) -> CallAdapter:
    """The --inputs call of any module (.pt2, TorchScript, factory), each --input over the
    parameter it names."""
    args, kwargs = recorded
    if specs:
        given = pretrained.bind(module, args, kwargs)
        params = forward_parameter_names(module) or []
        unknown = [s.name for s in specs if s.name not in params and s.name not in given]
        if unknown:
            raise UsageError(f"--input {unknown[0]} names no parameter of the --inputs call: use one of "
                             f"{', '.join(given)[:200]}")
        given.update(zip([s.name for s in specs], make_inputs(specs)))
        args, kwargs = (), given
    return CallAdapter(module, tuple(args), dict(kwargs))


def _scripted_call(module, recorded: tuple, specs) -> tuple[tuple, list[str]]:
    """The --inputs call of a TorchScript model as its positional tensors and their parameter
    names (from forward's schema), each --input over the parameter it names; a parameter left to
    its default before a given one, or a value that is not a tensor, is one line."""
    args, kwargs = recorded
    params = [a.name for a in module.forward.schema.arguments[1:]]
    given = dict(zip(params, args))
    unknown = [k for k in list(kwargs) + [s.name for s in specs] if k not in params]
    if len(args) > len(params) or unknown:
        raise UsageError(f"the --inputs call does not fit the TorchScript model's forward({', '.join(params)}): "
                         f"{'too many positional values' if len(args) > len(params) else repr(unknown[0]) + ' names no parameter'}")
    given.update(kwargs)
    given.update(zip([s.name for s in specs], make_inputs(specs)))
    given = {k: v for k, v in given.items() if v is not None}
    last = max((params.index(k) for k in given), default=-1)
    names = params[:last + 1]
    for n in names:
        if not isinstance(given.get(n), torch.Tensor):
            what = "is not given (a TorchScript model takes its inputs in order)" if n not in given else \
                f"is a {type(given[n]).__name__}, not a tensor"
            raise UsageError(f"the --inputs call of the TorchScript model: parameter '{n}' {what}: record the call with "
                             "tensors for every parameter up to the last one given")
    return tuple(given[n] for n in names), names


def _by_keyword(module: nn.Module, specs) -> CallAdapter | None:
    """--input NAMEs that are the forward's parameters but not its first ones in order (a keyword
    skipped, or another order): the module called by keyword, so each reaches its parameter.
    None when positional order already fits (the common case) or the signature cannot say."""
    if isinstance(module, (torch.jit.ScriptModule, torch.fx.GraphModule, CallAdapter)):
        return None
    params = forward_parameter_names(module)
    names = [s.name for s in specs]
    if not params or any(n not in params for n in names) or names == params[:len(names)]:
        return None
    return CallAdapter(module, (), dict(zip(names, make_inputs(specs))))


def _note_constants(loaded: LoadedModel, adapter: CallAdapter) -> None:
    """Plain values of the call (img_shapes, flags) are fixed in the file, not ONNX inputs: said."""
    fixed = adapter.constants()
    if fixed:
        text = ", ".join(f"{n}={v!r}"[:120] for n, v in fixed.items())
        note = f"fixed in the file (python values of the call, not ONNX inputs): {text}"
        if note not in loaded.notes:
            loaded.notes.append(note)


def _check_arity(module, n: int) -> None:
    lo_hi = _arity(module)
    if lo_hi is None:
        return
    lo, hi = lo_hi
    if not lo <= n <= hi:
        want = str(lo) if lo == hi else f"{lo} to {hi}"
        raise UsageError(f"the model's forward takes {want} input(s) but {n} were given: give one --input per forward argument")


def _arity(module) -> tuple[int, int] | None:
    if isinstance(module, torch.jit.ScriptModule):
        try:
            args = module.forward.schema.arguments[1:]  # drop self
        except (AttributeError, RuntimeError):
            return None
        return sum(1 for a in args if not a.has_default_value()), len(args)
    if isinstance(module, torch.fx.GraphModule):
        n = sum(1 for node in module.graph.nodes if node.op == "placeholder")
        return n, n
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return sum(1 for p in positional if p.default is p.empty), len(positional)


def _check_pt2_dtype(loaded: LoadedModel, model: str, dtype: str) -> None:
    """A .pt2's graph is traced in one dtype (its casts and constants are fixed in it)."""
    want = DTYPES[dtype]
    floats = [t.dtype for t in (loaded.example_inputs or ()) if t.is_floating_point()]
    floats += [p.dtype for p in loaded.exported_program.state_dict.values()
               if isinstance(p, torch.Tensor) and p.is_floating_point()]
    have = floats[0] if floats else None
    if have is not None and have != want:
        name = str(have).replace("torch.", "")
        raise UsageError(f"'{model}' is fixed to {name}, the dtype it was exported in, so --dtype {dtype} cannot apply: "
                         f"export the model in {dtype} (model.to(torch.{dtype}) and {dtype} inputs) with torch.export "
                         f"and convert that file, or convert a save_pretrained folder or package.module:callable with --dtype")


