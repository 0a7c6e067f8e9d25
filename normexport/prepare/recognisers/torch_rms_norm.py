"""torch.nn.RMSNorm -> normexport RMSNorm: normalized_shape of any rank (axis =
-len(normalized_shape)); eps None means torch.finfo(dtype).eps like torch; no affine means a
ones scale."""

from __future__ import annotations

import torch
from torch import nn

from .. import nn as nenn
from ..numeric import rand
from ._common import Candidate

#: a module recognised here is not offered to the recognisers after this one
FINAL = True


def recognise(m: nn.Module) -> list[Candidate]:
    if not isinstance(m, nn.RMSNorm):
        return []
    shape = tuple(m.normalized_shape)

    def build(dtype):
        eps = m.eps if m.eps is not None else torch.finfo(dtype).eps
        w = m.weight.detach() if m.weight is not None else torch.ones(shape)
        return nenn.RMSNorm(w.to(dtype), eps, axis=-len(shape))

    return [("RMSNorm", build, lambda: (rand((2, 5) + shape, 1, 0.3),),
             f"torch.nn.RMSNorm over {len(shape)} dim(s)")]
