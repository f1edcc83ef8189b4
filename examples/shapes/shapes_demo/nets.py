"""The project's model: a small convnet whose head is an ``nn.LazyLinear`` (it learns its
input size on the first forward pass, so nobody computes the flattened size by hand)."""

from __future__ import annotations

from torch import nn


def make_net(in_channels: int, num_classes: int, hidden: int = 32, dropout: float = 0.0):
    """ampsweep passes ``in_channels`` and ``num_classes`` (read from the data), because the
    signature asks for them; ``hidden`` and ``dropout`` are settings: model.hidden=64."""
    return nn.Sequential(
        nn.Conv2d(in_channels, hidden, 3, padding=1),
        nn.BatchNorm2d(hidden),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Conv2d(hidden, 2 * hidden, 3, padding=1),
        nn.BatchNorm2d(2 * hidden),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.LazyLinear(num_classes),
    )
