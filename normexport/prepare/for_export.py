"""The torch-side preparation before the exporter ladder (docs/design.md §1, §9), in its order: transformers'
MoE experts / attention switched to implementations the exporters take, BatchNorm folded, complex
arithmetic lowered to real pairs, and (target trt) recognised norms swapped for the normexport
modules. Each step verifies itself and reports into `report`."""

from __future__ import annotations

import torch


def prepare_for_export(module, args: tuple, *, target: str, fold_bn: bool = True, swap_norms: bool = True,
                       report: dict):
    """(module to export, the same before the norm swaps: the TorchScript rungs trace that one).
    `report` receives "implementations", "fold_batchnorm" (fold_bn) and "prepare" (complex
    lowering, swaps)."""
    unswapped = module
    if isinstance(module, torch.jit.ScriptModule):
        # TorchScript torch's converter could not turn into a program (exporter.rungs.to_exportable):
        # its submodules are compiled (no hooks, no swaps, no folding): exported as it is, the
        # ONNX rewriter fuses its norms and folds its BatchNorms
        return module, module
    scripted = [n for n, m in module.named_modules() if isinstance(m, torch.jit.ScriptModule)] \
        if isinstance(module, torch.nn.Module) else []
    if scripted:
        # a TorchScript model inside the call adapter (--inputs with keywords): the same, and said
        # (register_forward_pre_hook, module swaps and forward replacement fail on a ScriptModule)
        name = scripted[0].removeprefix("inner.") or "the model"
        report.setdefault("prepare", []).append({
            "name": "", "kind": type(module).__name__, "action": "note", "op": None, "max_rel_err": float("nan"),
            "reason": f"{name} is TorchScript (scripted or traced): no torch-side preparation (MoE / attention "
                      "switches, BatchNorm folding, complex lowering, norm swaps); the ONNX rewriter fuses its norms "
                      "and folds its BatchNorms"})
        return module, module
    if isinstance(module, torch.nn.Module) and not isinstance(module, torch.fx.GraphModule):
        from .implementations import exportable_implementations  # MoE experts, attention (§9)

        module = exportable_implementations(module, args, report.setdefault("implementations", []), inplace=False)
        from .dense_experts import dense_experts  # a MoE whose dispatch reads counts on the host (HiDream's)

        module = dense_experts(module, args, report["implementations"])
        if fold_bn:
            from .fold_bn import fold_batchnorm

            report["fold_batchnorm"] = []
            module = fold_batchnorm(module, report["fold_batchnorm"], example_inputs=args)
        from .complex import lower_complex  # complex arithmetic as real pairs, for both exporters (§9)

        complex_report: list = []
        module = lower_complex(module, args, complex_report)
        if complex_report:
            report["prepare"] = complex_report
        unswapped = module
        if swap_norms and target == "trt":  # other targets keep standard ops (the rewriter fuses them)
            from .swap import prepare

            report["prepare"] = complex_report
            module = prepare(module, report["prepare"], example_inputs=args)
    elif isinstance(module, torch.fx.GraphModule):  # a .pt2's program: its complex ops lowered when re-traced
        from .complex import lower_complex

        complex_report = []
        module = unswapped = lower_complex(module, args, complex_report)
        if complex_report:
            report["prepare"] = complex_report
    return module, unswapped
