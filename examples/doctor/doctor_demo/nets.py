"""Five small models for the bundled digits data (8x8 images, 10 classes), each with one
numerics defect in one named module, the kinds practitioners meet in real models:

* ``overflow_net``: the module ``amplify`` multiplies its input by ``gain`` (as an attention
  score without its 1/sqrt(d) or a residual stream that keeps growing would), and a LayerNorm
  normalises it back. In fp32 and bf16 that is harmless; in fp16 the product exceeds 65504,
  fp16's largest value, and becomes inf, then NaN after the LayerNorm.
* ``flaky_net``: the layer ``fc2`` has a half-precision backward kernel that breaks from
  optimizer step ``from_step`` on (its weight gradient is NaN while every forward value is
  finite), as a CPU's bf16 kernel did for a ResNet convolution. Run in fp32, it is fine.
* ``fused_net``: the activation ``act`` has no parameters and a half-precision backward
  kernel that returns inf from its ``from_step``-th training call on (as a fused or custom op
  can): the bad value is the gradient it passes back to its input, so the culprit is a module
  no weight gradient points to.
* ``attention_net``: a self-attention block ``attn`` whose scores (``q @ k.T`` times
  ``scale``, inline in its ``forward``) exceed fp16's range while its output, after the
  softmax, is small: the op that overflows is inside the module.
* ``heavy_net``: the first layer's weights are ``weight_gain`` times the usual size, with a
  LayerNorm after it so the forward pass does not care. AdamW's updates (about ``lr`` each)
  are then smaller than half a unit in the last place of a bf16 weight that large: a pure
  bf16 model rounds them away, and that layer never learns.

``ampsweep doctor`` names each module, the format limit it crosses and the config that fixes
it (``precision.keep_fp32=[amplify]``, ``precision.keep_fp32=[fc2]``,
``precision.keep_fp32=[act]``, ``precision.keep_fp32=[attn]``, ``precision=bf16``).
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


class _HalfBackwardFails(torch.autograd.Function):
    """Identity forward; an inf input gradient backward when ``broken`` and the gradient is
    half precision (the half kernel of a fused op)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, broken: bool) -> torch.Tensor:
        ctx.broken = broken
        return F.relu(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        half = grad.dtype in (torch.float16, torch.bfloat16)
        return (torch.full_like(grad, float("inf")) if ctx.broken and half else grad), None


class FusedAct(nn.Module):
    """A ReLU with no parameters whose half-precision backward breaks from its
    ``from_step``-th training call on (a buffer counts the calls, so a replay of the step
    breaks the same way). Its forward is a plain ReLU (the identity gradient is close enough
    for a demo)."""

    def __init__(self, from_step: int = 3):
        super().__init__()
        self.from_step = from_step
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.calls += 1
        return _HalfBackwardFails.apply(x, int(self.calls) >= self.from_step)


def fused_net(in_channels: int, num_classes: int, hidden: int = 32, from_step: int = 3):
    return nn.Sequential(
        OrderedDict(
            flatten=nn.Flatten(),
            embed=nn.LazyLinear(hidden),
            act=FusedAct(from_step),
            head=nn.Linear(hidden, num_classes),
        )
    )


class Attention(nn.Module):
    """Single-head self-attention over the image's 8 rows; ``scale`` multiplies the scores
    (where ``1/sqrt(d)`` belongs)."""

    def __init__(self, dim: int, scale: float):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-2, -1) * self.scale
        return torch.softmax(scores.float(), dim=-1).to(x.dtype) @ self.v(x)


class AttentionNet(nn.Module):
    def __init__(self, num_classes: int, hidden: int, scale: float):
        super().__init__()
        self.embed = nn.LazyLinear(hidden)
        self.attn = Attention(hidden, scale)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.flatten(1, 2) if x.dim() == 4 else x  # (batch, 8 rows, 8 pixels)
        h = self.embed(rows)
        h = self.norm(h + self.attn(h))
        return self.head(h.mean(dim=1))


def attention_net(in_channels: int, num_classes: int, hidden: int = 16, scale: float = 3e5):
    return AttentionNet(num_classes, hidden, scale)


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
