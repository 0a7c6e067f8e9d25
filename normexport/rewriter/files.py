"""rewrite_file: an ONNX file in (external data too), the rewritten file out, written atomically."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import onnx

from normexport import sizes as _sizes
from normexport.errors import UsageError, first_line

from .driver import rewrite
from .opset import all_nodes
from .report import RewriteReport

_TWO_GB = 2**31


def _has_external_data(model: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in _iter_tensors(model))


def _iter_tensors(model: onnx.ModelProto):
    yield from model.graph.initializer
    for n in all_nodes(model):
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                yield a.t


def rewrite_file(in_path: str | os.PathLike, out_path: str | os.PathLike, target: str = "trt",
                 verify: bool = True, report_path: str | os.PathLike | None = None,
                 inputs: list[str] | dict[str, list[int]] | None = None) -> RewriteReport:
    """Load `in_path` (with its external data), rewrite, write `out_path` atomically (external
    data next to it when the input had external data or the result exceeds 2 GB). `inputs`: the
    sizes to verify at, as `--input NAME:DIMS[:DTYPE]` texts or {name: dims}."""
    in_path, out_path = os.fspath(in_path), os.fspath(out_path)
    if not os.path.isfile(in_path):
        raise UsageError(f"{in_path}: no such file; pass an existing .onnx file")
    try:
        model = onnx.load(in_path, load_external_data=False)
        external = _has_external_data(model)
        if external:
            onnx.load_external_data_for_model(model, os.path.dirname(os.path.abspath(in_path)))
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"{in_path}: not a readable ONNX model ({first_line(e, 120)}); pass a valid .onnx file") from e
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise UsageError(f"{out_path}: cannot write there; choose an existing writable folder with -o")
    if inputs is not None and not isinstance(inputs, dict):
        inputs = _sizes.parse_inputs(model, list(inputs))
    report = RewriteReport()
    result = rewrite(model, target=target, verify=verify, report=report, inputs=inputs)
    big = result.ByteSize() >= _TWO_GB if not external else True
    try:
        tmpdir = tempfile.mkdtemp(prefix=".normexport-", dir=out_dir)
        try:
            base = os.path.basename(out_path)
            tmp_model = os.path.join(tmpdir, base)
            if big:
                data_name = base + ".data"
                onnx.save_model(result, tmp_model, save_as_external_data=True, all_tensors_to_one_file=True,
                                location=data_name, size_threshold=0 if external else 1024)
                if os.path.exists(os.path.join(tmpdir, data_name)):
                    os.replace(os.path.join(tmpdir, data_name), os.path.join(out_dir, data_name))
            else:
                onnx.save_model(result, tmp_model)
            os.replace(tmp_model, os.path.abspath(out_path))
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
    except OSError as e:
        raise UsageError(f"{out_path}: cannot write ({e.strerror}); choose a writable path with -o") from e
    if report_path is not None:
        rp = os.fspath(report_path)
        try:
            tmp = rp + ".tmp"
            with open(tmp, "w") as f:
                json.dump(report.to_dict(), f, indent=2)
            os.replace(tmp, rp)
        except OSError as e:
            raise UsageError(f"{rp}: cannot write the report ({e.strerror}); choose a writable path") from e
    return report
