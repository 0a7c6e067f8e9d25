"""Issue 19 families on real transformers / diffusers classes (tiny configs, random weights, no
hub access): a .pt2 whose dynamo export fails falls back to the TorchScript exporter, `--module`
on a .pt2, video diffusion transformers and encoder-decoders from save_pretrained folders (example
inputs derived from the forward signature and config), a class that keeps modules in float32.
Every conversion: norms fused, counted from the model's structure (one normalization per call of
a norm module in a forward), and onnxruntime parity against the float64 reference passes."""

from __future__ import annotations

import json
from collections import Counter

import onnx
import pytest
import torch

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

import normexport  # noqa: E402
from normexport.load import examples  # noqa: E402
from _norm_counts import norm_ops  # noqa: E402


def _tiny(name):
    torch.manual_seed(0)
    D = diffusers
    if name == "cogvideox":
        return D.CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                             time_embed_dim=16, text_embed_dim=16, num_layers=1, sample_width=4,
                                             sample_height=4, sample_frames=5, patch_size=2, max_text_seq_length=6)
    if name == "wan":
        return D.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                       out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32)
    if name == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            decoder_start_token_id=0))
    if name == "bart":
        return transformers.BartForConditionalGeneration(transformers.BartConfig(
            vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32))
    raise KeyError(name)


def _norm_calls(module, inputs) -> Counter:
    """Normalizations a forward runs: calls of LayerNorm / RMSNorm modules (structure, not ONNX)."""
    calls: Counter = Counter()
    handles = []
    for m in module.modules():
        cls = type(m).__name__
        rms = cls.endswith("RMSNorm") or cls == "T5LayerNorm" or isinstance(m, torch.nn.RMSNorm)
        if rms or isinstance(m, torch.nn.LayerNorm):
            handles.append(m.register_forward_hook(lambda *a, kind="rms" if rms else "ln": calls.update([kind])))
    with torch.no_grad():
        module(*inputs)
    for h in handles:
        h.remove()
    return calls


def _ops(path) -> Counter:
    """Op-type counts of the file, a fused residual norm (SkipRMSNorm, GatedAdaLNZero) counted as its norm."""
    return norm_ops(path)


def _assert_fused(path, calls: Counter):
    ops = _ops(path)
    assert ops["RMSNorm"] == calls["rms"], (ops, calls)
    assert ops["AdaLNZero"] + ops["LayerNormalization"] == calls["ln"], (ops, calls)
    assert ops["ReduceMean"] == 0, ops  # nothing left decomposed


def _convert(cli, model, out, *extra):
    """`normexport convert` in-process: (stdout, report, file errors: max abs error of the
    onnxruntime run of the file vs the float64 reference, per output and shape)."""
    report = out.with_suffix(".json")
    code, stdout, err = cli("convert", model, "-o", out, "--report", report, *extra)
    assert code == 0, (stdout, err)
    rep = json.loads(report.read_text())
    rows = [row for per_output in rep["results"]["ort"].values() for row in per_output]
    assert rows and all(row["passed"] for row in rows), rows
    return stdout, rep, [row["max_abs_err"] for row in rows]


# ---- .pt2: fallback to the TorchScript exporter, --module ------------------------------------------
def _pt2(tmp_path, module, args, kwargs=None):
    path = tmp_path / "m.pt2"
    torch.export.save(torch.export.export(module.eval(), args, kwargs or {}), path)
    return path


def test_pt2_falls_back_to_torchscript_exporter(cli, tmp_path, monkeypatch):
    """T5EncoderModel .pt2 with the dynamo export failing (forced: whether torch's dynamo exporter
    fails on T5 varies): the ExportedProgram's module goes through the TorchScript exporter (it
    refused train() before), the rewriter fuses every T5LayerNorm, parity passes."""
    from normexport.exporter import rungs

    torch.manual_seed(0)
    enc = transformers.T5EncoderModel(transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                            num_heads=4)).eval()
    ids = torch.randint(0, 64, (2, 8))
    path = _pt2(tmp_path, enc, (ids,))

    def dynamo_fails(*a, **k):
        raise ValueError("Cannot view a tensor with shape (forced for the test)")

    monkeypatch.setattr(rungs, "_torch_onnx_export", dynamo_fails)
    out = tmp_path / "m.onnx"
    stdout, rep, errs = _convert(cli, path, out)
    assert rep["exporter"]["name"] == "torchscript" and "forced for the test" in rep["exporter"]["dynamo_error"]
    assert "torchscript exporter" in stdout and "PASSED" in stdout
    _assert_fused(out, _norm_calls(enc, (ids,)))  # 2 layers x 2 + final = 5 RMSNorm
    assert _ops(out)["RMSNorm"] == 5
    assert max(errs) < 1e-5


def test_module_on_a_pt2(cli, tmp_path):
    """`--module model.layers.1` on a LLaMA .pt2: the flat program is unflattened, the block's call
    captured; its 2 RMSNorms fused; parity passes."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    llama = transformers.LlamaForCausalLM(cfg).eval()
    path = _pt2(tmp_path, llama, (torch.randint(0, 64, (2, 8)),), {"use_cache": False})
    out = tmp_path / "layer1.onnx"
    stdout, rep, errs = _convert(cli, path, out, "--module", "model.layers.1")
    assert "--module model.layers.1" in stdout and "PASSED" in stdout
    ops = _ops(out)
    assert ops["RMSNorm"] == 2 and ops["ReduceMean"] == 0, ops
    assert max(errs) < 1e-5
    code, _, err = cli("convert", path, "-o", tmp_path / "x.onnx", "--module", "model.layers.7")
    assert code == 2 and "model.layers.1" in err and len(err.strip().splitlines()) == 1


# ---- folders: example inputs from the signature and config ------------------------------------------
@pytest.mark.parametrize("family", ["cogvideox", "wan", "t5", "bart"])
def test_folder_families_convert_fused(cli, tmp_path, family):
    folder = tmp_path / family
    _tiny(family).eval().save_pretrained(folder)
    loaded = normexport.load(str(folder))
    shapes = dict(zip(loaded.input_names, [tuple(t.shape) for t in loaded.example_inputs]))
    if family == "cogvideox":  # [B, F, C, H, W], text sized by text_embed_dim
        assert shapes["hidden_states"][2] == 4 and len(shapes["hidden_states"]) == 5
        assert shapes["encoder_hidden_states"][-1] == 16
    elif family == "wan":  # [B, C, F, H, W]
        assert shapes["hidden_states"][1] == 4 and len(shapes["hidden_states"]) == 5
    else:  # encoder-decoders: the decoder's tokens too
        assert set(shapes) == {"input_ids", "decoder_input_ids"}
    out = tmp_path / f"{family}.onnx"
    stdout, rep, errs = _convert(cli, folder, out)
    assert "PASSED" in stdout
    _assert_fused(out, _norm_calls(loaded.module, loaded.example_inputs))
    assert max(errs) < 1e-5


def test_missing_inputs_error_lists_every_required_input(cli, tmp_path, monkeypatch):
    """A class whose main input is not `hidden_states` (UNet2DConditionModel takes `sample`), its
    documentation hidden and `sample` left unmade (since issue 28 it is made from its documented
    shape, its role, or like the latents: tests/test_folder_inputs.py): one line naming what cannot
    be made and every required input with the shape the config implies."""
    from normexport.load import examples

    monkeypatch.setattr(examples, "_from_docs", lambda *a, **k: None)
    monkeypatch.setattr(examples, "_role", lambda documented: None)
    _standin_off(monkeypatch)  # the derived inputs' refusal alone, not a pipeline run (tests/test_denoiser_alone.py)
    real_make = examples._Sizes.make  # `sample` is made like the latents since issue 28: made unmakeable here
    monkeypatch.setattr(examples._Sizes, "make", lambda self, p, *a, **k: None if p == "sample" else real_make(self, p, *a, **k))
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                          block_out_channels=(8, 16), norm_num_groups=4, cross_attention_dim=16,
                                          down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                          up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=2)
    unet.save_pretrained(tmp_path / "unet")
    code, out, err = cli("convert", tmp_path / "unet", "-o", tmp_path / "u.onnx")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "cannot make example inputs for sample" in err
    for part in ("sample [2x4x8x8]", "timestep [2]", "encoder_hidden_states [2x6x16]", "--input NAME:DIMS",
                 "--input sample:2x4x8x8", "--inputs inputs.pt", "normexport.capture(model"):
        assert part in err, err
    assert not (tmp_path / "u.onnx").exists()


# ---- a class that keeps modules in float32 ------------------------------------------------------------
def test_keep_in_fp32_modules_load_and_stay_float32(cli, tmp_path):
    """WanTransformer3DModel (_keep_in_fp32_modules: time embedder, scale_shift_table, norms) loads
    from a folder without accelerate, and a float16 export keeps those parameters in float32 (as
    from_pretrained(torch_dtype=float16) does) while the rest is float16; parity passes."""
    from normexport.load.resolve import cast, keep_fp32

    folder = tmp_path / "wan"
    _tiny("wan").save_pretrained(folder)
    loaded = normexport.load(str(folder))
    keep = keep_fp32(loaded.module)
    assert "time_embedder" in keep and "scale_shift_table" in keep
    half = cast(loaded.module, torch.float16).inner
    dtypes = {n: p.dtype for n, p in half.named_parameters()}
    kept = [n for n in dtypes if any(k in n.split(".") for k in keep)]
    assert kept and all(dtypes[n] == torch.float32 for n in kept)
    assert any(d == torch.float16 for n, d in dtypes.items() if n not in kept)
    out = tmp_path / "wan16.onnx"
    stdout, rep, errs = _convert(cli, folder, out, "--dtype", "float16")
    assert "PASSED" in stdout
    inits = {t.name: t.data_type for t in onnx.load(str(out), load_external_data=False).graph.initializer}
    assert any(dt == onnx.TensorProto.FLOAT and "time_embedder" in n for n, dt in inits.items()), \
        [n for n in inits if "time" in n]


def test_example_inputs_by_annotation():
    """timestep: integer when annotated LongTensor, float in [0, 1] otherwise (flow matching)."""
    class M(torch.nn.Module):
        config = {"in_channels": 3, "sample_size": 4, "cross_attention_dim": 8}

        def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states=None):
            return hidden_states

    kw = examples.example_kwargs(M(), "diffusers")
    assert kw["hidden_states"].shape == (2, 3, 4, 4) and kw["timestep"].is_floating_point()
    assert kw["encoder_hidden_states"].shape == (2, 6, 8)
    M.forward.__annotations__["timestep"] = torch.LongTensor
    assert not examples.example_kwargs(M(), "diffusers")["timestep"].is_floating_point()


# ---- a forward that loops over the batch: static batch, said on the terminal -------------------------
def test_mochi_folder_static_batch_with_note(cli, tmp_path):
    """MochiTransformer3DModel's attention processor loops over the batch in python: no exporter keeps
    the batch dynamic (torch.export infers it static, the TorchScript tracer baked it and the file
    failed at batch 3). The file is exported with a static batch by the dynamo exporter, the note
    says so with the --input flags for another batch size, and the RMSNorms without weight and
    without a size (diffusers RMSNorm(0, eps, elementwise_affine=False)) are not swapped with an
    empty scale but left to the rewriter, which fuses them. Norm count: one per call of a leaf
    RMSNorm module (MochiModulatedRMSNorm wraps one)."""
    torch.manual_seed(0)
    folder = tmp_path / "mochi"
    diffusers.MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=1,
                                      pooled_projection_dim=16, in_channels=4, text_embed_dim=16, time_embed_dim=16,
                                      max_sequence_length=6).eval().save_pretrained(folder)
    loaded = normexport.load(str(folder))
    assert not loaded.dynamic_axes
    out = tmp_path / "mochi.onnx"
    stdout, rep, errs = _convert(cli, folder, out)
    assert rep["exporter"]["name"] == "dynamo", rep["exporter"]
    assert "static batch" in stdout and "--input hidden_states:Bx4x2x4x4" in stdout
    calls = Counter()
    handles = [m.register_forward_hook(lambda *a: calls.update(["rms"])) for m in loaded.module.modules()
               if type(m).__name__.endswith("RMSNorm") and not list(m.children())]
    with torch.no_grad():
        loaded.module(*loaded.example_inputs)
    for h in handles:
        h.remove()
    ops = _ops(out)
    assert calls["rms"] == 9 and ops["RMSNorm"] == calls["rms"], (ops, calls)
    assert ops["AdaLNZero"] == 1 and ops["ReduceMean"] == 0, ops  # norm_out (AdaLayerNormContinuous)
    assert max(errs) < 1e-5
    skipped = [e for e in rep["prepare"] if "size 0" in e["reason"]]
    assert skipped and all(e["action"] == "skipped" for e in skipped)


def _standin_off(monkeypatch):
    """No pipeline class drives the folder (normexport/load/standin.py): its refusal stands."""
    from normexport.load import standin

    def record(*a, **k):
        raise standin.StandInError("switched off")

    monkeypatch.setattr(standin, "record", record)
