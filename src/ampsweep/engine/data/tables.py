"""Tables scikit-learn ships (no download): ``diabetes`` (regression) and ``breast_cancer``
(binary classification), each row a vector of features standardised by the training split's
statistics, split into train and validation by ``dataset.split_seed``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ampsweep.config.schema import DatasetConfig
from ampsweep.engine.data import DATASETS, Splits, split_indices


def _sklearn_file(name: str) -> Path:
    import sklearn.datasets

    return Path(sklearn.datasets.__file__).parent / "data" / name


def _standardised(x: np.ndarray, train: np.ndarray) -> torch.Tensor:
    mean, std = x[train].mean(axis=0), x[train].std(axis=0)
    return torch.from_numpy(((x - mean) / np.where(std > 0, std, 1.0)).astype(np.float32))


def _splits(cfg: DatasetConfig, x: np.ndarray, y: torch.Tensor, outputs: int, info) -> Splits:
    tr, va = split_indices(len(y), cfg.val_fraction, cfg.split_seed)
    inputs = _standardised(x, tr)
    shape = tuple(inputs.shape[1:])
    return Splits(cfg.name, outputs, shape, (inputs[tr], y[tr]), (inputs[va], y[va]), info=info)


@DATASETS.register(
    "diabetes", task="regression", source=lambda: _sklearn_file("diabetes_target.csv.gz")
)
def diabetes(cfg: DatasetConfig, *, standardize_targets: bool = True) -> Splits:
    """442 patients, 10 features; the target is disease progression after a year (25..346),
    one float per row of shape (1,). ``standardize_targets``: as (y - mean) / std of the
    training split, so val/rmse is in standard deviations; false keeps the raw values (large
    enough to show where fp16 needs care)."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True, scaled=False)
    tr, _ = split_indices(len(y), cfg.val_fraction, cfg.split_seed)
    info = {"target_mean": float(y[tr].mean()), "target_std": float(y[tr].std())}
    if standardize_targets:
        y = (y - info["target_mean"]) / info["target_std"]
    targets = torch.from_numpy(y.astype(np.float32)).unsqueeze(1)
    return _splits(cfg, x, targets, 1, info)


@DATASETS.register(
    "breast_cancer", task="binary", source=lambda: _sklearn_file("breast_cancer.csv")
)
def breast_cancer(cfg: DatasetConfig) -> Splits:
    """569 tumours, 30 features; the target is 1 for benign, 0 for malignant (float)."""
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    return _splits(cfg, x, torch.from_numpy(y.astype(np.float32)), 1, {})
