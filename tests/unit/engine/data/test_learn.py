"""Every built-in image data set's default config learns with the default model.

Each data set is read from files written here in its real format (idx files, CIFAR's pickled
batches, a folder of PNGs), holding images a model can tell apart (a pattern per class plus
noise), and trained with the default cnn, optimizer and trainer settings (fewer epochs where
noted, to keep the suite fast). The folder of 16-px digits at ampsweep's default 32 px is the
case that failed before the cnn's depth followed the input.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ampsweep.config import compose
from ampsweep.engine.build import build
from ampsweep.engine.loop import fit


class Classes:
    """Per class a colour and a smooth pattern; images of a class add noise to them, so shifts
    and flips (CIFAR's augmentation) keep the class recognisable."""

    def __init__(self, classes: int, channels: int, size: int):
        self.classes, self.channels, self.size = classes, channels, size
        self.rng = rng = np.random.default_rng(classes * 100 + channels)
        self.colours = rng.uniform(40, 215, (classes, channels, 1, 1))
        coarse = torch.tensor(rng.normal(0, 60, (classes, channels, 4, 4)), dtype=torch.float32)
        self.patterns = torch.nn.functional.interpolate(coarse, size=(size, size),
                                                        mode="bilinear").numpy()  # fmt: skip

    def images(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n uint8 images (n, C, H, W) and their labels."""
        y = self.rng.integers(0, self.classes, n)
        shape = (n, self.channels, self.size, self.size)
        x = self.colours[y] + self.patterns[y] + self.rng.normal(0, 20, shape)
        return np.clip(x, 0, 255).astype(np.uint8), y


def write_idx(folder: Path, prefix: str, images: np.ndarray, labels: np.ndarray) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    n, h, w = images.shape
    (folder / f"{prefix}-images-idx3-ubyte").write_bytes(
        struct.pack(">IIII", 2051, n, h, w) + images.tobytes()
    )
    (folder / f"{prefix}-labels-idx1-ubyte").write_bytes(
        struct.pack(">II", 2049, n) + labels.astype(np.uint8).tobytes()
    )


def write_cifar(path: Path, images: np.ndarray, labels: np.ndarray, key: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    batch = {b"data": images.reshape(len(images), 3072), key: labels.tolist()}
    path.write_bytes(pickle.dumps(batch, protocol=2))


def mnist_like(root: Path, cls: str) -> None:
    classes = Classes(10, 1, 28)
    for prefix, n in (("train", 512), ("t10k", 128)):
        x, y = classes.images(n)
        write_idx(root / cls / "raw", prefix, x[:, 0], y)


def cifar(root: Path, hundred: bool) -> None:
    classes = Classes(100 if hundred else 10, 3, 32)
    key = b"fine_labels" if hundred else b"labels"
    folder = root / ("cifar-100-python" if hundred else "cifar-10-batches-py")
    names = ["train"] if hundred else [f"data_batch_{i}" for i in range(1, 6)]
    for name in names:
        write_cifar(folder / name, *classes.images(640 // len(names)), key)
    write_cifar(folder / ("test" if hundred else "test_batch"), *classes.images(160), key)


def digit_folder(root: Path) -> None:
    """400 of scikit-learn's 8x8 digits as 16-px PNGs in class folders."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i in range(400):
        image = Image.fromarray((digits.images[i] * 255 / 16).astype(np.uint8)).resize((16, 16))
        folder = root / str(digits.target[i])
        folder.mkdir(parents=True, exist_ok=True)
        image.save(folder / f"{i}.png")


CASES = {  # data set: (files to write, overrides beyond the data set's own, accuracy reached)
    "digits": (None, ["trainer.epochs=3"], 0.9),
    "synthetic": (None, ["dataset.num_samples=640", "trainer.epochs=3"], 0.9),
    "mnist": (lambda root: mnist_like(root, "MNIST"), ["trainer.epochs=6"], 0.9),
    "fashion_mnist": (lambda root: mnist_like(root, "FashionMNIST"), ["trainer.epochs=6"], 0.9),
    "cifar10": (lambda root: cifar(root, False), ["trainer.epochs=3"], 0.8),
    "cifar100": (lambda root: cifar(root, True), ["trainer.epochs=3"], 0.2),  # chance: 0.01
    # The new user's case: 400 16-px images at the default image_size=32, 30 epochs (about
    # 0.4-0.65 when the cnn had two blocks whatever the input, 0.99 with three)
    "imagefolder": (digit_folder, ["trainer.epochs=30", "dataset.preload=true"], 0.9),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_default_config_of_every_image_data_set_learns(name, tmp_path):
    write, extra, reached = CASES[name]
    root = tmp_path / "data"
    if write:
        write(root)
    where = [f"dataset.root={root}"] if write else []
    cfg = compose.load(
        [f"dataset={name}", *where, *extra, "tracking=none", "trainer.progress=false"]
    )
    assert cfg.model.name == "cnn" and cfg.model.args["depth"] is None  # the default model
    setup = build(cfg)
    summary = fit(setup, lambda m, s: None)
    assert summary["val/acc"] >= reached, (name, summary["val/acc"])
