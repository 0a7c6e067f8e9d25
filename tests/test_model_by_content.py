"""Model files are recognised by content, not extension (docs/design.md §9, issue 28): a TorchScript
archive named `model.jit` (as silero ships), `.ts` or `.torchscript` (as ultralytics writes), a
torch.export archive under any name, converted with norms fused and parity passing; a file that is
neither (an ONNX file, safetensors weights, JSON, a zip of other things) is refused in one line
(exit 2) that says what it is."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch

from normexport.load import sniff


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(self.proj(x) + x)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("by_content")
    torch.manual_seed(0)
    block = Block().eval()
    with torch.no_grad():
        block.norm.weight.add_(torch.randn(16) * 0.2)
    x = torch.randn(2, 5, 16)
    torch.jit.save(torch.jit.trace(block, (x,)), str(d / "model.jit"))
    torch.export.save(torch.export.export(block, (x,)), str(d / "exported.bin"))
    torch.save(block.state_dict(), str(d / "weights.pt"))
    torch.onnx.export(block, (x,), str(d / "block.onnx"), dynamo=False)
    (d / "config.json").write_text(json.dumps({"hidden_size": 16}))
    with zipfile.ZipFile(d / "other.zip", "w") as z:
        z.writestr("readme.txt", "hello")
    return d


def test_kinds_from_the_real_writers(files):
    assert sniff.kind_of(files / "model.jit")[0] == sniff.TORCHSCRIPT
    assert sniff.kind_of(files / "exported.bin")[0] == sniff.EXPORTED
    assert sniff.kind_of(files / "weights.pt")[0] == sniff.TORCH_SAVE
    assert sniff.kind_of(files / "block.onnx")[1] == "an ONNX model"
    assert sniff.kind_of(files / "config.json")[1] == "a JSON / text file"
    assert "zip archive" in sniff.kind_of(files / "other.zip")[1]


@pytest.mark.parametrize("name", ["model.jit", "model.ts", "model.torchscript", "exported.bin"])
def test_converts_whatever_the_extension(cli, files, tmp_path, name):
    src = files / ("exported.bin" if name == "exported.bin" else "model.jit")
    path = tmp_path / name
    path.write_bytes(src.read_bytes())
    out = tmp_path / "m.onnx"
    extra = [] if name == "exported.bin" else ["--input", "x:2x5x16"]
    code, stdout, err = cli("convert", path, "-o", out, *extra)
    assert code == 0, (stdout, err)
    assert "1 LayerNormalization" in stdout and "PASSED" in stdout, stdout
    assert out.is_file()


@pytest.mark.parametrize("name, what", [("block.onnx", "an ONNX model"), ("config.json", "JSON"),
                                        ("other.zip", "zip archive")])
def test_a_file_that_is_no_model_is_refused_naming_what_it_is(cli, files, tmp_path, name, what):
    code, stdout, err = cli("convert", files / name, "-o", tmp_path / "o.onnx")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert what in lines[0] and "TorchScript" in lines[0], lines[0]
    assert not list(tmp_path.glob("*.onnx*"))
