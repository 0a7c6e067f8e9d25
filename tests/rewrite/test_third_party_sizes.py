"""`normexport rewrite` on a third-party-style ONNX file whose dynamic image dims take only some
sizes (issue 14 item 7, the PP-OCRv4 detection case): a small U-Net (Conv + BatchNorm with
non-default running stats, 5 stride-2 levels, nearest upsample + Add skips, a hand-written
LayerNorm) exported by the TorchScript-based exporter at opset 11 with dynamic N, H, W. H and W
must be multiples of 32: at other sizes an Add fails to broadcast in onnxruntime. Rewrite is
verified at the user's sizes (--input) and at sizes it finds; the CLI runs in a subprocess so that
anything onnxruntime writes to stderr is seen."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

C, LEVELS = 4, 5


class HandLayerNorm(nn.Module):
    """LayerNorm over channels written out (mean, centre, variance, sqrt, divide, scale, shift)."""

    def __init__(self, c):
        super().__init__()
        self.w = nn.Parameter(torch.randn(c) * 0.5 + 1.2)
        self.b = nn.Parameter(torch.randn(c) * 0.3)

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        d = x - x.mean(-1, keepdim=True)
        y = d / torch.sqrt((d * d).mean(-1, keepdim=True) + 1e-5) * self.w + self.b
        return y.permute(0, 3, 1, 2)


def conv_bn_relu(i, o, stride):
    bn = nn.BatchNorm2d(o)
    with torch.no_grad():  # non-default running stats and affine
        bn.running_mean.normal_(0.0, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_(1.0, 0.3)
        bn.bias.normal_(0.0, 0.3)
    return nn.Sequential(nn.Conv2d(i, o, 3, stride, 1), bn, nn.ReLU())


class TinyUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = conv_bn_relu(3, C, 1)
        self.down = nn.ModuleList(conv_bn_relu(C, C, 2) for _ in range(LEVELS))
        self.norm = HandLayerNorm(C)
        self.head = nn.Conv2d(C, 1, 1)

    def forward(self, x):
        x = self.stem(x)
        skips = []
        for down in self.down:
            skips.append(x)
            x = down(x)
        x = self.norm(x)
        for skip in reversed(skips):
            x = F.interpolate(x, scale_factor=2.0, mode="nearest") + skip
        return torch.sigmoid(self.head(x))


@pytest.fixture(scope="module")
def unet(tmp_path_factory):
    torch.manual_seed(14)
    module = TinyUNet().eval()
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # BatchNormalization kept as a node (as paddle2onnx and other tools write it)
        torch.onnx.export(module, (torch.randn(1, 3, 64, 64),), f, dynamo=False, opset_version=11,
                          do_constant_folding=False, training=torch.onnx.TrainingMode.PRESERVE,
                          input_names=["x"], output_names=["maps"],
                          dynamic_axes={"x": {0: "N", 2: "H", 3: "W"}, "maps": {0: "N", 2: "H", 3: "W"}})
    path = tmp_path_factory.mktemp("unet") / "det.onnx"
    path.write_bytes(f.getvalue())
    return module, path


def _run(path_or_model, x):
    so = ort.SessionOptions()
    so.log_severity_level = 4
    src = str(path_or_model) if not isinstance(path_or_model, onnx.ModelProto) else path_or_model.SerializeToString()
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "normexport", "rewrite", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def _ops(path):
    return [n.op_type for n in onnx.load(str(path)).graph.node]


def _x(*shape, seed=0):
    return (np.random.default_rng(seed).standard_normal(shape) * 1.3 + 0.2).astype(np.float32)


def test_the_model_takes_only_multiples_of_32(unet):
    """The premise: what the verifier used to feed (2x3x3x5) fails, 1x3x64x96 runs."""
    _, path = unet
    with pytest.raises(Exception, match="broadcast"):
        _run(path, _x(2, 3, 3, 5))
    assert _run(path, _x(1, 3, 64, 96)).shape == (1, 1, 64, 96)
    ops = _ops(path)
    assert ops.count("BatchNormalization") == LEVELS + 1 and "LayerNormalization" not in ops


def _check_rewritten(module, src, out):
    ops = _ops(out)
    assert "BatchNormalization" not in ops and ops.count("LayerNormalization") == 1, ops
    for shape in ((1, 3, 32, 64), (2, 3, 96, 64)):  # sizes neither run verified at
        x = _x(*shape, seed=1)
        with torch.no_grad():
            ref = module.double()(torch.from_numpy(x).double()).numpy()  # float64 eager: independent
            module.float()
        got, orig = _run(out, x), _run(src, x)
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max() + 1e-6, np.abs(got - ref).max()
        assert np.abs(got - orig).max() <= 1e-5 * np.abs(orig).max() + 1e-6
        assert np.ptp(ref) > 0.1  # not a saturated, constant map


def test_rewrite_at_discovered_sizes(unet, tmp_path):
    module, src = unet
    out, rep = tmp_path / "det.trt.onnx", tmp_path / "r.json"
    p = _cli(src, "-o", out, "--report", rep)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""  # nothing from onnxruntime (nor anything else) on stderr
    lines = p.stdout.splitlines()
    assert "  bn_fold/FoldConvBN: matched 6, applied 6" in lines, p.stdout
    assert "  verified at x: 2x3x64x96 (discovered: tried 1 size set(s))" in lines, p.stdout
    d = json.loads(rep.read_text())
    assert d["inputs"] == [{"name": "x", "shape": [2, 3, 64, 96], "dtype": "float"}]
    assert d["sizes"] == "discovered: tried 1 size set(s)" and d["backends"]["ort"]["maps"]["passed"]
    assert d["nodes"]["before"] > d["nodes"]["after"]
    _check_rewritten(module, src, out)


def test_rewrite_at_given_sizes(unet, tmp_path):
    module, src = unet
    out = tmp_path / "given.onnx"
    p = _cli(src, "-o", out, "--input", "x:1x3x128x96:float32")
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert "  verified at x: 1x3x128x96 (--input)" in p.stdout.splitlines(), p.stdout
    assert "applied 6" in p.stdout
    _check_rewritten(module, src, out)


@pytest.mark.parametrize("arg, words, subprocess_run", [
    ("image:1x3x64x64", "no input 'image' (its inputs: x)", False),
    ("x:1x64x64", "rank 4", False),
    ("x:1x3x60x60", "does not run at the --input sizes (x: 1x3x60x60; onnxruntime: ", True),  # ort fails here
])
def test_bad_input_is_one_line_exit_2_no_file(unet, tmp_path, capfd, arg, words, subprocess_run):
    from normexport import cli

    _, src = unet
    out = tmp_path / "o.onnx"
    if subprocess_run:
        p = _cli(src, "-o", out, "--input", arg)
        code, stderr = p.returncode, p.stderr
    else:
        code = cli.main(["rewrite", str(src), "-o", str(out), "--input", arg])
        stderr = capfd.readouterr().err
    assert code == 2 and not out.exists()
    err = stderr.splitlines()
    assert len(err) == 1 and err[0].startswith("normexport: error: ") and words in err[0], stderr
    assert "onnxruntime_src" not in err[0]
    assert not list(tmp_path.iterdir())
