"""The small built-in models: an MLP and a convnet, sized for CPU runs on small images."""

from __future__ import annotations

from torch import nn

from ampsweep.engine.models import MODELS
from ampsweep.engine.registry import all_of, fraction, positive


@MODELS.register("mlp", check=all_of(positive("width", "depth"), fraction("dropout")))
def mlp(
    input_shape: tuple, num_classes: int, *, width: int = 64, depth: int = 2, dropout: float = 0.0
) -> nn.Module:
    """Flatten, then ``depth`` hidden layers of ``4 * width`` units."""
    width_in = 1
    for d in input_shape:
        width_in *= d
    hidden = 4 * width
    layers: list[nn.Module] = [nn.Flatten()]
    for _ in range(depth):
        layers += [nn.Linear(width_in, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout)]
        width_in = hidden
    layers.append(nn.Linear(width_in, num_classes))
    return nn.Sequential(*layers)


# The cnn stops doubling its width here: deep stacks on large images would otherwise reach
# thousands of channels (and tens of millions of weights) in their last blocks.
MAX_WIDTH_FACTOR = 8


def auto_depth(image_size: int) -> int:
    """Blocks until the feature map is about 4 px (each block halves it), at least two: so
    global pooling sees features whose receptive field covers the image (8 px: 2 blocks,
    16 px: 2, 32 px: 3, 64 px: 4)."""
    depth, size = 0, image_size
    while size > 4:
        size //= 2
        depth += 1
    return max(2, depth)


@MODELS.register("cnn", check=all_of(positive("width", "depth"), fraction("dropout")))
def cnn(
    input_shape: tuple,
    num_classes: int,
    *,
    width: int = 32,
    depth: int | None = None,
    dropout: float = 0.0,
) -> nn.Module:
    """conv-BN-ReLU blocks, doubling width (up to 8x) and halving resolution while the image is
    >= 4 px. ``depth``: the number of blocks; None follows the input (``auto_depth``).

    Average pooling rather than max pooling: max pooling saves int64 argmax indices for
    backward, which do not shrink with the precision and would blur what AMP saves.
    """
    c, h = input_shape[0], input_shape[1]
    depth = depth if depth is not None else auto_depth(min(input_shape[1:]))
    layers: list[nn.Module] = []
    width_in, size = c, h
    for i in range(depth):
        width_out = width * 2 ** min(i, MAX_WIDTH_FACTOR.bit_length() - 1)
        layers += [
            nn.Conv2d(width_in, width_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(width_out),
            nn.ReLU(inplace=True),
        ]
        if size >= 4:
            layers.append(nn.AvgPool2d(2))
            size //= 2
        width_in = width_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout)]
    layers.append(nn.Linear(width_in, num_classes))
    return nn.Sequential(*layers)
