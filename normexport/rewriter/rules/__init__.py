"""Graph rewrite rules, one per module (pattern / check / rewrite, onnxscript rewriter API).

Each module listed here defines
    RULES: list[onnxscript.rewriter.pattern.RewriteRule]   (each rule has a unique `name`)
    TARGETS: frozenset[str]  subset of {"trt", "ort", "onnx"} the rules run for
and has its test beside the others in tests/rewrite/test_<module>.py.
Optional hooks the driver honours when a module defines them:
    rules_for(target) -> list[RewriteRule]   the rules for that target (default: RULES)
    required_opset(target) -> int            default-domain opset the replacements need; the
                                             driver upgrades the model (verified) before applying
The caller turns modules off by name (rewriter/switches.py: `--no-residual-fusion`, `--no-fuse
MODULE`); the report's module status then says "off (the flag)".
A module listed here but not present is reported as "not installed" and skipped.
The driver (normexport.rewriter.rewrite) applies them in this order.
"""

RULE_MODULES = (
    "bn_fold",  # Conv / ConvTranspose / Gemm / MatMul(+Add) + BatchNormalization -> folded weights
    "bn_affine",  # a BatchNormalization left over -> Mul + Add (where that is faster)
    "layer_norm",  # decomposed LayerNorm -> LayerNormalization
    "layer_norm_one_pass",  # E[x²] − E[x]² LayerNorm (tf2onnx: Flax / Keras) -> LayerNormalization, any axes
    "rms_norm",  # decomposed RMSNorm -> normexport::RMSNorm / RMSNormalization
    "skip_rms_norm",  # ort: residual Add + RMSNormalization -> SkipSimplifiedLayerNormalization (large H)
    "adaln",  # LayerNormalization -> Mul(1 + scale) -> Add(shift) -> normexport::AdaLNZero
    "adaln_continuous",  # (1 + scale) then unsqueeze / reshape, fp32 Casts around the LN -> AdaLNZero
    "adaln_seq_first",  # the modulation broadcast over x's leading dims ([S, B, H] models) -> AdaLNZero where it fits
    "skip_rms_norm_trt",  # trt: residual Add + normexport::RMSNorm -> normexport::SkipRMSNorm (Y, Sum)
    "gated_adaln",  # trt: x + gate * update, then normexport::AdaLNZero -> normexport::GatedAdaLNZero (Y, Sum)
)
