"""Data sets: the DATASETS registry, and what a loaded data set is (``Splits``).

A data set is one function registered with ``@DATASETS.register(name)`` in a module of this
package (every module here is imported, so a new file registers itself) plus one YAML file
``conf/dataset/<name>.yaml``. The function receives the keys every data set shares as ``cfg``
(``dataset.val_fraction``, ``split_seed``, ``mean``/``std``, ...) and its own settings as
keyword arguments (``dataset.<key>``), and returns ``Splits``: train and validation data, as
in-memory tensors or as torch datasets decoded per item. A data set may instead be any
callable named by ``dataset._target_`` that returns a map-style torch ``Dataset`` (or a
``(train, val)`` pair of them): see ``engine.data.custom``.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field

import torch

from ampsweep.config.schema import DatasetConfig, Preload
from ampsweep.engine.registry import Registry

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


def load(cfg: DatasetConfig, task: str = "classification") -> Splits:
    """The data a config names: a registered loader, or a ``_target_`` callable's data sets
    checked and converted for ``task``."""
    builder = DATASETS.builder(cfg)
    if builder.target:
        from ampsweep.engine.data.custom import load_target  # custom imports this package

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


# Every module of this package registers its data sets on import.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
