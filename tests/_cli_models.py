"""Small models for the CLI tests (importable as `_cli_models:...` with tests/ on sys.path)."""

import torch
from torch import nn


class RMSNormBlock(nn.Module):
    """Linear -> hand-written RMSNorm (HF style) -> Linear; two inputs."""

    def __init__(self, hidden: int = 24):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.fc = nn.Linear(hidden, hidden)
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(hidden, generator=g))
        self.out = nn.Linear(hidden, hidden)
        self.eps = 1e-6

    def forward(self, x, y):
        h = self.fc(x) + y
        hf = h.float()
        h = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        return self.out(h)


def rms_block():
    return RMSNormBlock().eval()


class Evil:
    """Unpickling this writes a marker file: proves whether a pickle was ever loaded."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


class ScalarExampleInputs(RMSNormBlock):
    """Declares example inputs that are not tensors."""

    def example_inputs(self):
        return [1, 2.0]


def scalar_example_inputs():
    return ScalarExampleInputs().eval()


class PairOutput:
    """A model output type of a library normexport does not know (registered with torch's
    pytree under this module's name, as libraries do for their output classes)."""

    def __init__(self, first, second):
        self.first, self.second = first, second


torch.utils._pytree.register_pytree_node(
    PairOutput, lambda o: ([o.first, o.second], None), lambda leaves, _: PairOutput(*leaves),
    serialized_type_name="_cli_models.PairOutput")


class PairBlock(RMSNormBlock):
    """Returns a PairOutput."""

    def forward(self, x, y):
        h = super().forward(x, y)
        return PairOutput(h, h * 2)


@torch.library.custom_op("normexport_test::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    """An op neither torch.onnx exporter can translate."""
    return x.sin()


@opaque.register_fake
def _(x):
    return torch.empty_like(x)


class Unexportable(nn.Module):
    def forward(self, x):
        return opaque(x) + 1


def unexportable():
    return Unexportable().eval()
