"""Data sets: the DATASETS registry, and what a loaded data set is (``Splits``).

A data set is one function registered with ``@DATASETS.register(name)`` in a module of this
package (every module here is imported, so a new file registers itself) plus one YAML file
``conf/dataset/<name>.yaml``. The function receives the keys every data set shares as ``cfg``
(``dataset.val_fraction``, ``split_seed``, ``mean``/``std``, ...) and its own settings as
keyword arguments (``dataset.<key>``), and returns ``Splits``: train and validation data, as
in-memory tensors or as torch datasets decoded per item.

A data set may instead be any callable named by ``dataset._target_``
(``dataset._target_: mypkg.data.make_data``; ``load_target``). The callable (called with the
section's other keys) returns a map-style torch ``Dataset`` of ``(input, label)`` pairs, split
here into train and validation by ``dataset.val_fraction`` and ``dataset.split_seed``, or a
``(train, val)`` pair of them. Inputs may be tensors, NumPy arrays
or numbers; a label is an integer (classification), a sequence of token ids (language
modeling), or what another task takes (a float, 0/1, a multi-hot vector, a mask). The input
shape comes from the first item; the number of classes from the data set's ``num_classes``,
``classes`` or ``vocab_size`` attribute, else from the labels (for regression, binary and
multi-label targets: the values per target, the model's outputs).

Inputs are normalised only when ``dataset.mean``/``std`` are given (the keys every data set
shares: a split, augmentation and preloading apply as for the built-in data sets). A data set
small enough (``PRELOAD_MAX_BYTES``) is decoded once into tensors and, as the
built-in ones, preloaded onto the device (``dataset.preload=false`` keeps it per item); a
larger one is read through the DataLoader path (``trainer.num_workers``, pinned memory).
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from dataclasses import dataclass, field
from numbers import Integral

import numpy as np
import torch

from ampsweep.config.schema import ConfigError, DatasetConfig, Preload
from ampsweep.engine.registry import Builder, Registry

# A registered loader gets the shared keys as ``cfg``; a _target_ callable only its own keys.
DATASETS = Registry("dataset", provided=("cfg",), target_provided=())


@dataclass
class Splits:
    name: str
    num_classes: int  # for token sequences: the vocabulary size
    input_shape: tuple[int, ...]  # C, H, W for images; (T,) for token sequences
    train: tuple[torch.Tensor, torch.Tensor] | torch.utils.data.Dataset
    val: tuple[torch.Tensor, torch.Tensor] | torch.utils.data.Dataset
    info: dict = field(default_factory=dict)  # facts recorded with the run (data.<key> tags)
    # numbers about the data itself, recorded as metrics (e.g. data/unigram_perplexity)
    reference: dict[str, float] = field(default_factory=dict)

    @property
    def in_memory(self) -> bool:
        return isinstance(self.train, tuple)


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation indices of ``n`` samples: a fixed permutation of ``seed``."""
    order = np.random.default_rng(seed).permutation(n)
    n_val = max(1, int(round(n * val_fraction)))
    return order[n_val:], order[:n_val]


def load(cfg: DatasetConfig, task: str = "classification") -> Splits:
    """The data a config names: a registered loader, or a ``_target_`` callable's data sets
    checked and converted for ``task``."""
    builder = DATASETS.builder(cfg)
    if builder.target:
        return load_target(cfg, builder, task)
    return builder.fn(cfg, **cfg.args)


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


def sample_inputs(split, n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` samples of a split as a batch (for the model's dry run)."""
    if isinstance(split, tuple):
        return split[0][:n], split[1][:n]
    items = [split[i] for i in range(min(n, len(split)))]
    return torch.stack([x for x, _ in items]), torch.stack([torch.as_tensor(y) for _, y in items])


# ---------------------------------------------------------------- a data set from any callable


PRELOAD_MAX_BYTES = 512 * 2**20
CHECKED_ITEMS = 4  # items of each split checked up front (the rest are converted as read)


class Items(torch.utils.data.Dataset):
    """A user's data set with each item converted to ``(input tensor, label tensor)``: float32
    inputs for classification (normalised by ``dataset.mean``/``std`` when they are given),
    int64 token ids for language modeling; int64 labels."""

    def __init__(self, dataset, task: str, label: str, mean=(), std=()):
        self.dataset, self.task, self.label = dataset, task, label
        self.mean, self.std = list(mean), list(std)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        x, y = convert(self.dataset[i], self.task, f"{self.label}: item {i}")
        if self.mean and x.is_floating_point():
            if len(self.mean) not in (1, x.shape[0]):
                raise ConfigError(
                    f"dataset.mean has {len(self.mean)} values but the inputs have {x.shape[0]} "
                    "channels: give one value per channel"
                )
            shape = (-1,) + (1,) * (x.dim() - 1)
            x = (x - torch.tensor(self.mean).view(shape)) / torch.tensor(self.std).view(shape)
        return x, y


def convert(item, task: str, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise ConfigError(
            f"{where} is a {type(item).__name__}, not an (input, label) pair: return "
            "(input, label) from the data set's __getitem__"
        )
    x, y = item
    try:
        x = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x)
    except Exception:
        raise ConfigError(
            f"{where}: the input is a {type(x).__name__}, not tensor-like: return a tensor or "
            "an array (for images, e.g. torchvision.transforms.ToTensor())"
        ) from None
    text = task == "language_modeling"
    if text and x.is_floating_point():
        raise ConfigError(f"{where}: task=language_modeling needs token ids, got {x.dtype}")
    x = x.long() if text else x.float()
    if text:
        y = torch.as_tensor(y)
        if y.is_floating_point() or y.shape != x.shape:
            raise ConfigError(
                f"{where}: task=language_modeling needs the next tokens as the label (integer "
                f"ids of the input's shape {tuple(x.shape)}), got {y.dtype} {tuple(y.shape)}"
            )
        return x, y.long()
    if task != "classification":  # numbers, 0/1, multi-hot or a mask: the task checks them
        return x, torch.as_tensor(np.asarray(y) if not isinstance(y, torch.Tensor) else y)
    if isinstance(y, torch.Tensor | np.ndarray) and y.ndim == 0:
        y = y.item()
    if isinstance(y, bool) or not isinstance(y, Integral) or y < 0:
        raise ConfigError(
            f"{where}: the label {y!r} is not a class index (an int >= 0) for task="
            "classification: use task=regression to predict numbers (task=binary for 0/1, "
            "task=language_modeling for token sequences)"
        )
    return x, torch.tensor(int(y))


def load_target(cfg: DatasetConfig, builder: Builder, task: str) -> Splits:
    made = _call(builder, cfg)
    if isinstance(made, tuple | list) and len(made) == 2 and all(map(_map_style, made)):
        train, val = made
    elif _map_style(made):
        tr, va = split_indices(len(made), cfg.val_fraction, cfg.split_seed)
        train = torch.utils.data.Subset(made, tr.tolist())
        val = torch.utils.data.Subset(made, va.tolist())
    else:
        raise ConfigError(
            f"{builder.label}: returned a {type(made).__name__}, not a map-style torch Dataset "
            "(with __len__ and __getitem__) or a (train, val) pair of them"
        )
    label = builder.label
    for name, split in (("train", train), ("val", val)):
        if len(split) == 0:
            raise ConfigError(f"{label}: the {name} split is empty: give it samples")
    items = [
        Items(s, task, f"{label} ({n} split)", cfg.mean, cfg.std)
        for n, s in (("train", train), ("val", val))
    ]
    first = [items[0][i] for i in range(min(CHECKED_ITEMS, len(items[0])))]
    first += [items[1][i] for i in range(min(CHECKED_ITEMS, len(items[1])))]
    shapes = {tuple(x.shape) for x, _ in first}
    if len(shapes) > 1:
        raise ConfigError(
            f"{label}: inputs of different shapes {sorted(shapes)}: make every input the same "
            "shape (resize or pad them)"
        )
    shape = first[0][0].shape
    stated = _stated_classes(made if _map_style(made) else train, task)
    size = (len(items[0]) + len(items[1])) * math.prod(shape) * 4
    preload = Preload(cfg.preload) != Preload.false and size <= PRELOAD_MAX_BYTES
    splits = [materialise(s) for s in items] if preload else items
    numbers = task in ("regression", "binary", "multilabel")  # targets, not class indices
    if stated is None and numbers:
        stated = max(1, first[0][1].numel())  # the model's outputs: one per target value
    if stated is None:
        stated = 1 + max(int(_labels(s).max()) for s in splits)
    elif preload and not numbers:
        top = max(int(_labels(s).max()) for s in splits)
        if top >= stated:
            raise ConfigError(
                f"{label}: a label is {top} but the data set says it has {stated} classes (its "
                "num_classes/classes/vocab_size attribute): make them agree"
            )
    return Splits(cfg.name, stated, tuple(shape), splits[0], splits[1])


def _call(builder: Builder, cfg: DatasetConfig):
    try:
        return builder.fn(**cfg.args)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(
            f"{builder.label}: building the data set failed ({type(err).__name__}: "
            f"{' '.join(str(err).split())}): check its arguments"
        ) from None


def _map_style(obj) -> bool:
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__") and not isinstance(obj, str)


def _stated_classes(dataset, task: str) -> int | None:
    """What the data set says of its classes (or vocabulary), looking through Subsets."""
    while isinstance(dataset, torch.utils.data.Subset):
        dataset = dataset.dataset
    names = ("vocab_size", "num_classes") if task == "language_modeling" else ("num_classes",)
    for name in names:
        value = getattr(dataset, name, None)
        if isinstance(value, Integral) and int(value) > 0:
            return int(value)
    classes = getattr(dataset, "classes", None)
    return len(classes) if task != "language_modeling" and classes else None


def _labels(split) -> torch.Tensor:
    """Every label of a split (a pass over its items when it is not in memory)."""
    if isinstance(split, tuple):
        return split[1]
    return torch.stack([split[i][1].max() for i in range(len(split))])


# Every module of this package registers its data sets on import.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
