"""Data sets: the DATASETS registry, and what a loaded data set is (``Splits``).

A data set is one function registered with ``@DATASETS.register(name)`` in a module of this
package (every module here is imported, so a new file registers itself) plus one YAML file
``conf/dataset/<name>.yaml``. The function receives the keys every data set shares as ``cfg``
(``dataset.val_fraction``, ``split_seed``, ``mean``/``std``, ...) and its own settings as
keyword arguments (``dataset.<key>``), and returns ``Splits``: train and validation data, as
in-memory tensors or as torch datasets decoded per item.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

import torch

from ampsweep.config.schema import DatasetConfig, Preload
from ampsweep.engine.registry import Registry

DATASETS = Registry("dataset", provided=("cfg",))


@dataclass
class Splits:
    name: str
    num_classes: int
    input_shape: tuple[int, ...]  # C, H, W for images
    train: tuple[torch.Tensor, torch.Tensor] | torch.utils.data.Dataset
    val: tuple[torch.Tensor, torch.Tensor] | torch.utils.data.Dataset

    @property
    def in_memory(self) -> bool:
        return isinstance(self.train, tuple)


def load(cfg: DatasetConfig) -> Splits:
    return DATASETS.lookup(cfg.name).fn(cfg, **cfg.args)


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


# Every module of this package registers its data sets on import.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
