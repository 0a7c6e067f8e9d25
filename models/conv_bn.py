"""A Conv-BN stage: Conv2d+BN+ReLU, grouped Conv2d+BN, ConvTranspose2d+BN+ReLU, global average
pool, Linear+BN1d. Running statistics are randomised (mean ~ N(0, 0.5²), var ~ U(0.5, 2))."""

from __future__ import annotations

import torch
from torch import nn

from ._common import randn, randomize_


class ConvBNStage(nn.Module):
    input_names = ["x"]
    output_names = ["y"]
    dynamic_axes = {"x": [0]}

    def __init__(self, in_ch: int = 3, ch: int = 16, groups: int = 4, classes: int = 10, size: int = 16,
                 seed: int = 0):
        super().__init__()
        self.in_ch, self.size, self.seed = in_ch, size, seed
        self.conv1 = nn.Conv2d(in_ch, ch, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(ch, 2 * ch, 3, stride=2, padding=1, groups=groups, bias=True)
        self.bn2 = nn.BatchNorm2d(2 * ch)
        self.deconv = nn.ConvTranspose2d(2 * ch, ch, 2, stride=2, bias=True)
        self.bn3 = nn.BatchNorm2d(ch)
        self.relu3 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(ch, classes)
        self.bn4 = nn.BatchNorm1d(classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.bn2(self.conv2(x))
        x = self.relu3(self.bn3(self.deconv(x)))
        x = torch.flatten(self.pool(x), 1)
        return self.bn4(self.fc(x))

    def example_inputs(self, batch: int = 2, seq: int | None = None) -> tuple[torch.Tensor, ...]:
        dtype = next(self.parameters()).dtype
        return (randn((batch, self.in_ch, self.size, self.size), self.seed + 401, dtype),)


def tiny(seed: int = 0, **kwargs) -> ConvBNStage:
    m = ConvBNStage(seed=seed, **kwargs)
    randomize_(m, seed)
    return m.eval()
