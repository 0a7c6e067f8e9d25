"""nn.Module -> ONNX: BN folding and norm swaps in torch, the dynamo exporter with our
translation table, function bodies for the custom ops, then the ONNX rewrite passes."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from typing import Any

import onnx
import torch

from . import export_fixes, ops
from .load.call import CallAdapter
from .errors import ExportError, UsageError

TARGETS = ("trt", "ort", "onnx")
#: TensorRT 10 and most runtimes take opset 20. For target ort the rewriter raises the opset to 23
#: where it fuses RMSNorm into the standard RMSNormalization, which onnxruntime runs faster than
#: the decomposed form (tools/bench_ort.py, benchmarks/results/ort_*); the rest of the graph keeps
#: the opset-20 export.
DEFAULT_OPSET = 20


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

        return TS2EPConverter(module, args, {}).convert().module()
    return module


def convert_module(module, args: tuple, **kwargs) -> onnx.ModelProto:
    """convert_module_ir as one ModelProto (for models that fit one protobuf; the CLI keeps the
    onnx-ir model and streams it to disk instead)."""
    import onnx_ir as ir

    return ir.serde.serialize_model(convert_module_ir(module, args, **kwargs))


def convert_module_ir(module, args: tuple, *, target: str = "trt", opset: int | None = None,
                      input_names: list[str] | None = None, output_names: list[str] | None = None,
                      dynamic_axes: dict[str, list[int]] | None = None,
                      report: dict | None = None, fold_bn: bool = True, swap_norms: bool = True,
                      rewrite: bool = True, verify: bool = True, auto_dynamic: bool = False, accept=None,
                      rewrite_off: dict[str, str] | None = None):
    """Export `module` called with `args` to ONNX for `target` (DESIGN §3), as an onnx_ir model
    whose initializers are the module's own tensors (no copy of the weights; DESIGN §8).

    The exporter ladder (DESIGN §9, LADDER): torch.onnx's dynamo exporter with `dynamic_axes`;
    then with the axes it cannot keep made static (torch.export's Dim.AUTO: the file's symbolic
    dims say which stayed); then with static shapes; then the TorchScript-based exporter
    (dynamo=False, on the module before the norm swaps; the rewriter fuses what it left
    decomposed) with the axes, then static. A rung whose export raises, or whose file fails the
    ONNX checker or cannot run in onnxruntime, gives way to the next; given `accept(model,
    kept_axes)` (convert: the parity check), so does a file it refuses; the first file accepted is
    kept (when none is: the first file, with "parity_failed" in the report).

    `report`, when given, receives the sections "fold_batchnorm", "prepare", "exporter" ("name":
    "dynamo" | "torchscript", "rung", "static_axes" {input: [axes made static]}, "dynamo_error"
    when the first rung was not kept, "attempts") and "rewrite". `rewrite_off`: rule modules the
    command line turned off (rewriter/switches.py)."""
    import onnx_ir as ir

    if target not in TARGETS:
        raise UsageError(f"unknown target '{target}': use one of {', '.join(TARGETS)}")
    asked_opset, opset = opset, opset or DEFAULT_OPSET
    if opset < ops.MIN_OPSET:
        raise UsageError(f"--opset {opset} is too old for the torch.onnx exporter: use {ops.MIN_OPSET} or newer")
    report = report if report is not None else {}
    module = to_exportable(module, args)
    unswapped = module
    if isinstance(module, torch.nn.Module) and not isinstance(module, torch.fx.GraphModule):
        from .prepare.implementations import exportable_implementations  # MoE experts, attention (§9)

        module = exportable_implementations(module, args, report.setdefault("implementations", []), inplace=False)
        if fold_bn:
            from .prepare.fold_bn import fold_batchnorm

            report["fold_batchnorm"] = []
            module = fold_batchnorm(module, report["fold_batchnorm"], example_inputs=args)
        from .prepare.complex import lower_complex  # complex arithmetic as real pairs, for both exporters (§9)

        complex_report: list = []
        module = lower_complex(module, args, complex_report)
        if complex_report:
            report["prepare"] = complex_report
        unswapped = module
        if swap_norms and target == "trt":  # other targets keep standard ops (see rewrite)
            from .prepare.swap import prepare

            report["prepare"] = complex_report
            module = prepare(module, report["prepare"], example_inputs=args)
    elif isinstance(module, torch.fx.GraphModule):  # a .pt2's program: its complex ops lowered when re-traced
        from .prepare.complex import lower_complex

        complex_report = []
        module = unswapped = lower_complex(module, args, complex_report)
        if complex_report:
            report["prepare"] = complex_report
    names = list(input_names) if input_names else [f"input_{i}" for i in range(len(args))]

    def dynamo(axes, fresh=False, auto=auto_dynamic):
        # fresh: clones of the inputs (torch.export leaves dynamic-dim marks on the tensors it traced)
        xs = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args) if fresh else args
        model = _torch_onnx_export(module, xs, names, output_names, axes, opset, auto)
        fixed = export_fixes.apply_all(model)  # exact: valid in every dtype, runnable in onnxruntime
        if fixed:
            report["export_fixes"] = fixed
        ops.attach_functions_ir(model)
        if target != "trt":  # a model that calls normexport ops itself
            _inline_custom_ops_ir(model)
        _validate_ir(model, args)
        return model

    def torchscript(axes):
        proto = _torchscript_export(_traceable(unswapped), args, names, output_names, axes, ts_opset)
        ops.attach_functions(proto)
        if target != "trt":
            proto = inline_custom_ops(proto)
        _validate(proto, args)
        return ir.serde.deserialize_model(proto)

    def finish(model):
        if not rewrite:
            return model, None
        from . import rewriter

        rw_report = rewriter.RewriteReport()
        model = rewriter.rewrite_ir(model, target=target, verify=verify, report=rw_report, off=rewrite_off)
        return model, rw_report.to_dict()

    ts_opset = asked_opset or TORCHSCRIPT_OPSET
    wanted = {n: sorted(set(a)) for n, a in (dynamic_axes or {}).items() if a}
    attempts: list[dict] = []
    first_failed = None  # (model, exporter section) of the first file that exported but failed `accept`
    for rung in LADDER:
        if rung != "dynamic" and rung != "torchscript" and not wanted:
            continue  # no dynamic axes: the first rung is already static
        if rung == "static axes" and auto_dynamic:
            continue  # the first rung already let torch.export make static what it could not keep
        if rung == "static" and any(a.get("rung") == "static axes" and a.get("kept") == {} for a in attempts):
            continue  # the previous rung already wrote a fully static file
        if rung == "torchscript static" and not wanted:
            continue
        try:
            if rung == "dynamic":
                model = dynamo(dynamic_axes)
            elif rung == "static axes":
                keep = keepable_axes(module, args, names, wanted)
                if keep == wanted:  # torch.export keeps them all: the first rung's file again
                    attempts.append({"rung": rung, "skipped": "torch.export keeps every dynamic axis"})
                    continue
                model = dynamo(keep, fresh=True, auto=False)
            elif rung == "static":
                model = dynamo(None, fresh=True)
            elif rung == "torchscript":
                model = torchscript(dynamic_axes)
            else:
                model = torchscript(None)
        except UsageError:
            raise
        except Exception as e:
            if rung == "dynamic" and "unsupported type: tensor(bfloat16)" in str(e):
                raise  # an op without a bfloat16 form at this opset: the opset is the fix, not another exporter
            attempts.append({"rung": rung, "error": cause_summary(e)})
            continue
        kept = file_dynamic_axes(model)
        static_axes = {n: [a for a in axes if a not in kept.get(n, [])] for n, axes in wanted.items()}
        static_axes = {n: axes for n, axes in static_axes.items() if axes}
        section = _exporter_section(rung, attempts, static_axes, ts_opset)
        model, rw = finish(model)
        if accept is None or accept(model, kept):
            report["exporter"] = section
            if rw is not None:
                report["rewrite"] = rw
            return model
        attempts.append({"rung": rung, "parity": "failed", "kept": kept})
        if first_failed is None:
            first_failed = (model, section, rw)
        else:
            del model
    if first_failed is not None:  # every file failed `accept`: the first (most dynamic) one, said so
        report["exporter"] = {**first_failed[1], "parity_failed": True, "attempts": attempts}
        if first_failed[2] is not None:
            report["rewrite"] = first_failed[2]
        return first_failed[0]
    causes = "; ".join(f"{RUNG_TEXT[a['rung']]}: {a['error']}" for a in attempts if "error" in a)
    from .prepare.complex import not_lowered  # why complex values were left in the model (§9)

    causes += "".join(f"; {why}" for why in not_lowered(report.get("prepare")))
    raise ExportError(f"torch.onnx cannot export the model: {causes}") from None


#: the exporter ladder (DESIGN §9), in order: the first file that exports (and, given `accept`,
#: passes it: convert's parity check) is kept
LADDER = ("dynamic", "static axes", "static", "torchscript", "torchscript static")
RUNG_TEXT = {"dynamic": "dynamo exporter", "static axes": "dynamo exporter with the axes it cannot keep static",
             "static": "dynamo exporter with static shapes", "torchscript": "TorchScript exporter",
             "torchscript static": "TorchScript exporter with static shapes"}


def _exporter_section(rung: str, attempts: list[dict], static_axes: dict, ts_opset: int) -> dict:
    """The report's "exporter" section: which rung wrote the file, which axes it made static and why
    the rungs above it were not kept."""
    name = "torchscript" if rung.startswith("torchscript") else "dynamo"
    section: dict = {"name": name, "rung": rung, "static_axes": static_axes}
    if static_axes:
        section["static"] = True
    if name == "torchscript":
        section["opset"] = ts_opset
    errors = [a for a in attempts if "error" in a]
    dyn = next((a for a in attempts if a["rung"] == "dynamic"), None)
    if dyn is not None:
        section["dynamo_error"] = dyn.get("error") or "parity failed at other sizes"
        section["dynamic_error"] = section["dynamo_error"]
    ts = next((a for a in errors if a["rung"] == "torchscript"), None)
    if ts is not None:
        section["torchscript_error"] = ts["error"]
    if attempts:
        section["attempts"] = attempts
    return section


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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
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


#: the TorchScript-based exporter's opset when --opset does not say (its best-tested one)
TORCHSCRIPT_OPSET = 17


def _torch_onnx_export(module, args, names, output_names, dynamic_axes, opset, auto=False):
    """The dynamo exporter's onnx_ir model (its initializers wrap the module's tensors)."""
    shapes = dynamic_shapes_for(args, names, dynamic_axes, auto)
    if shapes is not None and isinstance(module, CallAdapter):
        shapes = (shapes,)  # forward(*tensors): one entry, the tuple of the tensors' shapes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        program = torch.onnx.export(
            module, args, dynamo=True, opset_version=opset, input_names=names, output_names=output_names,
            dynamic_shapes=shapes,
            custom_translation_table=ops.TRANSLATION_TABLE, optimize=True, verbose=False,
        )
    return program.model


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
    with warnings.catch_warnings(), _silenced_output():
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
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
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
    from .rewriter.driver import weight_bytes
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


def op_counts(model) -> dict[str, int]:
    """Node counts by `domain::op_type` (default domain without prefix), of an onnx.ModelProto or
    an onnx_ir model's main graph."""
    counts: dict[str, int] = {}
    for n in (model.graph.node if isinstance(model, onnx.ModelProto) else model.graph):
        key = f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
        counts[key] = counts.get(key, 0) + 1
    return counts


__all__: list[Any] = ["convert_module", "convert_module_ir", "inline_custom_ops", "op_counts", "TARGETS"]
