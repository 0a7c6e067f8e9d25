"""TensorRT engines of transformers' Qwen2RMSNorm + GemmaRMSNorm (Gemma's 1 + w folded into the
scale) and diffusers' standalone AdaLayerNormZero, converted with --target trt in fp32 and fp16:
they build from the function bodies, and with libnormexport_plugins.so (TensorRT headers needed to
build it, else skipped with that reason) each normexport node is one plugin layer. The transformers
decoder layer and the diffusers BasicTransformerBlock are in tests/test_trt_build.py. TensorRT for
RTX builds without a GPU; engines are not run here.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch

import normexport
from normexport import ops, trt

_ok, _why = trt.can_build()
if not _ok:
    pytest.skip(f"no TensorRT: {_why}", allow_module_level=True)

try:
    from tests.test_thirdparty_export import QwenGemmaNorms, randomize_
except ImportError:
    from test_thirdparty_export import QwenGemmaNorms, randomize_


class AdaLNZeroOnly(torch.nn.Module):
    """diffusers AdaLayerNormZero (its own Linear on the conditioning) -> the modulated output."""

    def __init__(self):
        super().__init__()
        from diffusers.models.normalization import AdaLayerNormZero

        self.norm = AdaLayerNormZero(64, num_embeddings=None)

    def forward(self, x, emb):
        return self.norm(x, emb=emb)[0]


def _modules():
    g = torch.Generator().manual_seed(3)
    return {
        "qwen2-gemma-rmsnorm": (randomize_(QwenGemmaNorms(), seed=7), (torch.randn(2, 8, 64, generator=g) + 0.5,),
                                ["x"], {"x": [0, 1]}),
        "diffusers-adalayernormzero": (randomize_(AdaLNZeroOnly(), seed=5),
                                       (torch.randn(2, 8, 64, generator=g), torch.randn(2, 64, generator=g)),
                                       ["x", "emb"], {"x": [0, 1], "emb": [0]}),
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("thirdparty")
    out = {}
    for key, (module, args, names, dynamic) in _modules().items():
        for dtype in (torch.float32, torch.float16):
            m = module.to(dtype).eval()
            a = tuple(t.to(dtype) for t in args)
            model = normexport.convert_module(m, a, target="trt", input_names=names, dynamic_axes=dynamic)
            path = folder / f"{key}-{str(dtype)[6:]}.onnx"
            onnx.save(model, str(path))
            out[key, dtype] = (path, model)
    return out


def _build(path: Path, model: onnx.ModelProto, plugin=None) -> trt.BuildResult:
    profiles, _ = trt.profiles.profiles_for(model, {})
    suffix = ".plugin.engine" if plugin else ".engine"
    return trt.build(trt.BuildSpec(str(path), str(path.with_suffix(suffix)), plugin=plugin, profiles=profiles))


KEYS = ["qwen2-gemma-rmsnorm", "diffusers-adalayernormzero"]
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
EXPECTED = {"qwen2-gemma-rmsnorm": ("RMSNorm", 2), "diffusers-adalayernormzero": ("AdaLNZero", 1)}


@DTYPES
@pytest.mark.parametrize("key", KEYS)
def test_builds_from_function_bodies(files, key, dtype):
    path, model = files[key, dtype]
    op, count = EXPECTED[key]
    assert [n.op_type for n in ops.custom_nodes(model)] == [op] * count
    result = _build(path, model)
    assert result.engine_bytes == Path(result.engine_path).stat().st_size > 0
    assert result.plugin_layers == [] and result.normexport_nodes == count and result.profiles


@DTYPES
@pytest.mark.parametrize("key", KEYS)
def test_one_plugin_layer_per_node(plugin_lib, files, key, dtype):
    path, model = files[key, dtype]
    result = _build(path, model, plugin_lib)
    assert len(result.plugin_layers) == result.normexport_nodes == EXPECTED[key][1]
    assert result.engine_bytes > 0 and result.profiles
