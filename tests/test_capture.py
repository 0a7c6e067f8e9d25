"""`normexport.capture` + `convert --inputs` (docs/design.md §9): the inputs of a real diffusers pipeline
call (ChromaPipeline built from components: tiny transformer, tiny VAE, scheduler; prompt
embeddings given, so no tokenizer is needed offline) recorded and converted."""

from __future__ import annotations

import os

import pytest
import torch

import normexport
import normexport.errors

from _new_families import convert, norm_calls, ops, tiny_chroma

diffusers = pytest.importorskip("diffusers")


def _pipeline(transformer):
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(in_channels=3, out_channels=3, latent_channels=2, block_out_channels=(8,),
                                  down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                                  norm_num_groups=4, layers_per_block=1)
    return diffusers.ChromaPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                                    text_encoder=None, tokenizer=None, transformer=transformer)


def _run(pipe, steps=1):
    g = torch.Generator().manual_seed(3)
    emb, neg = torch.randn(1, 6, 24, generator=g), torch.randn(1, 6, 24, generator=g)
    return pipe(prompt_embeds=emb, negative_prompt_embeds=neg, prompt_attention_mask=torch.ones(1, 6),
                negative_prompt_attention_mask=torch.ones(1, 6), height=8, width=8, num_inference_steps=steps,
                guidance_scale=1.0, output_type="latent")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    d = tmp_path_factory.mktemp("capture")
    transformer = tiny_chroma()
    transformer.save_pretrained(d / "chroma")
    pipe = _pipeline(transformer)
    calls = []
    transformer.register_forward_pre_hook(lambda m, a, k: calls.append(dict(k)), with_kwargs=True)
    with normexport.capture(pipe.transformer, d / "inputs.pt", stop=True) as cap:
        _run(pipe)
    return d, cap, calls


def test_capture_records_the_first_call_of_a_pipeline(recorded):
    d, cap, calls = recorded
    args, kwargs = torch.load(d / "inputs.pt", weights_only=True)
    assert len(calls) == 1  # stop=True: the pipeline ended after the first transformer call
    assert args == () and set(kwargs) == set(calls[0])
    for k, v in calls[0].items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(kwargs[k], v), k
        else:
            assert kwargs[k] == v, k
    assert kwargs["hidden_states"].shape == (1, 16, 8) and kwargs["img_ids"].shape == (16, 3)
    assert not [p for p in os.listdir(d) if p.endswith(".tmp")]  # the temp file was renamed


def test_convert_with_the_recorded_inputs(cli, recorded, tmp_path):
    """The recorded call goes into the forward by keyword (each tensor to its parameter), the plain
    values are fixed in the file and said; norms fused, parity passing."""
    d, cap, _ = recorded
    out = tmp_path / "c.onnx"
    stdout, rep, errs = convert(cli, d / "chroma", out, "--inputs", d / "inputs.pt")
    names = [i["name"] for i in rep["inputs"]]  # forward order, whatever order the pipeline passed them in
    assert names == ["hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids", "attention_mask"], names
    assert rep["inputs"][0]["shape"] == [1, 16, 8]
    assert "fixed in the file (python values of the call, not ONNX inputs): joint_attention_kwargs={}, return_dict=False" \
        in stdout, stdout
    m = tiny_chroma()
    args, kwargs = torch.load(d / "inputs.pt", weights_only=True)
    calls = norm_calls(_KwargsCall(m, kwargs), ())
    got = ops(out)
    assert got["RMSNorm"] == calls["rms"] and got["AdaLNZero"] + got["LayerNormalization"] == calls["ln"], (got, calls)
    assert max(errs) < 1e-5, errs
    code, stdout, err = cli("check", out, "--reference", d / "chroma", "--inputs", d / "inputs.pt")
    assert code == 0 and f"(--inputs {d / 'inputs.pt'})" in stdout and "hidden_states: 1x16x8" in stdout, (stdout, err)


class _KwargsCall(torch.nn.Module):
    def __init__(self, inner, kwargs):
        super().__init__()
        self.inner, self.kwargs = inner, kwargs

    def forward(self):
        return self.inner(**self.kwargs)


def test_capture_refuses_what_weights_only_cannot_read(tmp_path):
    class Odd:
        pass

    class M(torch.nn.Module):
        def forward(self, x, extra=None):
            return x

    m = M()
    with pytest.raises(normexport.errors.UsageError, match="extra: Odd"):
        with normexport.capture(m, tmp_path / "i.pt", quiet=True):
            m(torch.ones(2), extra=Odd())
    assert not list(tmp_path.iterdir())  # nothing written, no temp file left
    with pytest.raises(RuntimeError, match="was not called"):
        with normexport.capture(m, tmp_path / "i.pt", quiet=True):
            pass
    assert not m._forward_pre_hooks  # the hook is gone


def test_inputs_file_errors_are_one_line(cli, tmp_path, recorded):
    d, _, _ = recorded
    torch.save({"x": torch.ones(2)}, tmp_path / "bad.pt")
    code, _, err = cli("convert", d / "chroma", "--inputs", tmp_path / "bad.pt", "-o", tmp_path / "o.onnx")
    assert code == 2 and "not (args, kwargs)" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = cli("convert", d / "chroma", "--inputs", tmp_path / "none.pt", "-o", tmp_path / "o.onnx")
    assert code == 2 and "--inputs file not found" in err and "normexport.capture" in err, err
    assert not (tmp_path / "o.onnx").exists()


def test_capture_keeps_the_first_of_several_calls(tmp_path):
    """Without stop, the pipeline runs all its steps; the file holds the first call (its timestep),
    not a later one, and the module has no hook left."""
    transformer = tiny_chroma()
    pipe = _pipeline(transformer)
    steps = []
    handle = transformer.register_forward_pre_hook(lambda m, a, k: steps.append(k["timestep"].clone()),
                                                   with_kwargs=True)
    with normexport.capture(transformer, tmp_path / "i.pt", quiet=True):
        _run(pipe, steps=2)
    handle.remove()
    assert len(steps) == 2 and not torch.equal(steps[0], steps[1])
    _, kwargs = torch.load(tmp_path / "i.pt", weights_only=True)
    assert torch.equal(kwargs["timestep"], steps[0])
    assert not transformer._forward_pre_hooks
