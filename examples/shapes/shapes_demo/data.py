"""The project's data set: grey images of four shapes (square, disc, triangle, cross) at
random positions and sizes, with pixel noise. Each image is drawn from its index and the seed
alone, so the data is the same in every run and needs no files."""

from __future__ import annotations

import torch

SHAPES = ("square", "disc", "triangle", "cross")


class ShapesDataset(torch.utils.data.Dataset):
    """A map-style data set of ``(image, label)`` pairs: 1 x size x size float images."""

    classes = SHAPES  # ampsweep reads the number of classes from here

    def __init__(self, num_samples: int, image_size: int, noise: float, seed: int):
        self.n, self.size, self.noise, self.seed = num_samples, image_size, noise, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = int(torch.randint(len(SHAPES), (), generator=g))
        s = self.size
        r = int(torch.randint(s // 6, s // 3 + 1, (), generator=g))  # half the shape's size
        cy, cx = (int(v) for v in torch.randint(r, s - r, (2,), generator=g))
        yy, xx = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
        dy, dx = yy - cy, xx - cx
        if SHAPES[label] == "square":
            mask = (dy.abs() <= r) & (dx.abs() <= r)
        elif SHAPES[label] == "disc":
            mask = dy**2 + dx**2 <= r**2
        elif SHAPES[label] == "triangle":
            mask = (dy <= r) & (dy >= -r) & (dx.abs() <= (dy + r) / 2)
        else:  # a cross: a vertical and a horizontal bar
            bar = r // 3
            mask = ((dy.abs() <= r) & (dx.abs() <= bar)) | ((dx.abs() <= r) & (dy.abs() <= bar))
        image = mask.float() + self.noise * torch.randn(s, s, generator=g)
        return image.unsqueeze(0), label


def make_shapes(
    num_samples: int = 2000, image_size: int = 16, noise: float = 0.3, seed: int = 0
) -> ShapesDataset:
    """One data set; ampsweep holds out dataset.val_fraction of it (by dataset.split_seed).
    (A factory may also return a (train, val) pair of data sets.)"""
    return ShapesDataset(num_samples, image_size, noise, seed)
