"""engine/data/images.py: each built-in loader reads files written here in the real formats;
the in-memory data sets are fixed by their seeds; a missing or unreachable data set is one
line that says where it looked."""

from __future__ import annotations

import pickle
import struct
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ampsweep.config.schema import ConfigError, DatasetConfig
from ampsweep.engine import data
from ampsweep.engine.data import images

RNG = np.random.default_rng(0)


# ---------------------------------------------------------------- writers of the real formats


def write_idx(folder: Path, prefix: str, images: np.ndarray, labels: np.ndarray) -> None:
    """MNIST's idx files: big-endian magic (2051 images / 2049 labels), sizes, then uint8."""
    folder.mkdir(parents=True, exist_ok=True)
    n, h, w = images.shape
    (folder / f"{prefix}-images-idx3-ubyte").write_bytes(
        struct.pack(">IIII", 2051, n, h, w) + images.astype(np.uint8).tobytes()
    )
    (folder / f"{prefix}-labels-idx1-ubyte").write_bytes(
        struct.pack(">II", 2049, n) + labels.astype(np.uint8).tobytes()
    )


def make_mnist(root: Path, cls: str, n_train: int = 12, n_test: int = 6):
    raw = root / cls / "raw"
    train = (RNG.integers(0, 256, (n_train, 28, 28)), RNG.integers(0, 10, n_train))
    test = (RNG.integers(0, 256, (n_test, 28, 28)), RNG.integers(0, 10, n_test))
    write_idx(raw, "train", *train)
    write_idx(raw, "t10k", *test)
    return train, test


def write_cifar_batch(path: Path, images: np.ndarray, labels: list[int], key: bytes) -> None:
    """One CIFAR python batch: a pickled dict with bytes keys, b'data' N x 3072 uint8 holding
    the R, G and B 32x32 planes of each image in turn."""
    path.parent.mkdir(parents=True, exist_ok=True)
    batch = {b"data": images.reshape(len(images), 3072).astype(np.uint8), key: labels}
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=2)


def images_3x32(n: int) -> np.ndarray:
    return RNG.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)


SHARED = {f.name for f in fields(DatasetConfig)}


def dataset(name: str, root: Path | str | None = None, **kw) -> DatasetConfig:
    """A data set's config: the shared keys typed, its loader's own settings as ``args``."""
    builder = data.DATASETS.lookup(name)
    own = {k: v for k, v in kw.items() if k not in SHARED}
    if root is not None:
        own["root"] = str(root)
    args, problems = builder.resolve(own)
    assert not problems, problems
    return DatasetConfig(name=name, args=args, **{k: v for k, v in kw.items() if k in SHARED})


# ---------------------------------------------------------------- torchvision formats


@pytest.mark.parametrize("name,cls", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_mnist_like_reads_idx_files(tmp_path, name, cls):
    (xt, yt), (xv, yv) = make_mnist(tmp_path, cls)
    splits = data.load(dataset(name, tmp_path))
    assert splits.input_shape == (1, 28, 28) and splits.num_classes == 10
    (x_train, y_train), (x_val, y_val) = splits.train, splits.val
    assert x_train.shape == (12, 1, 28, 28) and x_val.shape == (6, 1, 28, 28)
    assert y_train.tolist() == yt.tolist() and y_val.tolist() == yv.tolist()
    mean, std = {"mnist": images.MNIST_STATS, "fashion_mnist": images.FASHION_MNIST_STATS}[name]
    expected = (xt[3, 5, 7] / 255.0 - mean[0]) / std[0]
    assert x_train[3, 0, 5, 7].item() == pytest.approx(expected, abs=1e-5)


def test_cifar10_reads_pickled_batches(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    train_images, train_labels = [], []
    for i in range(1, 6):
        imgs, labels = images_3x32(3), RNG.integers(0, 10, 3).tolist()
        write_cifar_batch(folder / f"data_batch_{i}", imgs, labels, b"labels")
        train_images.append(imgs)
        train_labels += labels
    test_imgs, test_labels = images_3x32(4), RNG.integers(0, 10, 4).tolist()
    write_cifar_batch(folder / "test_batch", test_imgs, test_labels, b"labels")

    splits = data.load(dataset("cifar10", tmp_path))
    assert splits.input_shape == (3, 32, 32) and splits.num_classes == 10
    x, y = splits.train
    assert x.shape == (15, 3, 32, 32) and y.tolist() == train_labels
    assert splits.val[1].tolist() == test_labels
    # Channel-major planes: the green plane of image 4 (batch 2, second image) at row 2, col 9.
    mean, std = images.CIFAR10_STATS
    expected = (train_images[1][1, 1, 2, 9] / 255.0 - mean[1]) / std[1]
    assert x[4, 1, 2, 9].item() == pytest.approx(expected, abs=1e-5)


def test_cifar100_reads_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    labels = [3, 99, 42, 0]
    write_cifar_batch(folder / "train", images_3x32(4), labels, b"fine_labels")
    write_cifar_batch(folder / "test", images_3x32(2), [7, 8], b"fine_labels")
    splits = data.load(dataset("cifar100", tmp_path))
    assert splits.num_classes == 100
    assert splits.train[1].tolist() == labels and splits.val[1].tolist() == [7, 8]


@pytest.mark.parametrize(
    "name,where",
    [
        ("mnist", "MNIST/raw"),
        ("fashion_mnist", "FashionMNIST/raw"),
        ("cifar10", "cifar-10-batches-py"),
        ("cifar100", "cifar-100-python"),
    ],
)
def test_missing_data_set_says_where_it_looked(tmp_path, name, where):
    with pytest.raises(ConfigError) as info:
        data.load(dataset(name, tmp_path))
    message = str(info.value)
    assert "\n" not in message
    assert f"dataset={name}" in message
    assert str(tmp_path / where) in message
    assert "dataset.download=true" in message


# ---------------------------------------------------------------- image folder


def make_image_folder(root: Path, per_class: int = 5, classes=("cat", "dog", "owl")) -> None:
    for k, cls in enumerate(classes):
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            pixels = np.full((10, 12, 3), 40 * k, dtype=np.uint8) + RNG.integers(0, 30, (10, 12, 3))
            Image.fromarray(pixels.astype(np.uint8)).save(root / cls / f"{i}.png")


def test_imagefolder_reads_pngs(tmp_path):
    make_image_folder(tmp_path / "images")
    cfg = dataset("imagefolder", tmp_path / "images", image_size=8, val_fraction=0.2)
    splits = data.load(cfg)
    assert splits.num_classes == 3 and splits.input_shape == (3, 8, 8)
    assert len(splits.train) + len(splits.val) == 15 and len(splits.val) == 3
    x, y = splits.train[0]
    assert x.shape == (3, 8, 8) and 0 <= y < 3


def test_imagefolder_grayscale(tmp_path):
    make_image_folder(tmp_path / "images", classes=("a", "b"))
    splits = data.load(dataset("imagefolder", tmp_path / "images", image_size=6, channels=1))
    assert splits.input_shape == (1, 6, 6) and splits.train[0][0].shape == (1, 6, 6)


def test_imagefolder_errors(tmp_path):
    with pytest.raises(ConfigError, match="dataset.root=.*no such folder"):
        data.load(dataset("imagefolder", tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="dataset.root=.*one sub-folder per class"):
        data.load(dataset("imagefolder", tmp_path / "empty"))
    make_image_folder(tmp_path / "one", classes=("only",))
    with pytest.raises(ConfigError, match="found 1 class folder"):
        data.load(dataset("imagefolder", tmp_path / "one"))


# ---------------------------------------------------------------- in-memory data sets


def test_digits_split_is_fixed_by_split_seed():
    a, b = data.load(dataset("digits")), data.load(dataset("digits"))
    assert torch.equal(a.train[0], b.train[0]) and torch.equal(a.val[1], b.val[1])
    assert a.input_shape == (1, 8, 8) and a.num_classes == 10
    assert len(a.train[1]) + len(a.val[1]) == 1797
    assert len(a.val[1]) == round(0.2 * 1797)
    other = data.load(dataset("digits", split_seed=1))
    assert not torch.equal(a.val[1], other.val[1])


def test_synthetic_is_deterministic_and_learnable():
    cfg = dataset("synthetic", num_samples=600, image_size=8, channels=3, num_classes=5)
    a, b = data.load(cfg), data.load(cfg)
    assert torch.equal(a.train[0], b.train[0]) and torch.equal(a.val[1], b.val[1])
    assert a.input_shape == (3, 8, 8) and a.num_classes == 5
    # The label is a rule of the image: nearest class mean of the training images finds it.
    (xt, yt), (xv, yv) = a.train, a.val
    means = torch.stack([xt[yt == k].mean(0) for k in range(5)]).flatten(1)
    predicted = torch.cdist(xv.flatten(1), means).argmin(1)
    assert (predicted == yv).float().mean() > 0.9


def test_own_normalisation_overrides_the_default():
    splits = data.load(dataset("digits", mean=[0.5], std=[2.0]))
    raw = data.load(dataset("digits", mean=[0.0], std=[1.0]))
    torch.testing.assert_close(splits.train[0], (raw.train[0] - 0.5) / 2.0)
    with pytest.raises(ConfigError, match="dataset.mean has 3 values"):
        data.load(dataset("digits", mean=[0.1, 0.2, 0.3], std=[1.0, 1.0, 1.0]))


@pytest.mark.parametrize("name,cls", [("mnist", "MNIST"), ("cifar10", "CIFAR10")])
def test_unreachable_download_says_where_and_why(tmp_path, monkeypatch, name, cls):
    from torchvision import datasets

    def offline(self):
        raise OSError("[Errno 101] Network is unreachable")

    monkeypatch.setattr(getattr(datasets, cls), "download", offline)
    with pytest.raises(ConfigError) as info:
        data.load(dataset(name, tmp_path, download=True))
    message = str(info.value)
    assert f"dataset={name}: download into {tmp_path}" in message
    assert "Network is unreachable" in message and "\n" not in message
