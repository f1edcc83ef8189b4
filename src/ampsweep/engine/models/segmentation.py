"""A small segmentation net of our own (``model=unet``): logits of a class per pixel, at the
input's resolution. Dense prediction keeps activations of the input's full size, so memory,
more than speed, decides the precision mode here. Larger ones come from
``segmentation_models_pytorch`` through ``model._target_`` (extra ``ampsweep[segmentation]``;
docs/your-task.md)."""

from __future__ import annotations

import torch
from torch import nn

from ampsweep.engine.models import MODELS
from ampsweep.engine.registry import positive


def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """A U-Net of ``depth`` levels: each halves the resolution and doubles the width on the way
    down; the way up joins each level's features again (the skip connections)."""

    def __init__(self, in_channels: int, num_classes: int, width: int, depth: int) -> None:
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList([_block(in_channels, widths[0])])
        self.down.extend(_block(a, b) for a, b in zip(widths, widths[1:], strict=False))
        self.up = nn.ModuleList(
            nn.ConvTranspose2d(b, a, 2, stride=2) for a, b in zip(widths, widths[1:], strict=False)
        )
        self.merge = nn.ModuleList(_block(2 * a, a) for a in widths[:-1])
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else nn.functional.max_pool2d(x, 2))
            skips.append(x)
        for up, merge, skip in reversed(list(zip(self.up, self.merge, skips, strict=False))):
            x = merge(torch.cat([up(x), skip], dim=1))
        return self.head(x)


@MODELS.register("unet", task="segmentation", check=positive("width", "depth"))
def unet(input_shape: tuple, num_classes: int, *, width: int = 16, depth: int = 2) -> nn.Module:
    """A small U-Net: ``depth`` halvings of the resolution (the image's height and width must
    divide by 2**depth), ``width`` channels at full resolution."""
    return UNet(input_shape[0], num_classes, width, depth)
