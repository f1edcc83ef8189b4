"""A data set of one's own whose targets are large: house prices in dollars.

Synthetic, so that it needs no download: eight standardised features per house and a price of
about 100,000 to 1,000,000 dollars that depends on them (log-linearly, with one interaction
and some noise). Prices as they come are far beyond fp16's largest value (65,504), which is
what ``ampsweep doctor`` finds in a model's head (docs/doctor.md);
``standardize_targets=true`` gives them as (y - mean) / std of the training split.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import TensorDataset

FEATURES = 8


def prices(
    num_samples: int = 1000,
    seed: int = 0,
    val_share: float = 0.2,
    standardize_targets: bool = False,
) -> tuple[TensorDataset, TensorDataset]:
    """``num_samples`` houses, the last ``val_share`` of them held out for validation (the
    split is the data set's own, so that the training split's statistics standardise the
    targets). A target is one float per house, shape (1,)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, FEATURES, generator=g)
    weights = torch.linspace(-0.3, 0.5, FEATURES)
    log_price = (
        math.log(300_000.0)
        + x @ weights / 2
        + 0.1 * torch.tanh(x[:, 0] * x[:, 1])
        + 0.05 * torch.randn(num_samples, generator=g)
    )
    y = log_price.exp().unsqueeze(1)
    n_train = num_samples - max(1, round(num_samples * val_share))
    if standardize_targets:
        mean, std = y[:n_train].mean(), y[:n_train].std()
        y = (y - mean) / std
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])
