"""A video VAE's frame loop cut at its children (normexport/pipeline/stepping.py, issue 46 item 8):
AutoencoderKLWan's decode runs its decoder once per latent frame with a causal cache list
(`feat_cache`) that each call updates. Exported whole, the loop was traced unrolled (minutes, the
frame count fixed in the file); cut, each kind of decoder call is one file and diffusers' own loop
runs at load. Real class, tiny config, random weights; references in float64.

Planted (each failed here once): the proxy writing zeros back into the cache (convert's check of the
composed decode: 1.28 from float64, limit 2e-6, FAIL: no entry); not writing it back at all (the second
frame's call is of no exported kind: FAIL); a step's `after` naming an output the file lacks (the
manifest refused)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")


def _vae():
    torch.manual_seed(0)
    return diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[True],
                                      latents_mean=[0.0] * 4, latents_std=[1.0] * 4).eval()


def _err(got, want):
    return float(np.abs(got.double().numpy() - want.double().numpy()).max())


def test_a_video_vae_frame_loop_is_cut_at_its_children(tmp_path):
    from normexport.cli import build_parser
    from normexport.errors import UsageError
    from normexport.pipeline import exporting
    from normexport.pipeline import manifest as manifest_mod
    from normexport.pipeline.recording import Slot
    from normexport.pipeline.runtime import OrtComponent

    vae = _vae()
    src = tmp_path / "src"
    vae.save_pretrained(src / "vae")
    g = torch.Generator().manual_seed(1)
    z = torch.randn(2, 4, 5, 8, 8, generator=g)  # the recorded call: CFG batch 2, 5 latent frames
    slot = Slot(name="vae_decoder", component="vae", method="decode", kwargs={"latent_sample": z, "return_dict": False},
                shapes=[{"latent_sample": [2, 4, 5, 8, 8]}, {"latent_sample": [1, 4, 5, 8, 8]},
                        {"latent_sample": [1, 4, 5, 12, 12]}],
                renames={"z": "latent_sample"}, single=((), {"latent_sample": z[:1], "return_dict": False}), at_size=2)
    args = build_parser().parse_args(["convert", str(src), "-o", str(tmp_path / "out") + "/"])
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    entry = exporting._export_slot(args, src, slot, tmp)
    assert entry is not None
    # the decoder's three kinds of call (first frame, second, every later one) and the conv before the loop
    assert {c: len(k) for c, k in entry["steps"].items()} == {"post_quant_conv": 1, "decoder": 3}, entry["steps"]
    assert entry["parity"]["passed"] and entry["parity"]["max_abs_err"] <= entry["parity"]["limit"]
    for kind in entry["steps"]["decoder"]:
        assert kind["inputs"]["x"]["dynamic"] == [0, 3, 4] and kind["inputs"]["x"]["shape"][2] == 1, kind["inputs"]["x"]
        assert kind["parity"]["passed"]
    # before the loop: the frames too (the loop's length is the call's)
    assert entry["steps"]["post_quant_conv"][0]["inputs"]["x"]["dynamic"] == [0, 2, 3, 4]

    manifest = {"format": manifest_mod.FORMAT, "pipeline": "WanPipeline", "slots": {"vae_decoder": entry}}
    manifest_mod.write(tmp, manifest)
    assert manifest_mod.read(tmp)["slots"]["vae_decoder"]["steps"]
    loaded = OrtComponent(tmp, "vae", ["diffusers", "AutoencoderKLWan"], {"decode": [("vae_decoder", entry)]})
    wide = copy.deepcopy(vae).double()
    # other batches, frame counts and sizes than recorded: diffusers' loop runs the files frame by frame
    for shape in [(2, 4, 5, 8, 8), (3, 4, 9, 12, 12), (1, 4, 2, 8, 16)]:
        x = torch.randn(*shape, generator=g)
        with torch.no_grad():
            got, eager, ref = loaded.decode(x).sample, vae.decode(x).sample, wide.decode(x.double()).sample
        assert got.shape == eager.shape == (shape[0], 3, 2 * shape[2] - 1, 2 * shape[3], 2 * shape[4])
        # the composed check's rules (stepped_export.verify): 2x eager's distance from float64, else float32's
        # tolerance against eager (a fault of the loop at load is of the signal's size: 0.02 when planted)
        err, eager_err, vs_eager = _err(got, ref), _err(eager, ref), _err(got, eager)
        assert err <= 2 * eager_err or vs_eager <= 1e-5 * float(ref.abs().max()) + 1e-6, (shape, err, eager_err, vs_eager)

    # damaged: a step's list entry names an output its file does not have
    bad = json.loads(json.dumps(manifest))
    bad["slots"]["vae_decoder"]["steps"]["decoder"][1]["after"]["feat_cache"][0] = {"tensor": "nothere.next"}
    manifest_mod.write(tmp, bad)
    with pytest.raises(UsageError, match="keeps a list entry"):
        manifest_mod.read(tmp)


def test_a_loop_of_one_step_is_exported_whole():
    """An image through a video VAE (one latent frame: QwenImage's): no loop to cut (plan None)."""
    from normexport.pipeline import stepping

    vae = _vae()
    assert stepping.may_loop(vae)
    assert stepping.plan(vae, "decode", (), {"z": torch.randn(1, 4, 1, 8, 8)}, []) is None
