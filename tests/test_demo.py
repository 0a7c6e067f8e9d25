"""`normexport demo`: every bundled reference model is converted, checked and written (issue 2)."""

import onnx

from normexport import ops
from normexport.demo import DEMO_MODELS


def test_demo_writes_checked_models(cli, tmp_path):
    code, out, err = cli("demo", "--out", tmp_path / "demo")
    assert code == 0, err
    files = sorted((tmp_path / "demo").glob("*.onnx"))
    assert [f.stem for f in files] == sorted(name for name, _ in DEMO_MODELS)
    assert len(files) >= 4
    for f in files:
        onnx.checker.check_model(str(f), full_check=True)
    lines = out.strip().splitlines()
    assert lines[0].split()[:2] == ["model", "ops"]
    assert lines[-1].startswith(f"{len(DEMO_MODELS)}/{len(DEMO_MODELS)} models passed")
    rows = {line.split()[0]: line for line in lines[1:-1]}
    # two norms each, the second reading the residual sum: fused with its Add (--target trt)
    assert "1 RMSNorm, 1 SkipRMSNorm" in rows["llama"] and "1 AdaLNZero, 1 GatedAdaLNZero" in rows["dit"], rows
    assert "2 LayerNormalization" in rows["bert"] and "4 BN folded" in rows["conv_bn"]
    custom = {f.stem: [n.op_type for n in ops.custom_nodes(onnx.load(str(f)))] for f in files}
    assert custom["llama"] == ["RMSNorm", "SkipRMSNorm"] and custom["dit"] == ["AdaLNZero", "GatedAdaLNZero"]
    assert not any(n.op_type == "BatchNormalization" for n in onnx.load(str(tmp_path / "demo" / "conv_bn.onnx")).graph.node)


def test_demo_unwritable_out(cli, tmp_path):
    (tmp_path / "file").write_text("x")
    code, out, err = cli("demo", "--out", tmp_path / "file" / "sub")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--out" in err
