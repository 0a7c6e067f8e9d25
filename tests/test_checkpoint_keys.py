"""A folder whose config.json disagrees with its checkpoint (issue 47 item 3, docs/design.md §14): one
layer more than the weights hold (the library would initialise it at random), one fewer (the
checkpoint's last layer dropped), a vocabulary / hidden size of another shape: one line, exit 2,
nothing written; the library's ignore lists (tied weights, T5EncoderModel's decoder) respected;
`--allow-random-weights` loads it anyway and says so. Real classes of both libraries, tiny configs,
random weights, saved with save_pretrained in one file and sharded; a pipeline folder's components."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from normexport.errors import UsageError
from normexport.load import checkpoint_keys
from normexport.load.pretrained import load_module

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

from _pipelines import build  # noqa: E402

SHARD = "4KB"  # a dozen shards and model.safetensors.index.json for these sizes


def _llama(**kw):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, **kw)).eval()


def _vae():
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                   up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                                   layers_per_block=1).eval()


def _edit(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{(model, sharded): folder} of the models as saved (config and checkpoint agree)."""
    d = tmp_path_factory.mktemp("checkpoint_keys")
    out = {}
    for name, model in (("llama", _llama()), ("vae", _vae())):
        for sharded in (False, True):
            folder = d / f"{name}{'_sharded' if sharded else ''}"
            model.save_pretrained(folder, **({"max_shard_size": SHARD} if sharded else {}))
            assert (folder / ("model.safetensors.index.json" if name == "llama" else
                              "diffusion_pytorch_model.safetensors.index.json")).is_file() == sharded
            out[name, sharded] = folder
    return out


def _copy(saved, key, tmp_path, **changes):
    folder = tmp_path / saved[key].name
    shutil.copytree(saved[key], folder)
    return _edit(folder, **changes)


LLAMA_EDITS = {  # config change -> (what the line says, the first key it names)
    "more layers": ({"num_hidden_layers": 3}, "9 parameter(s) of the model config.json builds are not in the checkpoint",
                    "model.layers.2.input_layernorm.weight"),
    "fewer layers": ({"num_hidden_layers": 1}, "9 checkpoint tensor(s) the model does not use",
                     "model.layers.1.input_layernorm.weight"),
    "vocabulary": ({"vocab_size": 80}, "2 checkpoint tensor(s) of another shape than the model's",
                   "lm_head.weight: checkpoint 64x16, model 80x16"),
    "hidden size": ({"hidden_size": 32}, "21 checkpoint tensor(s) of another shape than the model's",
                    "lm_head.weight: checkpoint 64x16, model 64x32"),
}


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("edit", list(LLAMA_EDITS))
def test_llama_config_that_disagrees_is_one_line(saved, tmp_path, edit, sharded):
    changes, says, key = LLAMA_EDITS[edit]
    if "num_hidden_layers" in changes:
        changes = {**changes, "layer_types": ["full_attention"] * changes["num_hidden_layers"]}
    folder = _copy(saved, ("llama", sharded), tmp_path, **changes)
    with pytest.raises(UsageError) as e:
        load_module(folder)
    msg = str(e.value)
    assert "\n" not in msg and says in msg and key in msg and "--allow-random-weights" in msg, msg
    assert msg.startswith(f"'{folder}' (LlamaForCausalLM): config.json and the checkpoint disagree"), msg


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_folders_that_agree_load_as_before(saved, sharded, tmp_path):
    """No false alarm: the saved folders, a tied LM head the checkpoint does not hold
    (`_tied_weights_keys`), and a T5EncoderModel from a whole T5 checkpoint whose decoder the class
    lists in `_keys_to_ignore_on_load_unexpected`."""
    for name in ("llama", "vae"):
        model, library = load_module(saved[name, sharded])
        assert library == ("transformers" if name == "llama" else "diffusers")
    tied = _llama(tie_word_embeddings=True)
    tied.save_pretrained(tmp_path / "tied", **({"max_shard_size": SHARD} if sharded else {}))
    model, _ = load_module(tmp_path / "tied")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(model.lm_head.weight, tied.lm_head.weight, rtol=0, atol=0)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=16, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)).eval()
    t5.save_pretrained(tmp_path / "t5")
    _edit(tmp_path / "t5", architectures=["T5EncoderModel"])
    encoder, _ = load_module(tmp_path / "t5")
    assert type(encoder).__name__ == "T5EncoderModel"
    torch.testing.assert_close(encoder.shared.weight, t5.shared.weight, rtol=0, atol=0)


VAE_EDITS = {
    "more layers": ({"layers_per_block": 2}, "32 parameter(s) of the model config.json builds are not in the checkpoint",
                    "decoder.up_blocks.0.resnets.2.conv1.bias"),
    "fewer blocks": ({"block_out_channels": [8], "down_block_types": ["DownEncoderBlock2D"],
                      "up_block_types": ["UpDecoderBlock2D"]}, "32 checkpoint tensor(s) the model does not use",
                     "decoder.up_blocks.0.upsamplers.0.conv.bias"),
    "latent channels": ({"latent_channels": 8}, "7 checkpoint tensor(s) of another shape than the model's",
                        "decoder.conv_in.weight: checkpoint 16x4x3x3, model 16x8x3x3"),
}


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("edit", list(VAE_EDITS))
def test_diffusers_config_that_disagrees_is_one_line(saved, tmp_path, edit, sharded):
    changes, says, key = VAE_EDITS[edit]
    folder = _copy(saved, ("vae", sharded), tmp_path, **changes)
    with pytest.raises(UsageError) as e:
        load_module(folder)
    msg = str(e.value)
    assert "\n" not in msg and says in msg and key in msg, msg
    assert msg.startswith(f"'{folder}' (AutoencoderKL): config.json and the checkpoint disagree"), msg


def test_cli_refuses_in_one_line_and_writes_nothing(saved, tmp_path, cli):
    for key, changes in ((("llama", True), {"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3}),
                         (("vae", False), {"layers_per_block": 2})):
        folder = _copy(saved, key, tmp_path, **changes)
        out = tmp_path / f"{folder.name}.onnx"
        code, stdout, err = cli("convert", folder, "-o", out, "--no-check")
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("normexport: error: ") and "disagree" in lines[0], err
        assert "Traceback" not in err and not out.exists() and list(tmp_path.glob("*.onnx*")) == []


def test_allow_random_weights_loads_and_says_so(saved, tmp_path, cli):
    """The opt-out: convert goes on with the missing layer random, and stderr says what is random."""
    folder = _copy(saved, ("llama", False), tmp_path, num_hidden_layers=3, layer_types=["full_attention"] * 3)
    out = tmp_path / "more.onnx"
    code, stdout, err = cli("convert", folder, "-o", out, "--no-check", "--task", "text-generation",
                            "--allow-random-weights")
    assert code == 0, err
    assert out.is_file()
    said = [line for line in err.splitlines() if "--allow-random-weights" in line]
    assert len(said) == 1 and "9 parameter(s)" in said[0] and "random values" in said[0], err
    # the flag belongs to check too; given where everything matched, it says so
    with checkpoint_keys.allowing():
        load_module(saved["llama", False])
    from normexport.cli import build_parser

    assert build_parser().parse_args(["check", "x.onnx", "--reference", "m", "--allow-random-weights"]).allow_random_weights
    assert not checkpoint_keys.allowed()  # left as it was


def test_pipeline_components_are_judged(tmp_path, capsys, cli):
    """A pipeline folder: its CLIP text encoder (transformers, re-saved sharded) with one layer more
    in config.json, then its UNet (diffusers) with one block of layers more: one line naming the
    component; the folder as saved builds."""
    from normexport.load.pipeline import build as build_pipeline

    folder = build("sd", tmp_path)
    index = json.loads((folder / "model_index.json").read_text())
    pipe = build_pipeline(folder, index)  # agrees: builds
    encoder = tmp_path / "sd" / "text_encoder"
    (encoder / "model.safetensors").unlink()
    pipe.text_encoder.save_pretrained(encoder, max_shard_size="2KB")
    assert (encoder / "model.safetensors.index.json").is_file()
    del pipe
    build_pipeline(folder, index)  # sharded, still agrees
    _edit(encoder, num_hidden_layers=2)
    with pytest.raises(UsageError) as e:
        build_pipeline(folder, index)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"the text_encoder of StableDiffusionPipeline ('{encoder}', "
                                              "CLIPTextModel): config.json and the checkpoint disagree"), msg
    assert "encoder.layers.1.layer_norm1.bias" in msg and "not in the checkpoint" in msg, msg
    _edit(encoder, num_hidden_layers=1)
    _edit(folder / "unet", layers_per_block=2)
    with pytest.raises(UsageError) as e:
        build_pipeline(folder, index)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the unet of StableDiffusionPipeline") and "not in the checkpoint" in msg
    capsys.readouterr()  # the progress bars of the re-save above
    code, _, err = cli("convert", folder, "-o", tmp_path / "out", "--no-check")  # the command: one line, no folder
    assert code == 2 and len(err.strip().splitlines()) == 1 and "the unet of StableDiffusionPipeline" in err, err
    assert not (tmp_path / "out").exists()
    with checkpoint_keys.allowing():
        pipe = build_pipeline(folder, index)
    assert len(pipe.unet.down_blocks[0].resnets) == 2
    err = capsys.readouterr().err
    assert "the unet of StableDiffusionPipeline" in err and "loaded although" in err, err
