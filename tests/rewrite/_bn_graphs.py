"""Shared helpers of the BatchNorm tests: randomised BNs, legacy export, onnxruntime, fp64 reference.

Tolerance (docs/design.md §7, fp32): max abs err <= 1e-5 * max|ref| + 1e-6 against the float64 reference.
Folding rounds the folded weights to float32 once more and changes the summation order, so a folded
model may exceed that where eager float32 itself comes close to it; then the test accepts
err <= 2 * (eager float32 error) + 1e-6 (the §7 "not more than 2x eager's own error" rule)."""

from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import onnx
import torch
from torch import nn

EPS_VALUES = (1e-5, 1e-3, 0.1)


def randomize_bn_(bn: nn.modules.batchnorm._BatchNorm, seed: int) -> nn.Module:
    """running_mean ~ randn, running_var ~ U(0.5, 2), weight ~ 1 + 0.5 randn, bias ~ randn."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if bn.running_mean is not None:
            bn.running_mean.copy_(torch.randn(bn.running_mean.shape, generator=g))
            bn.running_var.copy_(torch.empty(bn.running_var.shape).uniform_(0.5, 2.0, generator=g))
        if bn.weight is not None:
            bn.weight.copy_(1.0 + 0.5 * torch.randn(bn.weight.shape, generator=g))
            bn.bias.copy_(torch.randn(bn.bias.shape, generator=g))
    return bn


def randomize_(model: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed + 1000)
    for i, m in enumerate(model.modules()):
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            randomize_bn_(m, seed * 100 + i)
        elif isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                            nn.ConvTranspose3d, nn.Linear)):
            with torch.no_grad():
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) / m.weight[0].numel() ** 0.5)
                if m.bias is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    return model


class TwoConsumers(nn.Module):
    """Conv -> BN where the conv output is also read by the residual add: nothing may fold."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


def reference64(model: nn.Module, *inputs: torch.Tensor) -> np.ndarray:
    m = copy.deepcopy(model).double()
    with torch.no_grad():
        return m(*(x.double() for x in inputs)).numpy()


def eager32(model: nn.Module, *inputs: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return model(*inputs).double().numpy()


def tolerance(ref: np.ndarray) -> float:
    return 1e-5 * float(np.abs(ref).max()) + 1e-6


def max_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(np.asarray(y, dtype=np.float64) - ref).max())


def assert_parity(y: np.ndarray, ref: np.ndarray, eager_err: float, what: str = "") -> float:
    """docs/design.md §7 fp32 tolerance, or <= 2x eager float32's own error + 1e-6 (see module doc)."""
    err = max_err(y, ref)
    tol = tolerance(ref)
    assert err <= tol or err <= 2 * eager_err + 1e-6, (
        f"{what}: max abs err {err:.3g} > tol {tol:.3g} and > 2x eager err {eager_err:.3g}")
    return err


def export_legacy(model: nn.Module, inputs: tuple, opset: int = 17) -> onnx.ModelProto:
    """Legacy TorchScript exporter, BN nodes kept (PRESERVE on an eval model -> inference BN)."""
    assert not model.training
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, f, dynamo=False, do_constant_folding=False,
                          training=torch.onnx.TrainingMode.PRESERVE, opset_version=opset)
    return onnx.load_from_string(f.getvalue())


def run_ort(proto: onnx.ModelProto, *inputs) -> np.ndarray:
    import onnxruntime as ort

    p = onnx.ModelProto()
    p.CopyFrom(proto)
    p.ir_version = min(p.ir_version, 10)
    sess = ort.InferenceSession(p.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: np.asarray(x) for i, x in zip(sess.get_inputs(), inputs)}
    return sess.run(None, feeds)[0]


def op_counts(proto: onnx.ModelProto) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in proto.graph.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


def apply_rules(proto: onnx.ModelProto, rules) -> onnx.ModelProto:
    import onnxscript.rewriter as rw

    return rw.rewrite(proto, pattern_rewrite_rules=list(rules))


def rejection_reasons(proto: onnx.ModelProto, rules) -> dict[str, list[str]]:
    """rule name -> reasons of its best (failed) matches, from onnxscript's MatchingTracer."""
    import onnx_ir as ir
    from onnxscript.rewriter._basics import MatchingTracer
    from onnxscript.rewriter._rewrite_rule import RewriteRuleSet

    model = ir.serde.deserialize_model(proto)
    tracer = MatchingTracer()
    RewriteRuleSet(list(rules)).apply_to_model(model, tracer=tracer)
    return {rule.name: [m.match_result.reason for m in infos]
            for rule, infos in tracer.best_matches_map.items()}


def bn_kept(proto: onnx.ModelProto, rules, rule_name: str) -> tuple[onnx.ModelProto, list[str]]:
    """Apply `rules` to a model with one BatchNormalization, assert it is still there, and return
    (the rewritten model, the reasons `rule_name` gave for its failed matches)."""
    out = apply_rules(proto, rules)
    assert op_counts(out).get("BatchNormalization") == 1, op_counts(out)
    return out, rejection_reasons(proto, rules)[rule_name]


def infer_shapes(proto: onnx.ModelProto) -> onnx.ModelProto:
    return onnx.shape_inference.infer_shapes(proto)
