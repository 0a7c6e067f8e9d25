"""TensorRT parity: engines built from trt-target ONNX of the reference DiT and LLaMA blocks, with
the normexport plugins, match eager PyTorch.

Skips (with the reason) when tensorrt is not importable, when there is no CUDA GPU, or when the
plugin library could not be built (CMake did not find TensorRT headers: set TensorRT_ROOT).
$NORMEXPORT_PLUGIN_LIB points at a prebuilt libnormexport_plugins.so.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from normexport import trt as ntrt

_ok, _why = ntrt.is_available()
if not _ok:
    pytest.skip(_why if _why.startswith("tensorrt not importable") else f"TensorRT unusable: {_why}",
                allow_module_level=True)

try:
    from tests._plugin_build import build_plugins, find_nvcc
except ImportError:
    from _plugin_build import build_plugins, find_nvcc


@pytest.fixture(scope="module")
def plugin_lib():
    path = os.environ.get("NORMEXPORT_PLUGIN_LIB")
    if path:
        return path
    if find_nvcc() is None:
        pytest.skip("nvcc not found and NORMEXPORT_PLUGIN_LIB not set: cannot build the plugin")
    build = build_plugins()
    if build.plugin_lib is None:
        pytest.skip("plugin library not built: CMake did not find TensorRT (set TensorRT_ROOT)")
    return str(build.plugin_lib)


def _outputs(value):
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    return [v for v in value if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("family, op", [("dit", "AdaLNZero"), ("llama", "RMSNorm")])
def test_trt_parity_with_eager(plugin_lib, family, op):
    import importlib

    import torch

    import normexport

    models = importlib.import_module(f"normexport.models.{family}")
    module = models.tiny().eval()
    inputs = module.example_inputs()
    with torch.no_grad():
        refs = [r.detach().float().cpu().numpy() for r in _outputs(module(*inputs))]

    model = normexport.convert_module(module, inputs, target="trt")
    assert any(n.domain == "normexport" and n.op_type == op for n in model.graph.node), \
        f"{family}: the trt-target ONNX has no normexport {op} node"

    engine = ntrt.build_engine(model, plugin_lib)
    assert engine.plugin_layers, f"{family}: TensorRT inlined the function bodies instead of using the plugin"

    initializers = {i.name for i in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in initializers]
    feeds = {name: x.detach().cpu().numpy() for name, x in zip(names, inputs)}
    outs = ntrt.run_engine(engine, feeds)
    assert len(outs) == len(refs)
    for got, ref in zip(outs, refs):
        assert got.shape == ref.shape
        tol = 1e-4 * float(np.max(np.abs(ref))) + 1e-5
        err = float(np.max(np.abs(got.astype(np.float64) - ref)))
        assert err <= tol, f"{family}: TensorRT vs eager max abs err {err:.3g} > {tol:.3g}"
