"""check(): run the eager model, its float64 reference and each backend over the input shapes, and
collect the rows of the report."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import UsageError
from ..sizes import ort_error
from . import runners
from ._util import (_LOW_FLOATS, _as_float64, _dtype_name, _elem_dtype, _graph_inputs, _resolve_dtype,
                    _short)
from .plain import Build, PlainExport, builder, opset_of
from .reference import _cast_reference
from .report import CheckReport, Row
from .shapes import _extra_shapes, _inputs_like, _normalise_dynamic
from .verdict import _compare

#: a model with more weight bytes than this is checked at one input shape (no sweep)
BIG_MODEL_BYTES = 2 << 30


def check(onnx_model, reference: nn.Module, inputs, *, backends=("ort",), dynamic_axes: dict | None = None,
          extra_shapes: int = 2, rtol: float | None = None, atol: float | None = None, plugin: str | None = None,
          dtype=None, command: str = "check", plain_export: Build | bool | None = None) -> CheckReport:
    """Compare `onnx_model` (path or ModelProto) with `reference` on `inputs` (positional tuple in
    the order of the ONNX graph inputs, or a dict keyed by ONNX input name) in each backend, on
    the given shape plus `extra_shapes` more when `dynamic_axes` ({input name: [axes]}) is given.
    `dtype` ("float32" / "float16" / "bfloat16" or a torch dtype) casts the reference and the float
    inputs; None: the ONNX model's first floating input decides when the inputs differ from it.
    `plain_export` builds the plain torch.onnx export of the same model (same dtype) for the
    second rule of the verdict (verdict.py), called only when a row fails the 2x-eager rule: a
    function returning an onnx.ModelProto, True (built here from `reference` with the file's
    input / output names, dynamic axes and opset), or None (no second rule).

    Raises UsageError for bad input (unreadable model, input count mismatch, a reference that
    rejects the inputs); a failed comparison is a report with passed False."""
    source = runners._ModelSource(onnx_model)
    try:
        return _check(source, reference, inputs, backends=runners._backend_list(backends), dynamic_axes=dynamic_axes,
                      extra_shapes=extra_shapes, rtol=rtol, atol=atol, plugin=plugin, dtype=_resolve_dtype(dtype),
                      command=command, plain_export=plain_export)
    finally:
        source.close()


def _check(source: runners._ModelSource, reference, inputs, *, backends, dynamic_axes, extra_shapes, rtol, atol, plugin,
           dtype, command, plain_export=None) -> CheckReport:
    graph_inputs = _graph_inputs(source.proto)
    names = [i.name for i in graph_inputs]
    if isinstance(inputs, dict):
        unknown = sorted(set(inputs) - set(names))
        missing = [n for n in names if n not in inputs]
        if unknown or missing:
            raise UsageError(f"inputs {sorted(inputs)} do not match the ONNX inputs {names}: name each ONNX input once")
        inputs = [inputs[n] for n in names]
    elif isinstance(inputs, torch.Tensor):
        inputs = [inputs]
    inputs = list(inputs)
    if len(inputs) != len(names):
        raise UsageError(f"the ONNX model has {len(names)} input(s) ({', '.join(names)}) but {len(inputs)} were given: "
                         "give one input per ONNX input, in order")
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        raise UsageError("inputs must be tensors")
    dtype_source = "argument" if dtype is not None else None
    if dtype is None:  # judge in the ONNX file's dtype (module docstring)
        first = next((vi for vi in graph_inputs if (_elem_dtype(vi) or torch.int64).is_floating_point), None)
        given = next((t.dtype for t in inputs if t.is_floating_point()), None)
        onnx_dtype = _elem_dtype(first) if first is not None else None
        if onnx_dtype in _LOW_FLOATS and given is not None and given != onnx_dtype:
            dtype, dtype_source = onnx_dtype, f"ONNX input '{first.name}'"
    if dtype is not None:
        reference = _cast_reference(reference, dtype)
        inputs = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    if isinstance(reference, torch.nn.Module) and reference.training:
        try:
            reference = reference.eval()
        except NotImplementedError:  # modules of torch.export programs refuse eval(); they are in eval form
            pass
    out_infos = list(source.proto.graph.output)
    out_names = [o.name for o in out_infos]

    dynamic = _normalise_dynamic(dynamic_axes, names, [t.dim() for t in inputs])
    base = {n: list(t.shape) for n, t in zip(names, inputs)}
    nbytes = runners.weight_bytes(source.proto)
    big = nbytes > BIG_MODEL_BYTES and extra_shapes > 0 and bool(dynamic)
    if big:  # docs/design.md §8: a multi-GiB model is checked at the one shape given, not swept
        extra_shapes = 0
    shape_sets = [base] + _extra_shapes(inputs, names, graph_inputs, dynamic, extra_shapes if dynamic else 0)
    no_extra = None
    if len(shape_sets) == 1:
        no_extra = ("no dynamic axes (static shapes)" if not dynamic
                    else f"one shape: the model has {nbytes / 2**30:.1f} GiB of weights" if big
                    else "extra_shapes is 0" if extra_shapes == 0 else "none could be made")

    report = CheckReport(
        command=command, onnx_model=source.label, reference=type(reference).__name__,
        inputs=[{"name": n, "shape": list(t.shape), "dtype": _dtype_name(t.dtype)} for n, t in zip(names, inputs)],
        shapes=[], backends=list(backends), dtype=_dtype_name(dtype) if dtype is not None else None,
        dtype_source=dtype_source, no_extra_shapes=no_extra,
    )
    for b in backends:
        why = runners._availability(b)
        if why:
            report.skipped[b] = why

    # eager and float64 reference per shape
    cases = []  # (index, shape, inputs, eager outputs, reference outputs (float64), eager errors)
    fp64_reasons = []
    run_eager, run_fp64 = runners.EagerRunner(reference), runners.Float64Runner(reference)
    run_fp64.activate()
    for k, shape in enumerate(shape_sets):
        entry: dict[str, Any] = {"index": k, "inputs": shape}
        report.shapes.append(entry)
        xs = inputs if k == 0 else _inputs_like(inputs, shape, names, seed=1000 + k)
        try:
            eager = run_eager.infer(xs)
        except Exception as e:
            if k == 0:
                shapes = ", ".join("x".join(map(str, t.shape)) for t in xs)
                raise UsageError(f"the reference model rejected inputs of shape {shapes} ({_short(e)}): fix the inputs") from None
            entry["skipped"] = f"the reference model rejects this shape ({_short(e)})"
            continue
        if len(eager) != len(out_names):
            raise UsageError(f"the reference returns {len(eager)} tensor(s) but the ONNX model has {len(out_names)} "
                             f"output(s) ({', '.join(out_names)}): check that they are the same model")
        try:
            ref64, why = run_fp64.infer(tuple(xs)), None
        except runners.NoFloat64 as e:
            ref64, why = None, e.reason
        if ref64 is not None and [tuple(r.shape) for r in ref64] != [tuple(e.shape) for e in eager]:
            ref64, why = None, "the float64 run gives outputs of other shapes"
        if ref64 is None:
            fp64_reasons.append(why)
            refs = [_as_float64(e) for e in eager]
            errs: list[float | None] = [None] * len(eager)
        else:
            refs = [_as_float64(r) for r in ref64]
            errs = []
            for e, r in zip(eager, refs):
                if not e.is_floating_point():
                    errs.append(None)
                    continue
                d = np.abs(_as_float64(e) - r)
                d = d[np.isfinite(d)]
                errs.append(float(d.max()) if d.size else 0.0)
        cases.append((k, shape, xs, [_as_float64(e) for e in eager], refs, errs, [e.dtype for e in eager]))
    run_fp64.deactivate()
    report.fp64_reference = ({"available": True} if not fp64_reasons
                             else {"available": False, "reason": fp64_reasons[0]})

    if plain_export is True:
        plain_export = builder(reference, tuple(inputs), input_names=names, output_names=None,  # by position
                               dynamic_axes={n: sorted(axes) for n, axes in dynamic.items()},
                               opset=opset_of(source.proto))
    plain = PlainExport(plain_export or None, plugin, names, cases[0][1] if cases else base)
    try:
        _run_backends(report, source, plain, cases, backends, names, out_infos, plugin, rtol, atol)
    finally:
        plain.close()
    report.plain_export = plain.info
    return report


def _run_backends(report, source, plain, cases, backends, names, out_infos, plugin, rtol, atol) -> None:
    out_names = [o.name for o in out_infos]
    for b in backends:
        if b in report.skipped:
            continue
        try:
            runner = runners.runner_for(b, source, plugin=plugin, first_shape=cases[0][1],
                                        names=names)
            runner.activate()
        except Exception as e:
            report.backend_errors[b] = f"cannot load the model: {type(e).__name__}: {_short(e)}"
            continue
        for k, shape, xs, eager, refs, errs, eager_dtypes in cases:
            try:
                outs = runner.infer(xs)
                err = None
            except Exception as e:
                outs, err = None, f"run failed: {type(e).__name__}: {ort_error(e)}"
            for j, name in enumerate(out_names):
                odt = _elem_dtype(out_infos[j]) or eager_dtypes[j]
                row = Row(backend=b, shape_index=k, input_shapes=shape, output=name, dtype=_dtype_name(odt),
                          ref_err_fp64=errs[j])
                if outs is None or j >= len(outs):
                    row.reason = err or f"backend returned {0 if outs is None else len(outs)} outputs"
                else:
                    _compare(row, outs[j], refs[j], eager[j], odt, errs[j], rtol, atol,
                             plain=lambda b=b, k=k, xs=xs, j=j, r=refs[j]: plain.error(b, k, xs, j, r))
                if runner.widened:
                    row.warning = f"{row.warning}; {runners.WIDENED}" if row.warning else runners.WIDENED
                report.rows.append(row)
        runner.deactivate()
