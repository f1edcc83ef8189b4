"""The built-in image data sets: bundled digits, synthetic images, MNIST and Fashion-MNIST,
CIFAR-10/100 (read from the files torchvision keeps), a folder of class sub-folders; and for
segmentation (a class per pixel) synthetic shapes and Oxford-IIIT Pet."""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path

import numpy as np
import torch

from ampsweep.config.schema import ConfigError, DatasetConfig
from ampsweep.engine.data import DATASETS, Splits, split_indices
from ampsweep.engine.registry import positive

Stats = tuple[list[float], list[float]]  # per-channel mean and std

# The usual published per-channel statistics of the training sets.
MNIST_STATS: Stats = ([0.1307], [0.3081])
FASHION_MNIST_STATS: Stats = ([0.2860], [0.3530])
CIFAR10_STATS: Stats = ([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616])
CIFAR100_STATS: Stats = ([0.5071, 0.4865, 0.4409], [0.2673, 0.2564, 0.2762])
IMAGENET_STATS: Stats = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


def _normalise(x: torch.Tensor, cfg: DatasetConfig, default: Stats) -> torch.Tensor:
    mean, std = (cfg.mean, cfg.std) if cfg.mean else default
    if len(mean) not in (1, x.shape[1]):
        raise ConfigError(
            f"dataset.mean has {len(mean)} values but {cfg.name} has {x.shape[1]} "
            "channels: give one value per channel"
        )
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return (x - m) / s


def _from_arrays(cfg: DatasetConfig, x, y, num_classes: int, stats) -> Splits:
    """One array set split into train/validation by ``dataset.split_seed``."""
    tr, va = split_indices(len(y), cfg.val_fraction, cfg.split_seed)
    x = _normalise(x, cfg, stats(x[tr]) if callable(stats) else stats)
    return Splits(cfg.name, num_classes, tuple(x.shape[1:]), (x[tr], y[tr]), (x[va], y[va]))


def _own_stats(x: torch.Tensor) -> Stats:
    return x.mean(dim=(0, 2, 3)).tolist(), x.std(dim=(0, 2, 3)).clamp_min(1e-6).tolist()


def digits_file() -> Path:
    """The 8x8 digits file scikit-learn ships (``load_digits`` reads it), found without
    importing scikit-learn: the import alone takes about a second and a half."""
    spec = importlib.util.find_spec("sklearn")  # a top-level package: nothing is imported
    folders = (spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    raise ConfigError(
        "dataset=digits: scikit-learn's bundled digits file (sklearn/datasets/data/"
        "digits.csv.gz) was not found: install scikit-learn (pip install scikit-learn)"
    )


@DATASETS.register("digits", source=digits_file)  # the file it reads (engine.fingerprint)
def digits(cfg: DatasetConfig) -> Splits:
    """scikit-learn's bundled 8x8 digits: pixel values 0..16, no download."""
    # One row per image: 64 pixel values, then the label (the layout load_digits reads).
    rows = np.loadtxt(digits_file(), delimiter=",", dtype=np.float32)
    x = torch.from_numpy(rows[:, :-1].reshape(-1, 1, 8, 8).copy()) / 16.0
    y = torch.from_numpy(rows[:, -1].astype(np.int64))
    return _from_arrays(cfg, x, y, 10, _own_stats)


def _check_synthetic(s: dict) -> list[str]:
    problems = positive("num_samples", "channels", "image_size")(s)
    if s["num_classes"] < 2:
        problems.append(f"num_classes={s['num_classes']} must be >= 2")
    return problems


@DATASETS.register("synthetic", check=_check_synthetic)
def synthetic(
    cfg: DatasetConfig,
    *,
    num_samples: int = 4096,
    channels: int = 3,
    image_size: int = 32,
    num_classes: int = 10,
) -> Splits:
    """Noisy class templates: smooth random patterns, one per class, plus pixel noise.

    The label is a learnable function of the image (the nearest template), and the data is
    generated from ``dataset.split_seed`` alone, so it is the same in every run.
    """
    g = torch.Generator().manual_seed(cfg.split_seed)
    c, s, k = channels, image_size, num_classes
    coarse = torch.randn(k, c, max(2, s // 4), max(2, s // 4), generator=g)
    templates = torch.nn.functional.interpolate(coarse, size=(s, s), mode="bilinear")
    y = torch.randint(0, k, (num_samples,), generator=g)
    x = templates[y] + 1.0 * torch.randn(num_samples, c, s, s, generator=g)
    return _from_arrays(cfg, x, y, k, ([0.0] * c, [x.std().item()] * c))


def _missing_files(cfg: DatasetConfig, root: str, download: bool, where: Path, err: Exception):
    if download:
        return ConfigError(
            f"dataset={cfg.name}: download into {where} failed ({str(err).splitlines()[0]}): "
            "check the network, or copy the files there and keep dataset.download=false"
        )
    return ConfigError(
        f"dataset={cfg.name}: no data under {where} (dataset.root={root}, "
        "dataset.download=false): set dataset.download=true to fetch it (needs network), "
        "or point dataset.root at a folder that holds it"
    )


def _mnist_like(cfg: DatasetConfig, cls_name: str, stats: Stats, root: str, download: bool):
    """MNIST / Fashion-MNIST from the idx files torchvision keeps under <root>/<Class>/raw."""
    # torchvision here and below, not at the top: only its data sets import it (the default
    # digits run does not).
    from torchvision import datasets

    cls = getattr(datasets, cls_name)
    folder = Path(root).expanduser().resolve()
    try:
        parts = [cls(str(folder), train=t, download=download) for t in (True, False)]
    except Exception as err:  # torchvision raises RuntimeError/URLError/OSError
        raise _missing_files(cfg, root, download, folder / cls.__name__ / "raw", err) from None
    (xt, yt), (xv, yv) = [(p.data.unsqueeze(1).float() / 255.0, p.targets.long()) for p in parts]
    return Splits(
        cfg.name,
        10,
        tuple(xt.shape[1:]),
        (_normalise(xt, cfg, stats), yt),
        (_normalise(xv, cfg, stats), yv),
    )


@DATASETS.register("mnist")
def mnist(cfg: DatasetConfig, *, root: str = "data", download: bool = False) -> Splits:
    """torchvision MNIST (idx files under <root>/MNIST/raw); its test split validates."""
    return _mnist_like(cfg, "MNIST", MNIST_STATS, root, download)


@DATASETS.register("fashion_mnist")
def fashion_mnist(cfg: DatasetConfig, *, root: str = "data", download: bool = False) -> Splits:
    """torchvision FashionMNIST (<root>/FashionMNIST/raw); its test split validates."""
    return _mnist_like(cfg, "FashionMNIST", FASHION_MNIST_STATS, root, download)


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


def _cifar(cfg, cls_name, folder_name, train, test, key, classes, stats, root, download):
    """CIFAR read from the python-pickle batches; torchvision fetches them if asked.

    We read the batches ourselves rather than through torchvision's class, which insists on
    the full files' checksums; the format is the published one.
    """
    base = Path(root).expanduser().resolve()
    folder = base / folder_name
    if not all((folder / f).is_file() for f in train + test):
        if not download:
            raise _missing_files(cfg, root, download, folder, FileNotFoundError(folder))
        from torchvision import datasets

        try:
            getattr(datasets, cls_name)(str(base), train=True, download=True)
        except Exception as err:
            raise _missing_files(cfg, root, download, folder, err) from None
    xt, yt = read_cifar_batches(folder, train, key)
    xv, yv = read_cifar_batches(folder, test, key)
    return Splits(
        cfg.name,
        classes,
        tuple(xt.shape[1:]),
        (_normalise(xt, cfg, stats), yt),
        (_normalise(xv, cfg, stats), yv),
    )


@DATASETS.register("cifar10")
def cifar10(cfg: DatasetConfig, *, root: str = "data", download: bool = False) -> Splits:
    """torchvision CIFAR-10 (<root>/cifar-10-batches-py); its test batch validates."""
    train = [f"data_batch_{i}" for i in range(1, 6)]
    return _cifar(
        cfg,
        "CIFAR10",
        "cifar-10-batches-py",
        train,
        ["test_batch"],
        b"labels",
        10,
        CIFAR10_STATS,
        root,
        download,
    )


@DATASETS.register("cifar100")
def cifar100(cfg: DatasetConfig, *, root: str = "data", download: bool = False) -> Splits:
    """torchvision CIFAR-100 (<root>/cifar-100-python), fine labels; its test set validates."""
    return _cifar(
        cfg,
        "CIFAR100",
        "cifar-100-python",
        ["train"],
        ["test"],
        b"fine_labels",
        100,
        CIFAR100_STATS,
        root,
        download,
    )


@DATASETS.register("imagefolder", check=positive("image_size", "channels"))
def imagefolder(
    cfg: DatasetConfig, *, root: str = "data/images", image_size: int = 32, channels: int = 3
) -> Splits:
    """root/<class>/<image>: decoded per item by torchvision (PIL), resized, normalised."""
    from torchvision import datasets, transforms

    folder = Path(root).expanduser().resolve()
    if not folder.is_dir():
        raise ConfigError(
            f"dataset.root={root}: no such folder ({folder}): point dataset.root at a folder "
            "of class sub-folders (root/<class>/<image>.png)"
        )
    mean, std = (cfg.mean, cfg.std) if cfg.mean else IMAGENET_STATS
    if channels == 1 and not cfg.mean:
        mean, std = [sum(mean) / 3], [sum(std) / 3]
    steps = [transforms.Resize((image_size, image_size))]
    if channels == 1:
        steps.append(transforms.Grayscale(1))
    steps += [transforms.ToTensor(), transforms.Normalize(mean, std)]
    try:
        full = datasets.ImageFolder(str(folder), transform=transforms.Compose(steps))
    except (FileNotFoundError, RuntimeError) as err:
        raise ConfigError(
            f"dataset.root={root}: {str(err).splitlines()[0]}: it must hold one sub-folder "
            "per class with images inside"
        ) from None
    if len(full.classes) < 2:
        raise ConfigError(
            f"dataset.root={root}: found {len(full.classes)} class folder(s); need >= 2"
        )
    tr, va = split_indices(len(full), cfg.val_fraction, cfg.split_seed)
    train = torch.utils.data.Subset(full, tr.tolist())
    val = torch.utils.data.Subset(full, va.tolist())
    return Splits(cfg.name, len(full.classes), (channels, image_size, image_size), train, val)


# ---------------------------------------------------------------- masks: a class per pixel

SHAPE_CLASSES = ("background", "square", "disc")


@DATASETS.register("shape_masks", task="segmentation", check=positive("num_samples", "image_size"))
def shape_masks(cfg: DatasetConfig, *, num_samples: int = 512, image_size: int = 32) -> Splits:
    """Synthetic segmentation, no download: each image a square and a disc of random sizes
    and places, each in a colour of its own, over pixel noise; the mask gives every pixel its
    class (0 background, 1 square, 2 disc; the disc on top). Generated from
    ``dataset.split_seed`` alone, the same in every run."""
    g = torch.Generator().manual_seed(cfg.split_seed)
    n, s = num_samples, image_size
    rows, cols = torch.arange(s).view(1, s, 1), torch.arange(s).view(1, 1, s)

    def place(low: float, high: float) -> tuple[torch.Tensor, ...]:
        size = (low + (high - low) * torch.rand(n, 1, 1, generator=g)) * s
        r, c = (torch.rand(n, 1, 1, generator=g) * s for _ in range(2))
        return size, r, c

    size, r, c = place(0.2, 0.5)
    square = ((rows - r).abs() <= size / 2) & ((cols - c).abs() <= size / 2)
    size, r, c = place(0.15, 0.35)
    disc = (rows - r) ** 2 + (cols - c) ** 2 <= size**2
    y = torch.zeros(n, s, s, dtype=torch.int64)
    y[square], y[disc] = 1, 2
    colours = torch.tensor([[0.0, 0.0, 0.0], [1.0, -0.5, 0.5], [-0.5, 1.0, -1.0]])
    x = colours[y].permute(0, 3, 1, 2) + 0.5 * torch.randn(n, 3, s, s, generator=g)
    splits = _from_arrays(cfg, x, y, len(SHAPE_CLASSES), ([0.0] * 3, [1.0] * 3))
    splits.info["classes"] = ",".join(SHAPE_CLASSES)
    return splits


class PetMasks(torch.utils.data.Dataset):
    """Oxford-IIIT Pet's images and trimaps (torchvision's layout under ``root``), resized to
    ``size``: the mask is 1 on the pet, 0 on the background and ``ignore`` on the border
    between them (trimap values 1, 2 and 3)."""

    def __init__(self, pets, size: int, stats: Stats, ignore: int) -> None:
        from torchvision import transforms

        self.pets, self.ignore = pets, ignore
        self.image = transforms.Compose(
            [transforms.Resize((size, size)), transforms.ToTensor(), transforms.Normalize(*stats)]
        )
        self.mask = transforms.Resize((size, size), transforms.InterpolationMode.NEAREST)

    def __len__(self) -> int:
        return len(self.pets)

    def __getitem__(self, i: int):
        image, trimap = self.pets[i]
        trimap = torch.from_numpy(np.array(self.mask(trimap), dtype=np.int64))
        mask = torch.full_like(trimap, self.ignore)
        mask[trimap == 1], mask[trimap == 2] = 1, 0
        return self.image(image.convert("RGB")), mask


@DATASETS.register("oxford_pet", task="segmentation", check=positive("image_size"))
def oxford_pet(
    cfg: DatasetConfig,
    *,
    root: str = "data",
    download: bool = False,
    image_size: int = 64,
    ignore_index: int = 255,
) -> Splits:
    """Oxford-IIIT Pet for segmentation (pet, background; the border ignored), read from the
    files torchvision keeps under ``root/oxford-iiit-pet`` (images/, annotations/trimaps/,
    annotations/trainval.txt and test.txt): trainval trains, test validates; fetched there by
    ``dataset.download=true`` (about 800 MB)."""
    from torchvision import datasets

    where = Path(root).expanduser().resolve() / "oxford-iiit-pet"
    stats = (cfg.mean, cfg.std) if cfg.mean else IMAGENET_STATS
    try:
        made = [
            datasets.OxfordIIITPet(
                root, split=split, target_types="segmentation", download=download
            )
            for split in ("trainval", "test")
        ]
    except (RuntimeError, FileNotFoundError, OSError) as err:
        raise _missing_files(cfg, root, download, where, err) from None
    train, val = (PetMasks(pets, image_size, stats, ignore_index) for pets in made)
    return Splits(cfg.name, 2, (3, image_size, image_size), train, val)
