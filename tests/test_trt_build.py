"""A real TensorRT reads every --target trt file normexport writes: TensorRT for RTX (PyPI) parses and
builds engines on this CPU-only machine, `tensorrt` where installed (normexport.trt takes either).

- without the plugin: the normexport ops' function bodies parse and build (reference models, real
  transformers / diffusers blocks; fp32, fp16, bf16; every axis / rank / modulation form of the ops)
- with the plugin (needs TensorRT headers to build it, found as tests/_plugin_build.find_tensorrt_root
  says, else skipped with that reason): exactly one plugin layer per normexport node, engines build
  with dynamic-shape profiles; counts read from the ONNX file and from the parsed network, not from
  normexport's own count
- `normexport build` as a user runs it (a fresh process): summary, report, bad input
Engines are not executed here (that needs an NVIDIA GPU: tests/test_trt.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import normexport
from normexport import ops, trt

_ok, _why = trt.can_build()
if not _ok:
    pytest.skip(f"no TensorRT: {_why}", allow_module_level=True)

REFERENCE = ["bert", "conv_bn", "dit", "llama", "norm_heavy"]


def _profiles(model: onnx.ModelProto) -> dict:
    shapes, _ = trt.profiles.profiles_for(model, {})
    return shapes


def _build(model: onnx.ModelProto, tmp_path: Path, plugin: str | None = None, name: str = "m") -> trt.BuildResult:
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return trt.build(trt.BuildSpec(str(path), str(tmp_path / f"{name}.engine"), plugin=plugin, profiles=_profiles(model)))


def _model_module(name: str):
    """The bundled reference model `name` (top-level models/, formerly normexport/models/)."""
    import importlib

    try:
        return importlib.import_module(f"normexport.models.{name}")
    except ModuleNotFoundError:
        root = str(Path(__file__).resolve().parents[1])  # the checkout, where models/ is
        if root not in sys.path:
            sys.path.insert(0, root)
        return importlib.import_module(f"models.{name}")


def _reference(name: str, dtype: torch.dtype) -> onnx.ModelProto:
    mod = _model_module(name)
    block = mod.tiny().to(dtype)
    x = tuple(t.to(dtype) if t.is_floating_point() else t for t in block.example_inputs())
    return normexport.convert_module(block, x, target="trt", input_names=block.input_names,
                                     dynamic_axes=block.dynamic_axes, opset=22 if dtype == torch.bfloat16 else None,
                                     verify=dtype != torch.bfloat16)


_CONVERTED: dict = {}


def reference(name: str, dtype: torch.dtype) -> onnx.ModelProto:
    if (name, dtype) not in _CONVERTED:
        _CONVERTED[name, dtype] = _reference(name, dtype)
    return _CONVERTED[name, dtype]


#: normexport nodes per reference model, from the models' structure (README's table): LLaMA's two
#: RMSNorms, DiT's two modulated LayerNorms, norm_heavy's two RMSNorms (its LayerNorm stays standard);
#: a norm that reads a residual sum has the Add fused in (--target trt): LLaMA's post-attention norm
#: (x + attn), DiT's norm2 (x + gate * attn), both of norm_heavy's (x + r, y1 + r)
NORMEXPORT_NODES = {"bert": {}, "conv_bn": {}, "dit": {"AdaLNZero": 1, "GatedAdaLNZero": 1},
                    "llama": {"RMSNorm": 1, "SkipRMSNorm": 1}, "norm_heavy": {"SkipRMSNorm": 2}}


def _file_nodes(model: onnx.ModelProto) -> dict[str, list[str]]:
    """normexport nodes of the file's graph by op type -> node names, read from the ONNX file itself."""
    out: dict[str, list[str]] = {}
    for n in model.graph.node:
        if n.domain == "normexport":
            out.setdefault(n.op_type, []).append(n.name)
    return out


@pytest.fixture(scope="module")
def parse():
    """TensorRT's ONNX parser in this process (no plugin library loaded): the network, read here and
    not through normexport.trt.build."""
    t = trt.runtime.load()
    pg, G_LOGGER, _ = trt.runtime.polygraphy(t)
    G_LOGGER.module_severity = G_LOGGER.ERROR

    def _parse(model: onnx.ModelProto):
        builder, network, parser = pg.NetworkFromOnnxBytes(model.SerializeToString(), strongly_typed=True)()
        layers = [network.get_layer(i) for i in range(network.num_layers)]
        return t.module, layers, (builder, network, parser)

    return _parse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", REFERENCE)
def test_reference_models_build_without_plugin(name, dtype, tmp_path, parse):
    model = reference(name, dtype)
    nodes = _file_nodes(model)
    assert {k: len(v) for k, v in nodes.items()} == NORMEXPORT_NODES[name]
    result = _build(model, tmp_path)
    assert result.engine_bytes > 0 and Path(result.engine_path).stat().st_size == result.engine_bytes
    n = sum(NORMEXPORT_NODES[name].values())
    assert result.plugin_layers == [] and result.normexport_nodes == n and result.bodies == n
    assert result.strongly_typed  # the file's dtypes decide: fp32 statistics of the bodies stay fp32
    # the network as TensorRT's parser makes it here: same layer count, no plugin layer, and one
    # NORMALIZATION layer per AdaLNZero / GatedAdaLNZero body (LayerNormalization inside) and per plain
    # LayerNormalization
    trt_mod, layers, _keep = parse(model)
    assert len(layers) == result.layers
    assert not [ly.name for ly in layers if ly.type in trt.runtime.plugin_layer_types(trt_mod)]
    plain_ln = sum(nd.op_type == "LayerNormalization" and nd.domain in ("", "ai.onnx") for nd in model.graph.node)
    adaln = len(nodes.get("AdaLNZero", [])) + len(nodes.get("GatedAdaLNZero", []))
    assert sum(ly.type == trt_mod.LayerType.NORMALIZATION for ly in layers) == adaln + plain_ln


@pytest.mark.parametrize("name", ["dit", "llama"])
def test_bfloat16_files_build(name, tmp_path):
    model = reference(name, torch.bfloat16)
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.BFLOAT16
    assert _build(model, tmp_path).engine_bytes > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("name", ["dit", "llama", "norm_heavy"])
def test_plugin_layer_per_normexport_node(plugin_lib, name, dtype, tmp_path):
    """One plugin layer per normexport node: the parsed network's plugin layers are named as the
    file's normexport nodes, which the ONNX file (and the model's structure) says there are."""
    model = reference(name, dtype)
    nodes = _file_nodes(model)
    assert {k: len(v) for k, v in nodes.items()} == NORMEXPORT_NODES[name]
    result = _build(model, tmp_path, plugin=plugin_lib)
    assert sorted(result.plugin_layers) == sorted(sum(nodes.values(), [])), result
    assert result.normexport_nodes == sum(NORMEXPORT_NODES[name].values()) and result.bodies == 0
    assert result.profiles and result.engine_bytes > 0


# ---- real library blocks ---------------------------------------------------------------------
def _hf_blocks():
    try:
        from tests.test_thirdparty_export import DiTBlock, LlamaBlock, _dit_inputs, randomize_
    except ImportError:  # tests/ itself on sys.path (plain `pytest`)
        from test_thirdparty_export import DiTBlock, LlamaBlock, _dit_inputs, randomize_

    llama = randomize_(LlamaBlock(), seed=4)
    dit = randomize_(DiTBlock(), seed=1)
    return {
        "transformers-llama-layer": (llama, (torch.randn(2, 8, 64) + 0.3,), ["x"], {"x": [0, 1]}),
        "diffusers-basic-block": (dit, _dit_inputs(2, 8, seed=2), ["x", "timestep", "class_labels"],
                                  {"x": [0, 1], "timestep": [0], "class_labels": [0]}),
    }


@pytest.fixture(scope="module")
def hf_files():
    out = {}
    for key, (module, args, names, dynamic) in _hf_blocks().items():
        for dtype in (torch.float32, torch.float16):
            m = module.to(dtype)
            a = tuple(t.to(dtype) if t.is_floating_point() else t for t in args)
            out[key, dtype] = normexport.convert_module(m, a, target="trt", input_names=names, dynamic_axes=dynamic)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("key", ["transformers-llama-layer", "diffusers-basic-block"])
def test_library_blocks_build(hf_files, key, dtype, tmp_path):
    model = hf_files[key, dtype]
    assert ops.custom_nodes(model)
    assert _build(model, tmp_path).engine_bytes > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("key", ["transformers-llama-layer", "diffusers-basic-block"])
def test_library_blocks_with_plugin(plugin_lib, hf_files, key, dtype, tmp_path):
    model = hf_files[key, dtype]
    nodes = _file_nodes(model)
    # LlamaDecoderLayer: input and post-attention RMSNorm (the latter with the residual Add fused in);
    # BasicTransformerBlock (ada_norm_zero): norm1 is AdaLayerNormZero, norm3 a plain LayerNorm modulated
    # by the block (both fused to AdaLNZero, norm3 with the gated residual Add: GatedAdaLNZero)
    assert {k: len(v) for k, v in nodes.items()} == {
        "transformers-llama-layer": {"RMSNorm": 1, "SkipRMSNorm": 1},
        "diffusers-basic-block": {"AdaLNZero": 1, "GatedAdaLNZero": 1}}[key]
    result = _build(model, tmp_path, plugin=plugin_lib)
    assert sorted(result.plugin_layers) == sorted(sum(nodes.values(), []))


# ---- every form of the ops' contracts, one node each -----------------------------------------
_ELEM = {"fp32": (TensorProto.FLOAT, np.float32), "fp16": (TensorProto.FLOAT16, np.float16),
         "bf16": (TensorProto.BFLOAT16, None)}


def _single(op: str, x_shape, extra: dict, attrs: dict, dtype: str) -> onnx.ModelProto:
    elem, np_dtype = _ELEM[dtype]
    rng = np.random.default_rng(0)
    inits = []
    for name, shape in extra.items():
        values = rng.standard_normal(shape).astype(np.float32)
        t = helper.make_tensor(name, elem, shape, values.astype(np_dtype).tobytes() if np_dtype else
                               (values.view(np.uint32) >> 16).astype(np.uint16).tobytes(), raw=True)
        inits.append(t)
    dims = ["b" if i == 0 else d for i, d in enumerate(x_shape)]
    node = helper.make_node(op, ["X", *extra], ["Y"], domain=ops.DOMAIN, **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", elem, dims)],
                              [helper.make_tensor_value_info("Y", elem, dims)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22), helper.make_opsetid(ops.DOMAIN, 1)])
    ops.attach_functions(model)
    return model


RMS_FORMS = {  # x shape, scale shape, axis
    "rank3-axis-1": ((2, 8, 64), (64,), -1),
    "rank3-axis-2": ((2, 8, 64), (8, 64), -2),
    "rank3-axis1": ((2, 8, 64), (8, 64), 1),
    "rank2-axis-1": ((4, 32), (32,), -1),
    "rank4-axis-1": ((2, 3, 8, 32), (32,), -1),
    "rank4-axis2": ((2, 3, 8, 32), (8, 32), 2),
}


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("form", list(RMS_FORMS))
def test_rms_norm_body_every_axis_builds(form, dtype, tmp_path):
    x_shape, s_shape, axis = RMS_FORMS[form]
    model = _single("RMSNorm", x_shape, {"scale": s_shape}, {"axis": axis, "epsilon": 1e-5}, dtype)
    onnx.checker.check_model(model, full_check=True)
    assert _build(model, tmp_path).engine_bytes > 0


@pytest.mark.parametrize("form", list(RMS_FORMS))
def test_rms_norm_body_numerics_in_onnxruntime(form):
    import onnxruntime as ort

    x_shape, s_shape, axis = RMS_FORMS[form]
    model = _single("RMSNorm", x_shape, {"scale": s_shape}, {"axis": axis, "epsilon": 1e-5}, "fp32")
    x = np.random.default_rng(1).standard_normal(x_shape).astype(np.float32) * 3 + 0.5
    scale = onnx.numpy_helper.to_array(model.graph.initializer[0])
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    # float64 from the formula: dims axis..rank-1 normalized
    axes = tuple(range(axis % len(x_shape), len(x_shape)))
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(axis=axes, keepdims=True) + 1e-5) * scale.astype(np.float64)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max() + 1e-6


ADALN_FORMS = {  # x shape, shift/scale shape, with affine
    "BH": ((2, 8, 64), (2, 64), False),
    "BH-affine": ((2, 8, 64), (2, 64), True),
    "full": ((2, 8, 64), (2, 8, 64), False),
    "rank2": ((4, 64), (4, 64), True),
    "rank4-BH": ((2, 3, 8, 32), (2, 32), True),
}


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("form", list(ADALN_FORMS))
def test_adaln_body_every_form_builds(form, dtype, tmp_path):
    x_shape, m_shape, affine = ADALN_FORMS[form]
    extra = {"shift": m_shape, "scale": m_shape}
    if affine:
        extra.update(weight=(x_shape[-1],), bias=(x_shape[-1],))
    model = _single("AdaLNZero", x_shape, extra, {"epsilon": 1e-6}, dtype)
    onnx.checker.check_model(model, full_check=True)
    assert _build(model, tmp_path).engine_bytes > 0


# ---- normexport build, as a user runs it ------------------------------------------------------
def _cli(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "normexport", "build", *map(str, args)], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "llama.onnx"
    onnx.save(reference("llama", torch.float32), str(path))
    return path


def test_build_cli_without_plugin(llama_file, tmp_path):
    out, rep = tmp_path / "l.engine", tmp_path / "r.json"
    r = _cli(llama_file, "-o", out, "--no-plugin", "--report", rep, "--shapes", "x:1x1x64/2x16x64/4x64x64")
    assert r.returncode == 0, r.stderr
    assert "profile x: min 1x1x64, opt 2x16x64, max 4x64x64" in r.stdout
    assert "normexport nodes: 2 (0 plugin layers, 2 as function bodies)" in r.stdout
    report = json.loads(rep.read_text())
    assert report["command"] == "build" and report["engine_bytes"] == out.stat().st_size > 0
    assert report["tensorrt"].startswith(("TensorRT for RTX", "TensorRT")) and report["bodies"] == 2
    assert report["inputs"] == [{"name": "x", "min": [1, 1, 64], "opt": [2, 16, 64], "max": [4, 64, 64]}]


def test_build_cli_with_plugin_in_a_fresh_process(plugin_lib, llama_file, tmp_path):
    out = tmp_path / "l.engine"
    r = _cli(llama_file, "-o", out, "--plugin", plugin_lib)  # profiles derived from the file
    assert r.returncode == 0, r.stderr
    assert "normexport nodes: 2 (2 plugin layers, 0 as function bodies)" in r.stdout, r.stdout
    assert out.stat().st_size > 0


@pytest.mark.parametrize("case", ["not-onnx", "unknown-name", "min-gt-max", "bad-syntax", "fixed-dim", "plugin-not-lib",
                                  "plugin-missing"])
def test_build_cli_bad_input(case, llama_file, tmp_path, capfd):
    """One line naming the problem, exit 2, no traceback, nothing written. In this process (normexport's
    main, stdout / stderr read at the file descriptors, so TensorRT's own output counts too), except
    "not-onnx", which runs in a fresh process as users run it (the exit status of the process)."""
    out = tmp_path / "o.engine"
    args = {
        "not-onnx": [tmp_path / "x.onnx"],
        "unknown-name": [llama_file, "--shapes", "y:1x1x64/1x2x64/1x4x64"],
        "min-gt-max": [llama_file, "--shapes", "x:4x1x64/2x2x64/1x4x64"],
        "bad-syntax": [llama_file, "--shapes", "x:1x1x64"],
        "fixed-dim": [llama_file, "--shapes", "x:1x1x32/1x2x32/1x4x32"],
        "plugin-not-lib": [llama_file, "--plugin", tmp_path / "x.onnx"],
        "plugin-missing": [llama_file, "--plugin", tmp_path / "nope.so"],
    }[case]
    (tmp_path / "x.onnx").write_text("not a model")
    if case == "not-onnx":
        r = _cli(*args, "-o", out)
        code, stdout, stderr = r.returncode, r.stdout, r.stderr
    else:
        from normexport.cli import main

        capfd.readouterr()
        try:
            code = main(["build", *map(str, args), "-o", str(out)])
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code
        stdout, stderr = capfd.readouterr()
    assert code == 2, (stdout, stderr)
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))


def test_build_cli_tensorrt_rejects(tmp_path):
    """A node TensorRT has no importer for: exit 1 with TensorRT's own error text, no engine."""
    node = helper.make_node("NoSuchOp", ["x"], ["y"], domain="acme")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    path = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("acme", 1)]),
              str(path))
    r = _cli(path, "--no-plugin")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "NoSuchOp" in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not path.with_suffix(".engine").exists()
