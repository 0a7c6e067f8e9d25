"""One export of the exporter ladder (docs/design.md §9): the dynamo exporter (torch.onnx, dynamo=True,
with normexport's translation table) or the TorchScript-based one (dynamo=False), each file
fixed (export_fixes), given the normexport functions, inlined for targets other than trt and
validated (ONNX checker with shape inference, one onnxruntime run); and what the ladder asks of
torch.export (the axes it keeps, the file's symbolic dims)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sys
import warnings

import onnx
import torch

from .. import export_fixes, ops
from ..load.call import CallAdapter
from ..errors import UsageError
from .optimizer_rules import exact_no_op_rules
from .promotion import promoted_einsum
from . import sdpa


def dynamic_shapes_for(args: tuple, names: list[str], dynamic_axes: dict[str, list[int]] | None, auto: bool = False):
    """torch.export dynamic_shapes (one dict per positional input) from {name: [axes]}; `auto`:
    candidate axes that torch.export may keep static (Dim.AUTO) instead of failing (--module)."""
    if not dynamic_axes:
        return None
    unknown = sorted(set(dynamic_axes) - set(names))
    if unknown:
        raise UsageError(f"--dynamic names unknown input(s) {unknown}: inputs are {names}")
    shapes = []
    for name, arg in zip(names, args):
        axes = dynamic_axes.get(name, [])
        bad = [a for a in axes if a >= arg.dim()]
        if bad:
            raise UsageError(f"--dynamic {name}:{','.join(map(str, axes))} names axis {bad[0]} but '{name}' has rank {arg.dim()}")
        dim = torch.export.Dim.AUTO if auto else torch.export.Dim.DYNAMIC
        shapes.append({a: dim for a in axes} or None)
    return tuple(shapes)


def to_exportable(module, args: tuple):
    """TorchScript modules cannot be traced by torch.export: convert them to an ExportedProgram
    first (torch's own TorchScript converter) and export its module."""
    if isinstance(module, torch.jit.ScriptModule):
        from torch._export.converter import TS2EPConverter

        try:
            return TS2EPConverter(module, args, {}).convert().module()
        except Exception:  # noqa: BLE001 - control flow, optional inputs: torch's converter asserts or fails;
            return module  # the TorchScript module itself, for the TorchScript rungs (torch.onnx takes it)
    return module


def keepable_axes(module, args: tuple, names: list[str], wanted: dict[str, list[int]]) -> dict[str, list[int]]:
    """The axes of `wanted` torch.export keeps dynamic when it may make the others static
    (Dim.AUTO): an axis the code specializes (Chroma's `torch.tensor([0] * batch)`) is static in the
    program's inputs (a SymInt specialized to a number counts as static: torch.onnx's own capture
    of Dim.AUTO wrote Chroma's batch symbolic in the file while the graph had baked it, a file
    wrong at other sizes)."""
    xs = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    shapes = dynamic_shapes_for(xs, names, wanted, auto=True)
    if isinstance(module, CallAdapter):
        shapes = (shapes,)
    with warnings.catch_warnings(), gc_paused():
        warnings.simplefilter("ignore")
        with math_attention():
            program = torch.export.export(module, xs, dynamic_shapes=shapes, strict=False)
    from torch.export.graph_signature import InputKind
    from torch.fx.experimental.symbolic_shapes import is_concrete_int  # a SymInt specialized to 2 is concrete

    user = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    vals = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    kept = {}
    for name, placeholder in zip(names, user):
        val = vals.get(placeholder)
        axes = [a for a in wanted.get(name, []) if val is not None and not is_concrete_int(val.shape[a])]
        if axes:
            kept[name] = axes
    return kept


_CONFLICT = re.compile(r"tracing inferred a static shape of \d+ for dimension inputs((?:\[[^\]]+\])+)\.shape\[(\d+)\]")


def specialised_axes(e: BaseException, module, names: list[str]) -> dict[str, list[int]] | None:
    """The input axes a failed export says the model fixes: torch.export's "conflicts between
    user-specified ranges and inferred ranges" names each dim the trace specialised
    (`inputs['tensors'][4].shape[0]`, `inputs['x'].shape[2]`); None when the error is not that or a
    dim cannot be mapped to an input name (the caller then asks torch.export with Dim.AUTO)."""
    text, seen = "", 0
    while e is not None and seen < 8:
        text += str(e)
        e, seen = e.__cause__ or e.__context__, seen + 1
    found = _CONFLICT.findall(text)
    if "conflicts between user-specified ranges and inferred ranges" not in text or not found:
        return None
    import inspect

    params = list(inspect.signature(module.forward).parameters.values())
    out: dict[str, list[int]] = {}
    for path, axis in found:
        keys = re.findall(r"\[([^\]]+)\]", path)
        first = keys[0].strip("'\"")
        at = next((i for i, p in enumerate(params) if p.name == first), None)
        if at is None:
            return None
        if params[at].kind == inspect.Parameter.VAR_POSITIONAL:  # forward(*tensors): the next key is the index
            if len(keys) < 2 or not keys[1].isdigit():
                return None
            at += int(keys[1])
        elif len(keys) > 1:
            return None  # a nested input: its name is not positional
        if at >= len(names):
            return None
        out.setdefault(names[at], []).append(int(axis))
    return {n: sorted(set(a)) for n, a in out.items()}


def file_dynamic_axes(model) -> dict[str, list[int]]:
    """{input name: [axes with a symbolic dim]} of an onnx_ir model's graph inputs."""
    axes = {}
    for v in model.graph.inputs:
        shape = v.shape
        if shape is None:
            continue
        dims = [i for i, d in enumerate(shape) if not isinstance(d, int)]
        if dims:
            axes[v.name] = dims
    return axes


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off while torch.export traces: the trace creates millions
    of objects (fake tensors, sympy expressions, fx nodes) that survive the young generations, and
    each full collection walks all of them (tools/profile_convert.py, 1.1B LLaMA on 2 cores: trace +
    decompositions 48 -> 32 s). One collection after, of the youngest generation alone: with the collector
    off nothing was promoted, so that generation holds every object the trace made and its cycles are freed
    at once, without walking the rest of the process's objects (a full collection did: 0.45 s against 0.2 s
    after a tiny PixArt export in a fresh process; in a long-lived process, as a test run's, over a second)."""
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        gc.collect(0)


@contextlib.contextmanager
def math_attention():
    """scaled_dot_product_attention traced with its math backend. On CPU, torch picks the flash
    kernel while torch.export traces, whose output is laid out [B, S, H, D] under the logical
    [B, H, S, D]: `out.transpose(1, 2).contiguous()` is then a no-op in the trace and the
    `.reshape` after it becomes a view; torch.onnx re-runs the decomposed graph with the math
    layout and that view fails ("Cannot view a tensor with shape [B, S, H, D] and strides ... as
    (B, S, H*D)": transformers' T5 encoder, fp32 and bf16; pytorch/pytorch#136543, #141107).
    With the math backend the strides agree in every pass; the graph keeps the one
    scaled_dot_product_attention node either way, so the file is the same op."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


@contextlib.contextmanager
def indexed_diagonal_fill():
    """`t.fill_diagonal_(v)` of a 2-D tensor traced as `t[i, i] = v` (the same values). diffusers'
    PAGCFGJointAttnProcessor2_0 (SD3's PAG) builds its identity mask with
    `full_mask[:n, :n].fill_diagonal_(0)`: torch's own fill_diagonal_ writes through an as_strided view,
    which torch.export cannot functionalize ("a mutation on a view chain ... as_strided() is
    non-compositional"), and the TorchScript exporter the ladder then falls back to drops the write
    (the diagonal stays -inf: the perturbed third of the tiny SD3's output 0.002 from eager, the plain
    export's too). Indexed, the write is an index_put on the slice, which torch.export captures exactly."""
    original = torch.Tensor.fill_diagonal_

    def fill_diagonal_(self, fill_value, wrap=False):
        if self.dim() != 2 or wrap:
            return original(self, fill_value, wrap)
        i = torch.arange(min(self.shape), device=self.device)
        self[i, i] = fill_value
        return self

    torch.Tensor.fill_diagonal_ = fill_diagonal_
    try:
        yield
    finally:
        torch.Tensor.fill_diagonal_ = original


#: the TorchScript-based exporter's opset when --opset does not say (its best-tested one)
TORCHSCRIPT_OPSET = 17


def _torch_onnx_export(module, args, names, output_names, dynamic_axes, opset, auto=False, optimize=True):
    """The dynamo exporter's onnx_ir model (its initializers wrap the module's tensors); `optimize`:
    onnxscript's optimizer run on it (constant folding, ...), as torch.onnx does by default, its
    no-op rules exact (optimizer_rules: `x + 1e-15` is not `x`)."""
    shapes = dynamic_shapes_for(args, names, dynamic_axes, auto)
    if shapes is not None and isinstance(module, CallAdapter):
        shapes = (shapes,)  # forward(*tensors): one entry, the tuple of the tensors' shapes
    with warnings.catch_warnings(), gc_paused(), math_attention(), exact_no_op_rules(), promoted_einsum(), \
            indexed_diagonal_fill(), no_strict_retry_of_inconsistent_guards():
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        export = functools.partial(torch.onnx.export, dynamo=True, opset_version=opset, input_names=names,
                                   output_names=output_names,
                                   custom_translation_table={**ops.TRANSLATION_TABLE, **sdpa.table(opset)},
                                   optimize=optimize, verbose=False)
        try:
            program = export(module, args, dynamic_shapes=shapes)
        except Exception as e:  # noqa: BLE001 - only the one capture failure below is retried
            if shapes is None or not _oblivious_inconsistency(e):
                raise
            # torch.onnx captures with backed_size_oblivious=True (sizes 0 / 1 kept symbolic), under which
            # torch's shape solver cannot express some guards a model's own arithmetic makes (PixArt's
            # attention mask view: 'Eq((s26//s42), 16) is inconsistent!', every batch axis refused); the
            # same program captured by torch.export as it is by default keeps the axes (sizes 0 / 1 of the
            # example then specialise, which the parity check's other shapes would show)
            program = export(torch.export.export(module, args, dynamic_shapes=shapes, strict=False))
    return program.model


@contextlib.contextmanager
def no_strict_retry_of_inconsistent_guards():
    """torch.onnx captures with torch.export non-strict, then strict where that fails. Where non-strict failed
    because torch's dim-constraint solver found the dynamic shapes' guards inconsistent, strict capture meets the
    same guards (the model's own arithmetic on the same symbolic sizes) and fails the same way, in as long again
    (PixArt's transformer: 8.4 s of a 72 s pipeline convert): that failure is raised again at once, and the caller's
    retry (_torch_onnx_export) follows. A non-strict failure of any other kind still gets its strict capture."""
    from torch.onnx._internal.exporter import _capture_strategies as cs

    saved = cs.CAPTURE_STRATEGIES
    failures: list[BaseException] = []

    class NonStrict(cs.TorchExportNonStrictStrategy):
        def _capture(self, *args, **kwargs):
            try:
                return super()._capture(*args, **kwargs)
            except Exception as e:
                failures.append(e)
                raise

    class Strict(cs.TorchExportStrictStrategy):
        def _capture(self, *args, **kwargs):
            if failures and _oblivious_inconsistency(failures[-1]):
                raise failures[-1]
            return super()._capture(*args, **kwargs)

    swap = {cs.TorchExportNonStrictStrategy: NonStrict, cs.TorchExportStrictStrategy: Strict}
    cs.CAPTURE_STRATEGIES = tuple(swap.get(s, s) for s in saved)
    try:
        yield
    finally:
        cs.CAPTURE_STRATEGIES = saved


def _oblivious_inconsistency(e: BaseException) -> bool:
    """torch's dim-constraint solver refused the guards as inconsistent (symbolic_shapes.DimConstraints)."""
    seen = 0
    while e is not None and seen < 8:
        if "inconsistencies were found" in str(e):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _traceable(module):
    """The module a .pt2 holds (ExportedProgram.module(), a GraphModule, perhaps inside a
    CallAdapter) refuses train(), which the TorchScript exporter calls (train(False)) before
    tracing: the graph is already in eval form, so train() leaves these modules as they are."""
    if isinstance(module, torch.nn.Module):
        for m in module.modules():
            if isinstance(m, torch.fx.GraphModule) or type(m).__name__ == "InterpreterModule":
                m.train = _train_noop.__get__(m)
    return module


def _train_noop(self, mode: bool = True):
    return self


def _torchscript_export(module, args, names, output_names, dynamic_axes, opset) -> onnx.ModelProto:
    """torch.onnx.export(dynamo=False): traces the module (no custom ops in it: the module before
    the norm swaps) and writes the decomposed norms the rewriter fuses."""
    import io as _io

    axes = {n: {a: f"{n}_dim{a}" for a in dynamic_axes[n]} for n in names if dynamic_axes and n in dynamic_axes}
    _register_rms_norm_symbolic(opset)
    buf = _io.BytesIO()
    with warnings.catch_warnings(), _silenced_output(), promoted_einsum():
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        torch.onnx.export(module, args, buf, dynamo=False, opset_version=opset, input_names=names,
                          output_names=output_names, dynamic_axes=axes or None, do_constant_folding=True)
    return onnx.load_from_string(buf.getvalue())


def _register_rms_norm_symbolic(opset: int) -> None:
    """The TorchScript exporter has no aten::rms_norm (torch.nn.RMSNorm, F.rms_norm) before ONNX's
    RMSNormalization (opset 23): write its decomposition, x / sqrt(mean(x * x) + eps) * weight over
    the normalized dims (eps None: the dtype's machine epsilon, as torch), which the rewriter then
    fuses and verifies like any exporter's."""
    from torch.onnx import symbolic_helper as sh

    def rms_norm(g, x, normalized_shape, weight, eps):
        k = len(sh._parse_arg(normalized_shape, "is"))
        dtype = x.type().dtype() if x.type().dtype() is not None else torch.float32
        e = torch.finfo(dtype).eps if sh._is_none(eps) else sh._parse_arg(eps, "f")
        axes = list(range(-k, 0))
        sq = g.op("Mul", x, x)
        if opset >= 18:
            ms = g.op("ReduceMean", sq, g.op("Constant", value_t=torch.tensor(axes, dtype=torch.int64)), keepdims_i=1)
        else:
            ms = g.op("ReduceMean", sq, axes_i=axes, keepdims_i=1)
        y = g.op("Div", x, g.op("Sqrt", g.op("Add", ms, g.op("Constant", value_t=torch.tensor(e, dtype=dtype)))))
        return y if sh._is_none(weight) else g.op("Mul", y, weight)

    torch.onnx.register_custom_op_symbolic("aten::rms_norm", rms_norm, opset)


@contextlib.contextmanager
def _silenced_output():
    """The TorchScript exporter prints graphs and diagnostics (from C++ too) when it fails: the
    user gets our one-line error instead."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


#: files at least this large are checked by path later (protobuf's 2 GiB limit), not here
_VALIDATE_LIMIT = 1 << 30


def _validate(model: onnx.ModelProto, args: tuple) -> None:
    """The exported file passes the ONNX checker (with shape inference) and runs in onnxruntime."""
    if model.ByteSize() >= _VALIDATE_LIMIT:
        return
    onnx.checker.check_model(model, full_check=True)
    from ..ortrun import inference_session

    try:
        session = inference_session(model.SerializeToString(), log_level=4)
        if any(t.dtype == torch.bfloat16 for t in args):
            return  # numpy has no bfloat16 feed; the session was built
        feeds = {i.name: t.detach().cpu().numpy() for i, t in zip(session.get_inputs(), args)}
        session.run(None, feeds)
    except Exception as e:
        if "NOT_IMPLEMENTED" in str(e):  # a kernel onnxruntime's CPU build lacks (bf16 Conv), not a bad file
            return
        raise


def _validate_ir(model, args: tuple) -> None:
    """_validate for an onnx_ir model of up to _VALIDATE_LIMIT bytes of weights (serialised once
    for the checker and onnxruntime); larger ones are checked by path once written (io.save_ir)."""
    from ..rewriter.driver import weight_bytes
    import onnx_ir as ir

    if weight_bytes(model) >= _VALIDATE_LIMIT:
        return
    _validate(ir.serde.serialize_model(model), args)


def _inline_custom_ops_ir(model) -> None:
    """inline_custom_ops for an onnx_ir model, in place."""
    import onnx_ir as ir

    if not any(n.domain == ops.DOMAIN for n in model.graph):
        return
    ir.passes.common.InlinePass()(model)
    model.opset_imports.pop(ops.DOMAIN, None)


def cause_summary(e: BaseException, limit: int = 240) -> str:
    """`Type: first line` of the first real cause of an export failure: torch.onnx wraps it in
    errors whose text ends "Refer to the full stack trace above" and names it under
    "## Exception summary"; otherwise the innermost explicit cause (`raise ... from`)."""
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__
    for exc in chain:
        lines = [ln.strip() for ln in str(exc).splitlines()]
        if "## Exception summary" in lines:
            rest = [ln for ln in lines[lines.index("## Exception summary") + 1:] if ln]
            if rest:
                return re.sub(r"^<class '([\w.]+\.)?(\w+)'>:", r"\2:", rest[0])[:limit]
    for exc in reversed(chain):
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        for i, line in enumerate(lines):
            if "stack trace above" not in line.lower():
                if line.endswith(":") and i + 1 < len(lines):  # "Found the following conflicts ...:" + the first
                    line = f"{line} {lines[i + 1]}"
                return f"{type(exc).__name__}: {line}"[:limit]
    return type(chain[-1]).__name__


def inline_custom_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """Replace every normexport op by its function body (standard ONNX ops only)."""
    if not ops.custom_nodes(model):
        return model
    ids = [(ops.DOMAIN, f.name) for f in model.functions if f.domain == ops.DOMAIN]
    model = onnx.inliner.inline_selected_functions(model, ids, exclude=False)
    keep = [o for o in model.opset_import if o.domain != ops.DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    return model


def dynamo(module, args: tuple, names: list[str], output_names, dynamic_axes, opset: int, *, target: str,
           auto: bool = False, fresh: bool = False, report: dict | None = None, plan=None):
    """The dynamo exporter's file (an onnx_ir model whose initializers wrap the module's tensors),
    fixed, with the normexport functions (inlined for targets other than trt) and validated.
    `fresh`: clones of the inputs (torch.export leaves dynamic-dim marks on the tensors it traced);
    `auto`: torch.export may make static the axes it cannot keep (Dim.AUTO); `plan`
    (exporter.depth.Plan): the module's stack of identical blocks exported shallow and grown, the
    whole module exported where it cannot be (report["depth"] says which and why)."""
    xs = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args) if fresh else args
    model = None
    if plan is not None:
        from . import depth

        try:
            model = plan.export(module, lambda m, a, n, o, d: _torch_onnx_export(m, a, n, o, d, opset, auto,
                                                                                 optimize=False))
            if report is not None:
                report["depth"] = {"grown": True, "stack": plan.stack.path, "blocks": plan.stack.depth,
                                   "traced": plan.traced}
                if plan.traced != depth.SHALLOW:
                    report["depth"]["shallow"] = plan.shallow_reason
        except depth.NotGrowable as e:
            if report is not None:
                report["depth"] = {"grown": False, "stack": plan.stack.path, "reason": str(e)}
    if model is None:
        model = _torch_onnx_export(module, xs, names, output_names, dynamic_axes, opset, auto)
    _drop_debug_metadata(model)
    fixed = export_fixes.apply_all(model)  # exact: valid in every dtype, runnable in onnxruntime
    if fixed and report is not None:
        report["export_fixes"] = fixed
    ops.attach_functions_ir(model)
    if target != "trt":  # a model that calls normexport ops itself
        _inline_custom_ops_ir(model)
    _validate_ir(model, args)
    return model


#: per-node metadata the dynamo exporter writes for debugging the export (the Python stack trace, the
#: FX node, the module classes): 2 MB of strings on TinyLlama's 1.4 k nodes, carried through every
#: pass, copy and write after it; dropped (the module path stays: pkg.torch.onnx.name_scopes)
DEBUG_METADATA = ("pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node", "pkg.torch.onnx.class_hierarchy",
                  "namespace")


def _drop_debug_metadata(model) -> None:
    import onnx_ir as ir

    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        props = node.metadata_props
        for key in DEBUG_METADATA:
            props.pop(key, None)


def torchscript(module, args: tuple, names: list[str], output_names, dynamic_axes, opset: int, *, target: str):
    """The TorchScript-based exporter's file, as an onnx_ir model: `module` is the one before the
    norm swaps (the rewriter fuses what this exporter leaves decomposed)."""
    import onnx_ir as ir

    proto = _torchscript_export(_traceable(module), args, names, output_names, dynamic_axes, opset)
    ops.attach_functions(proto)
    if target != "trt":
        proto = inline_custom_ops(proto)
    _validate(proto, args)
    return ir.serde.deserialize_model(proto)
