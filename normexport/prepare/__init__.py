"""normexport.prepare: torch-side preparation before export (docs/design.md §1).

    fold_bn  BatchNorm folded into the conv / linear before it (fold_batchnorm)
    swap     recognised norm modules swapped for normexport modules, each swap kept only when
             the replacement takes the calls seen in an example forward and matches on random
             input and on those inputs, else left to the rewriter with the reason (prepare);
             the driver. Its pieces: recognisers/ (one module per norm kind, an ordered
             registry), calls (capture_calls), signature, numeric (rel_err, REL_TOL)
    nn       the nn.Modules that call the normexport custom ops (RMSNorm, GatedRMSNorm, AdaLNZero)
    implementations
             transformers MoE experts / attention switched to implementations the exporters take
             (exportable_implementations), checked against transformers' eager ones
    complex  complex arithmetic (torch.polar, view_as_complex, complex tables and products, ...)
             carried as real (re, im) pairs for any model, verified on the model's example
             inputs, else left alone with the reason (lower_complex)

The package is callable: `normexport.prepare(module)` is `normexport.prepare.prepare(module)`.
"""

from __future__ import annotations

import sys
import types

from .fold_bn import fold_batchnorm
from .swap import prepare


class _CallableModule(types.ModuleType):
    def __call__(self, module, *args, **kwargs):
        return prepare(module, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["fold_batchnorm", "prepare"]
