"""Three small models for the bundled digits data (8x8 images, 10 classes), each with one
numerics defect in one named module, the kinds practitioners meet in real models:

* ``overflow_net``: the module ``amplify`` multiplies its input by ``gain`` (as an attention
  score without its 1/sqrt(d) or a residual stream that keeps growing would), and a LayerNorm
  normalises it back. In fp32 and bf16 that is harmless; in fp16 the product exceeds 65504,
  fp16's largest value, and becomes inf, then NaN after the LayerNorm.
* ``flaky_net``: the layer ``fc2`` has a half-precision backward kernel that breaks from
  optimizer step ``from_step`` on (its weight gradient is NaN while every forward value is
  finite), as a CPU's bf16 kernel did for a ResNet convolution. Run in fp32, it is fine.
* ``heavy_net``: the first layer's weights are ``weight_gain`` times the usual size, with a
  LayerNorm after it so the forward pass does not care. AdamW's updates (about ``lr`` each)
  are then smaller than half a unit in the last place of a bf16 weight that large: a pure
  bf16 model rounds them away, and that layer never learns.

``ampsweep doctor`` names each module, the format limit it crosses and the config that fixes
it (``precision.keep_fp32=[amplify]``, ``precision.keep_fp32=[fc2]``, ``precision=bf16``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.nn import functional as F


class Amplify(nn.Module):
    """``x * gain``."""

    def __init__(self, gain: float):
        super().__init__()
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def overflow_net(in_channels: int, num_classes: int, hidden: int = 32, gain: float = 1e5):
    return nn.Sequential(
        OrderedDict(
            flatten=nn.Flatten(),
            fc1=nn.LazyLinear(hidden),
            amplify=Amplify(gain),
            norm=nn.LayerNorm(hidden),
            act=nn.ReLU(),
            head=nn.Linear(hidden, num_classes),
        )
    )


class _BrokenBackward(torch.autograd.Function):
    """Identity forward; NaN gradient backward when ``broken``."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, broken: bool) -> torch.Tensor:
        ctx.broken = broken
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (torch.full_like(grad, float("nan")) if ctx.broken else grad), None


class FlakyLinear(nn.Linear):
    """An ``nn.Linear`` whose weight gradient is NaN under half-precision autocast from its
    ``from_step``-th training call on (a buffer counts the calls, so a replay of the same step
    at the same weights breaks the same way)."""

    def __init__(self, in_features: int, out_features: int, from_step: int = 3):
        super().__init__(in_features, out_features)
        self.from_step = from_step
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.calls += 1
        device = x.device.type
        half = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in (
            torch.float16,
            torch.bfloat16,
        )
        broken = half and int(self.calls) >= self.from_step
        return F.linear(x, _BrokenBackward.apply(self.weight, broken), self.bias)


def flaky_net(in_channels: int, num_classes: int, hidden: int = 32, from_step: int = 3):
    return nn.Sequential(
        OrderedDict(
            flatten=nn.Flatten(),
            fc1=nn.LazyLinear(hidden),
            act=nn.ReLU(),
            fc2=FlakyLinear(hidden, hidden, from_step),
            act2=nn.ReLU(),
            head=nn.Linear(hidden, num_classes),
        )
    )


def heavy_net(
    in_channels: int, num_classes: int, hidden: int = 64, in_features: int = 64,
    weight_gain: float = 64.0,
):  # fmt: skip
    """``in_features``: the flattened input size (64 for digits' 8x8 images)."""
    fc1 = nn.Linear(in_features * in_channels, hidden)
    with torch.no_grad():
        fc1.weight.mul_(weight_gain)
    return nn.Sequential(
        OrderedDict(
            flatten=nn.Flatten(),
            fc1=fc1,
            norm=nn.LayerNorm(hidden),
            act=nn.ReLU(),
            head=nn.Linear(hidden, num_classes),
        )
    )
