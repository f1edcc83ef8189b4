"""Data sets and batches.

Each data set loads into ``Splits``: train and validation images (normalised float tensors,
NCHW) and labels, or, for an image folder, torchvision datasets decoded per item. ``Batches``
turns a split into an epoch's mini-batches in a seeded order that depends only on
(seed, epoch), so a run is repeatable and a resumed run sees the same order.

Data that fits in memory is preloaded onto the device once and batches are indexed there
(no host-to-device copy per step); otherwise a DataLoader with pinned memory feeds
non-blocking copies. Augmentation runs on the device in both cases.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ampsweep.schema import ConfigError, DatasetConfig, DatasetName, Preload

# Per-channel statistics of the training sets (the usual published values).
STATS = {
    DatasetName.mnist: ([0.1307], [0.3081]),
    DatasetName.fashion_mnist: ([0.2860], [0.3530]),
    DatasetName.cifar10: ([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]),
    DatasetName.cifar100: ([0.5071, 0.4865, 0.4409], [0.2673, 0.2564, 0.2762]),
    DatasetName.imagefolder: ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
}


@dataclass
class Splits:
    name: str
    num_classes: int
    input_shape: tuple[int, int, int]  # C, H, W
    train: tuple[torch.Tensor, torch.Tensor] | torch.utils.data.Dataset
    val: tuple[torch.Tensor, torch.Tensor] | torch.utils.data.Dataset

    @property
    def in_memory(self) -> bool:
        return isinstance(self.train, tuple)

    def num_train(self) -> int:
        return len(self.train[1]) if self.in_memory else len(self.train)


def load(cfg: DatasetConfig) -> Splits:
    loader = LOADERS[cfg.name]
    return loader(cfg)


# ---------------------------------------------------------------- loaders


def _normalise(x: torch.Tensor, cfg: DatasetConfig, default: tuple[list, list]) -> torch.Tensor:
    mean, std = (cfg.mean, cfg.std) if cfg.mean else default
    if len(mean) not in (1, x.shape[1]):
        raise ConfigError(
            f"dataset.mean has {len(mean)} values but {cfg.name.name} has {x.shape[1]} "
            "channels: give one value per channel"
        )
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return (x - m) / s


def _split(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    n_val = max(1, int(round(n * val_fraction)))
    return order[n_val:], order[:n_val]


def _from_arrays(cfg, x: torch.Tensor, y: torch.Tensor, num_classes: int, stats) -> Splits:
    """One array set split into train/validation by ``dataset.split_seed``."""
    tr, va = _split(len(y), cfg.val_fraction, cfg.split_seed)
    x = _normalise(x, cfg, stats(x[tr]) if callable(stats) else stats)
    return Splits(cfg.name.name, num_classes, tuple(x.shape[1:]), (x[tr], y[tr]), (x[va], y[va]))


def _own_stats(x: torch.Tensor) -> tuple[list, list]:
    return x.mean(dim=(0, 2, 3)).tolist(), x.std(dim=(0, 2, 3)).clamp_min(1e-6).tolist()


def load_digits(cfg: DatasetConfig) -> Splits:
    """scikit-learn's bundled 8x8 digits: pixel values 0..16, no download."""
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    return _from_arrays(cfg, x, y, 10, _own_stats)


def load_synthetic(cfg: DatasetConfig) -> Splits:
    """Noisy class templates: smooth random patterns, one per class, plus pixel noise.

    The label is a learnable function of the image (the nearest template), and the data is
    generated from ``dataset.split_seed`` alone, so it is the same in every run.
    """
    g = torch.Generator().manual_seed(cfg.split_seed)
    c, s, k = cfg.channels, cfg.image_size, cfg.num_classes
    coarse = torch.randn(k, c, max(2, s // 4), max(2, s // 4), generator=g)
    templates = torch.nn.functional.interpolate(coarse, size=(s, s), mode="bilinear")
    y = torch.randint(0, k, (cfg.num_samples,), generator=g)
    x = templates[y] + 1.0 * torch.randn(cfg.num_samples, c, s, s, generator=g)
    return _from_arrays(cfg, x, y, k, ([0.0] * c, [x.std().item()] * c))


def _torchvision_error(cfg: DatasetConfig, where: Path, err: Exception) -> ConfigError:
    if cfg.download:
        return ConfigError(
            f"dataset={cfg.name.name}: download into {where} failed ({str(err).splitlines()[0]}): "
            "check the network, or copy the files there and keep dataset.download=false"
        )
    return ConfigError(
        f"dataset={cfg.name.name}: no data under {where} (dataset.root={cfg.root}, "
        "dataset.download=false): set dataset.download=true to fetch it (needs network), "
        "or point dataset.root at a folder that holds it"
    )


def load_mnist_like(cfg: DatasetConfig) -> Splits:
    """MNIST / Fashion-MNIST from the idx files torchvision keeps under <root>/<Class>/raw."""
    from torchvision import datasets

    cls = datasets.MNIST if cfg.name == DatasetName.mnist else datasets.FashionMNIST
    root = Path(cfg.root).expanduser().resolve()
    try:
        parts = [cls(str(root), train=t, download=cfg.download) for t in (True, False)]
    except Exception as err:  # torchvision raises RuntimeError/URLError/OSError
        raise _torchvision_error(cfg, root / cls.__name__ / "raw", err) from None
    (xt, yt), (xv, yv) = [(p.data.unsqueeze(1).float() / 255.0, p.targets.long()) for p in parts]
    stats = STATS[cfg.name]
    return Splits(
        cfg.name.name,
        10,
        tuple(xt.shape[1:]),
        (_normalise(xt, cfg, stats), yt),
        (_normalise(xv, cfg, stats), yv),
    )


CIFAR_LAYOUT = {
    # name: (folder, train files, test files, label key, classes)
    DatasetName.cifar10: (
        "cifar-10-batches-py",
        [f"data_batch_{i}" for i in range(1, 6)],
        ["test_batch"],
        b"labels",
        10,
    ),
    DatasetName.cifar100: ("cifar-100-python", ["train"], ["test"], b"fine_labels", 100),
}


def read_cifar_batches(folder: Path, files: list[str], label_key: bytes):
    """Read CIFAR's pickled batches: each a dict with b'data' (N x 3072 uint8, channel-major
    32x32 planes) and the labels under ``label_key``."""
    xs, ys = [], []
    for name in files:
        with open(folder / name, "rb") as f:
            batch = pickle.load(f, encoding="bytes")  # noqa: S301 - the published format
        xs.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.extend(batch[label_key])
    x = torch.from_numpy(np.concatenate(xs)).float() / 255.0
    return x, torch.tensor(ys, dtype=torch.long)


def load_cifar(cfg: DatasetConfig) -> Splits:
    """CIFAR-10/100 read from the python-pickle batches; torchvision fetches them if asked.

    We read the batches ourselves rather than through torchvision's class, which insists on
    the full files' checksums; the format is the published one.
    """
    folder_name, train_files, test_files, key, k = CIFAR_LAYOUT[cfg.name]
    root = Path(cfg.root).expanduser().resolve()
    folder = root / folder_name
    if not all((folder / f).is_file() for f in train_files + test_files):
        if not cfg.download:
            raise _torchvision_error(cfg, folder, FileNotFoundError(folder))
        from torchvision import datasets

        cls = datasets.CIFAR10 if cfg.name == DatasetName.cifar10 else datasets.CIFAR100
        try:
            cls(str(root), train=True, download=True)
        except Exception as err:
            raise _torchvision_error(cfg, folder, err) from None
    xt, yt = read_cifar_batches(folder, train_files, key)
    xv, yv = read_cifar_batches(folder, test_files, key)
    stats = STATS[cfg.name]
    return Splits(
        cfg.name.name,
        k,
        tuple(xt.shape[1:]),
        (_normalise(xt, cfg, stats), yt),
        (_normalise(xv, cfg, stats), yv),
    )


def load_imagefolder(cfg: DatasetConfig) -> Splits:
    """root/<class>/<image>: decoded per item by torchvision (PIL), resized, normalised."""
    from torchvision import datasets, transforms

    root = Path(cfg.root).expanduser().resolve()
    if not root.is_dir():
        raise ConfigError(
            f"dataset.root={cfg.root}: no such folder ({root}): point dataset.root at a folder "
            "of class sub-folders (root/<class>/<image>.png)"
        )
    mean, std = (cfg.mean, cfg.std) if cfg.mean else STATS[DatasetName.imagefolder]
    if cfg.channels == 1 and not cfg.mean:
        mean, std = [sum(mean) / 3], [sum(std) / 3]
    steps = [transforms.Resize((cfg.image_size, cfg.image_size))]
    if cfg.channels == 1:
        steps.append(transforms.Grayscale(1))
    steps += [transforms.ToTensor(), transforms.Normalize(mean, std)]
    try:
        full = datasets.ImageFolder(str(root), transform=transforms.Compose(steps))
    except (FileNotFoundError, RuntimeError) as err:
        raise ConfigError(
            f"dataset.root={cfg.root}: {str(err).splitlines()[0]}: it must hold one sub-folder "
            "per class with images inside"
        ) from None
    if len(full.classes) < 2:
        raise ConfigError(
            f"dataset.root={cfg.root}: found {len(full.classes)} class folder(s); need >= 2"
        )
    tr, va = _split(len(full), cfg.val_fraction, cfg.split_seed)
    train = torch.utils.data.Subset(full, tr.tolist())
    val = torch.utils.data.Subset(full, va.tolist())
    shape = (cfg.channels, cfg.image_size, cfg.image_size)
    return Splits(cfg.name.name, len(full.classes), shape, train, val)


LOADERS = {
    DatasetName.digits: load_digits,
    DatasetName.synthetic: load_synthetic,
    DatasetName.mnist: load_mnist_like,
    DatasetName.fashion_mnist: load_mnist_like,
    DatasetName.cifar10: load_cifar,
    DatasetName.cifar100: load_cifar,
    DatasetName.imagefolder: load_imagefolder,
}


# ---------------------------------------------------------------- batches


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch: a function of (seed, epoch) only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


@dataclass
class Augment:
    """Random crop (zero padding) and horizontal flip, applied to a batch on its device."""

    padding: int = 0
    flip: bool = False

    @property
    def active(self) -> bool:
        return self.padding > 0 or self.flip

    def __call__(self, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        b, _, h, w = x.shape
        if self.padding:
            p = self.padding
            padded = torch.nn.functional.pad(x, (p, p, p, p))
            dy = torch.randint(0, 2 * p + 1, (b, 1), generator=g, device=g.device).to(x.device)
            dx = torch.randint(0, 2 * p + 1, (b, 1), generator=g, device=g.device).to(x.device)
            rows = (torch.arange(h, device=x.device) + dy)[:, None, :, None]  # b,1,h,1
            cols = (torch.arange(w, device=x.device) + dx)[:, None, None, :]  # b,1,1,w
            bi = torch.arange(b, device=x.device)[:, None, None, None]
            ci = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
            x = padded[bi, ci, rows, cols]
        if self.flip:
            mask = torch.rand(b, generator=g, device=g.device).to(x.device) < 0.5
            x = torch.where(mask[:, None, None, None], x.flip(3), x)
        return x


class Batches:
    """Mini-batches of one split, in the seeded order of each epoch.

    ``preload``: tensors live on the device and batches are gathered there. Otherwise a
    DataLoader (pinned memory, ``num_workers``) yields CPU batches copied non-blocking.
    """

    def __init__(
        self,
        split,
        batch_size: int,
        device: torch.device,
        dtype: torch.dtype,
        *,
        shuffle: bool,
        drop_last: bool,
        seed: int,
        preload: bool,
        num_workers: int = 0,
        augment: Augment | None = None,
        channels_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.batch_size, self.device, self.dtype = batch_size, device, dtype
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.drop_last, self.seed = shuffle, drop_last, seed
        self.augment = augment if augment and augment.active else None
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.preload = preload
        if isinstance(split, tuple) and preload:
            x, y = split
            self.x = x.to(device=device, dtype=dtype).contiguous(memory_format=self.memory_format)
            self.y = y.to(device)
            self.n = len(y)
        else:
            dataset = torch.utils.data.TensorDataset(*split) if isinstance(split, tuple) else split
            self.dataset, self.n, self.num_workers = dataset, len(dataset), num_workers
        # Under DDP each rank reads every world_size-th sample of the epoch's order (like
        # torch's DistributedSampler); training drops the tail so all ranks take as many steps.
        shares = self.n // world_size if drop_last else len(range(rank, self.n, world_size))
        self.shard_n = shares
        if self.n == 0 or (drop_last and shares < batch_size):
            per_rank = f" ({shares} per process for {world_size})" if world_size > 1 else ""
            raise ConfigError(
                f"trainer.batch_size={batch_size} is larger than the {self.n} training samples"
                f"{per_rank}: lower trainer.batch_size"
            )

    def __len__(self) -> int:
        full, rest = divmod(self.shard_n, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches ``start``.. of ``epoch`` (``start`` > 0 resumes mid-epoch)."""
        order = epoch_order(self.n, self.seed, epoch) if self.shuffle else torch.arange(self.n)
        if self.world_size > 1:
            # Every rank draws the same (seed, epoch) permutation and keeps its own slice: the
            # ranks' batch i together are the single-process batch i of a world_size-times
            # larger batch size.
            order = order[: self.shard_n * self.world_size if self.drop_last else self.n]
            order = order[self.rank :: self.world_size]
        order = order[: len(self) * self.batch_size] if self.drop_last else order
        g = torch.Generator(device=self.device) if self.augment else None
        if self.preload:
            order = order.to(self.device)
            for i in range(start, len(self)):
                idx = order[i * self.batch_size : (i + 1) * self.batch_size]
                yield self._finish(self.x[idx], g, epoch, i), self.y[idx]
            return
        batches = [
            order[i * self.batch_size : (i + 1) * self.batch_size].tolist()
            for i in range(start, len(self))
        ]
        loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_sampler=batches,
            num_workers=self.num_workers,
            pin_memory=self.device.type == "cuda",
            persistent_workers=False,
            # Its own generator: the loader's worker seed must not draw from the global RNG,
            # or a run resumed mid-epoch would continue from a different global RNG state.
            generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch),
        )
        for i, (x, y) in enumerate(loader, start):
            x = x.to(self.device, dtype=self.dtype, non_blocking=True)
            x = x.contiguous(memory_format=self.memory_format)
            yield self._finish(x, g, epoch, i), y.to(self.device, non_blocking=True)

    def _finish(self, x: torch.Tensor, g: torch.Generator | None, epoch: int, i: int):
        if g is None:
            return x
        # Seeded per batch from (seed, epoch, batch index), not once per epoch: a run resumed
        # at batch ``start`` then augments each batch exactly as the uninterrupted run did.
        g.manual_seed((self.seed * 1_000_003 + epoch) * 1_000_033 + i)
        return self.augment(x, g)


def should_preload(cfg: DatasetConfig, splits: Splits) -> bool:
    choice = Preload(cfg.preload)
    if choice == Preload.auto:
        return splits.in_memory
    if choice == Preload.true and not splits.in_memory:
        return True  # decode every image once; fine for folders that fit in memory
    return choice == Preload.true


def materialise(dataset: torch.utils.data.Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode a per-item dataset into tensors once (dataset.preload=true on an image folder)."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=256)
    xs, ys = zip(*loader, strict=True)
    return torch.cat(xs), torch.cat(ys)
