"""Complex rotary arithmetic lowered for Qwen-Image and Llama 4 (normexport.prepare.complex, issue 22):
diffusers QwenImageTransformer2DModel (complex tables on the rotary module, split / expand / cat of them,
view_as_complex of q / k; its forward takes `img_shapes`, a list of tuples) as a folder with its call
given by `--inputs FILE`, and `.pt2` archives (torch.export.save) of it and of transformers
Llama4ForCausalLM through `normexport convert`: the program's ATen graph holds complex
split_with_sizes / view_as_complex / mul / polar, lowered when the exporter traces the program's
module again. Each file: no complex type, norms fused, onnxruntime parity against the float64
reference (or eager where the program cannot run in float64)."""

from __future__ import annotations

import json
from collections import Counter

import onnx
import pytest
import torch

from _norm_counts import norm_ops

diffusers = pytest.importorskip("diffusers")


B, H, W, T = 2, 4, 6, 5


def _qwen():
    torch.manual_seed(0)
    model = diffusers.QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
                                                  attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                                  axes_dims_rope=(2, 2, 4)).eval()
    kwargs = dict(hidden_states=torch.randn(B, H * W, 16), encoder_hidden_states=torch.randn(B, T, 16),
                  encoder_hidden_states_mask=torch.ones(B, T), timestep=torch.rand(B),
                  img_shapes=[[(1, H, W)]] * B, return_dict=False)
    return model, kwargs


def _llama4():
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    cfg = Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
                           max_position_embeddings=64, attention_chunk_size=16, use_cache=False)
    return Llama4ForCausalLM(cfg).eval()


def _no_complex(m: onnx.ModelProto):
    types = [v.type.tensor_type.elem_type for v in list(m.graph.value_info) + list(m.graph.input) + list(m.graph.output)]
    types += [t.data_type for t in m.graph.initializer]
    assert not {onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128} & set(types)


def _norm_calls(model, call) -> Counter:
    """RMSNorm module calls and AdaLayerNormContinuous / modulated-LayerNorm sites of the forward."""
    calls: Counter = Counter()
    hooks = [m.register_forward_hook(lambda *a, n=type(m).__name__: calls.update([n])) for m in model.modules()
             if type(m).__name__ in ("RMSNorm", "Llama4TextRMSNorm", "Llama4TextL2Norm", "LayerNorm")]
    with torch.no_grad():
        call()
    for h in hooks:
        h.remove()
    return calls


def test_qwen_image_folder_converts_with_inputs_file(cli, tmp_path):
    """The folder with its example call given by --inputs FILE (img_shapes is a list of tuples)."""
    model, kwargs = _qwen()
    model.save_pretrained(tmp_path / "qwen")
    torch.save(((), kwargs), tmp_path / "inputs.pt")
    out, rep_path = tmp_path / "q.onnx", tmp_path / "q.json"
    code, stdout, err = cli("convert", tmp_path / "qwen", "--inputs", tmp_path / "inputs.pt", "-o", out,
                            "--report", rep_path)
    assert code == 0, (stdout, err)
    rep = json.loads(rep_path.read_text())
    lowering = [e for e in rep["prepare"] if e.get("lowering") == "complex"]
    assert [e["action"] for e in lowering] == ["swapped"] and lowering[0]["max_rel_err"] <= 1e-5, lowering
    assert "pos_embed.pos_freqs: complex64" in lowering[0]["reason"]
    assert "complex values carried as real (re, im) pairs: QwenImageTransformer2DModel (" in stdout, stdout
    proto = onnx.load(str(out), load_external_data=False)
    _no_complex(proto)
    calls = _norm_calls(model, lambda: model(**kwargs))
    ops = norm_ops(proto, "normexport")  # a fused residual norm counted as its norm
    # every RMSNorm call fused; the LayerNorms are the modulated ones (img/txt norm1/norm2, norm_out),
    # all fused but the last block's txt_norm2, which feeds only the text stream the model does not
    # return (dead code, removed by the exporter); no LayerNorm left unfused
    assert calls["RMSNorm"] == 5 and ops["RMSNorm"] == calls["RMSNorm"], (ops, calls)
    assert calls["LayerNorm"] == 5 and ops["AdaLNZero"] == calls["LayerNorm"] - 1, (ops, calls)
    assert not {"LayerNormalization", "ReduceMean"} & {n.op_type for n in proto.graph.node}
    rows = [r for per in rep["results"]["ort"].values() for r in per]
    assert "PASSED" in stdout and rows and all(r["passed"] for r in rows), rows
    assert max(r["max_abs_err"] for r in rows) < 5e-6  # onnxruntime vs the float64 reference


def test_qwen_image_pt2_converts(cli, tmp_path):
    model, kwargs = _qwen()
    program = torch.export.export(model, (), kwargs)
    assert any(n.target is torch.ops.aten.split_with_sizes.default and n.meta["val"][0].dtype.is_complex
               for n in program.graph.nodes if n.op == "call_function"), "the program must split a complex table"
    torch.export.save(program, tmp_path / "qwen.pt2")
    out, rep_path = tmp_path / "q.onnx", tmp_path / "q.json"
    code, stdout, err = cli("convert", tmp_path / "qwen.pt2", "-o", out, "--report", rep_path)
    assert code == 0, (stdout, err)
    rep = json.loads(rep_path.read_text())
    lowering = [e for e in rep["prepare"] if e.get("lowering") == "complex"]
    assert [e["action"] for e in lowering] == ["swapped"] and "split_with_sizes x2" in lowering[0]["reason"], lowering
    assert rep["exporter"]["name"] == "dynamo", rep["exporter"]
    m = onnx.load(str(out), load_external_data=False)
    _no_complex(m)
    ops = norm_ops(m)  # a fused residual norm counted as its norm
    assert ops["RMSNorm"] == 5 and ops["AdaLNZero"] == 4 and not ops["LayerNormalization"] + ops["ReduceMean"], ops
    rows = [r for per in rep["results"]["ort"].values() for r in per]
    assert "PASSED" in stdout and rows and all(r["passed"] for r in rows), rows


def test_llama4_pt2_converts(cli, tmp_path):
    """A program with positional inputs only: its module is a bare GraphModule (no CallAdapter)."""
    model = _llama4()
    ids = torch.randint(0, 64, (2, 7))
    program = torch.export.export(model, (ids,))
    assert any(n.target is torch.ops.aten.polar.default for n in program.graph.nodes)
    torch.export.save(program, tmp_path / "l4.pt2")
    out, rep_path = tmp_path / "l4.onnx", tmp_path / "l4.json"
    code, stdout, err = cli("convert", tmp_path / "l4.pt2", "-o", out, "--report", rep_path)
    assert code == 0, (stdout, err)
    rep = json.loads(rep_path.read_text())
    lowering = [e for e in rep["prepare"] if e.get("lowering") == "complex"]
    assert [e["action"] for e in lowering] == ["swapped"] and "polar x1" in lowering[0]["reason"], lowering
    assert rep["exporter"]["name"] == "dynamo", rep["exporter"]  # lowered, not left to the TorchScript exporter
    m = onnx.load(str(out), load_external_data=False)
    _no_complex(m)
    calls = _norm_calls(model, lambda: model(ids))
    assert norm_ops(m)["RMSNorm"] == sum(calls.values()) == 9, calls
    rows = [r for per in rep["results"]["ort"].values() for r in per]
    assert "PASSED" in stdout and rows and all(r["passed"] for r in rows), rows
