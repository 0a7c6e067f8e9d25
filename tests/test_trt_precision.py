"""Reduced-precision TensorRT networks keep the normexport ops' statistics in float32 on the body path.

normexport.trt builds fp16 / bf16 files as strongly typed networks (TensorRT for RTX has no other
kind): every tensor keeps the type the ONNX file gives it, so the bodies' Cast to float32 before
ReduceMean (RMSNorm) and LayerNormalization (AdaLNZero) decides the precision of the statistics.
Here TensorRT's parser (through Polygraphy, as the builder calls it) reads one-node files and every
REDUCE / NORMALIZATION layer it makes must read and write float32 while the network's input is
fp16 / bf16. A control graph whose ReduceMean reads fp16 directly shows the check can fail.
Parsing only (no engine build): fast, and runs wherever TensorRT imports (no GPU needed); skipped
with TensorRT's reason where TensorRT aborts the process (TensorRT for RTX on an unsupported GPU).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from normexport import ops, trt
from normexport.trt import runtime

_ok, _why = trt.can_build()
if not _ok:
    pytest.skip(f"no TensorRT: {_why}", allow_module_level=True)

# TensorRT for RTX aborts the whole process (SIGABRT, "Fatal Python error: Aborted") on GPUs it does
# not support (compute capability 9.0: an H100) instead of returning an error. Parse one RMSNorm
# file in a child process first; where that dies, skip with TensorRT's own last words.
_PROBE = """
import onnx
from onnx import TensorProto, helper
from normexport import ops
from normexport.trt import runtime
t = runtime.load()
pg, G_LOGGER, _ = runtime.polygraphy(t)
node = helper.make_node("RMSNorm", ["X", "w"], ["Y"], domain=ops.DOMAIN)
graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT16, ["b", 8])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT16, ["b", 8])],
                          [helper.make_tensor("w", TensorProto.FLOAT16, [8], [1.0] * 8)])
model = ops.attach_functions(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22),
                                                                     helper.make_opsetid(ops.DOMAIN, 1)]))
builder, network, parser = pg.NetworkFromOnnxBytes(model.SerializeToString(), strongly_typed=True)()
print("parsed", network.num_layers)
"""


def _parse_probe() -> str | None:
    """None when TensorRT parses a file in a child process, else why not (its last error lines)."""
    run = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=600)
    if run.returncode == 0 and "parsed" in run.stdout:
        return None
    lines = [ln.strip() for ln in (run.stderr + run.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or "cannot" in ln.lower()] or lines
    return f"exit code {run.returncode}: " + " | ".join(errors[-3:])[-600:]


_probe_failure = _parse_probe()
if _probe_failure is not None:
    pytest.skip(f"TensorRT cannot parse networks in this process ({_probe_failure})", allow_module_level=True)

_ELEM = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


@pytest.fixture(scope="module")
def parse():
    t = runtime.load()
    pg, G_LOGGER, _ = runtime.polygraphy(t)
    G_LOGGER.module_severity = G_LOGGER.ERROR

    def _parse(model: onnx.ModelProto):
        builder, network, parser = pg.NetworkFromOnnxBytes(model.SerializeToString(), strongly_typed=True)()
        return t.module, network, (builder, parser)

    return _parse


def _statistics_layers(trt_mod, network) -> list[tuple[str, str, str]]:
    kinds = (trt_mod.LayerType.REDUCE, trt_mod.LayerType.NORMALIZATION)
    out = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        # statistics are floating point; an integer REDUCE is shape arithmetic (RMSNorm's body
        # multiplies the normalized dims into its reshape target), not a statistic
        if layer.type in kinds and layer.get_input(0).dtype.name not in ("INT32", "INT64"):
            out.append((layer.type.name, layer.get_input(0).dtype.name, layer.get_output(0).dtype.name))
    return out


def _tensor(name, shape, elem, rng):
    values = rng.standard_normal(shape).astype(np.float32)
    raw = values.astype(np.float16).tobytes() if elem == TensorProto.FLOAT16 else \
        (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return helper.make_tensor(name, elem, shape, raw, raw=True)


def _single(op: str, x_shape, extra: dict, attrs: dict, elem) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [_tensor(n, s, elem, rng) for n, s in extra.items()]
    dims = ["b", *x_shape[1:]]
    node = helper.make_node(op, ["X", *extra], ["Y"], domain=ops.DOMAIN, **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", elem, dims)],
                              [helper.make_tensor_value_info("Y", elem, dims)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22), helper.make_opsetid(ops.DOMAIN, 1)])
    return ops.attach_functions(model)


FORMS = {
    "rms-axis-1": ("RMSNorm", (2, 8, 64), {"scale": (64,)}, {"axis": -1}),
    "rms-axis1": ("RMSNorm", (2, 8, 64), {"scale": (8, 64)}, {"axis": 1}),
    "adaln-BH": ("AdaLNZero", (2, 8, 64), {"shift": (2, 64), "scale": (2, 64)}, {}),
    "adaln-affine": ("AdaLNZero", (2, 8, 64), {"shift": (2, 64), "scale": (2, 64), "weight": (64,), "bias": (64,)}, {}),
}


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("form", list(FORMS))
def test_body_statistics_stay_float32(parse, form, dtype):
    op, x_shape, extra, attrs = FORMS[form]
    trt_mod, network, _keep = parse(_single(op, x_shape, extra, {**attrs, "epsilon": 1e-5}, _ELEM[dtype]))
    assert network.get_input(0).dtype.name == {"fp16": "HALF", "bf16": "BF16"}[dtype]
    layers = _statistics_layers(trt_mod, network)
    assert layers, f"{form}: no REDUCE / NORMALIZATION layer in the parsed body"
    assert all(i == o == "FLOAT" for _, i, o in layers), layers


def test_control_fp16_reduce_is_seen(parse):
    """A ReduceMean that reads fp16 directly (no Cast): the check above would flag it."""
    node = helper.make_node("ReduceMean", ["X", "axes"], ["Y"], keepdims=1)
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [-1])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT16, ["b", 64])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT16, ["b", 1])], [axes])
    trt_mod, network, _keep = parse(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert _statistics_layers(trt_mod, network) == [("REDUCE", "HALF", "HALF")]
