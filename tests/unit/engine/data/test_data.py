"""engine/data/__init__.py: the DATASETS registry, Splits, the split by val_fraction and
split_seed, and the preload decision: a data set decoded per item and the same data preloaded
give the same batches. A data set from any callable is split, checked, converted and sized up
(classes, input shape, preloaded or read per item) as the built-in data sets are."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ampsweep.config.schema import ConfigError, DatasetConfig, Preload
from ampsweep.engine import data
from ampsweep.engine.data.batches import Batches
from unit.engine.data.test_images import dataset, make_image_folder

CPU = torch.device("cpu")
HERE = __name__


def test_should_preload():
    cfg = dataset("digits")
    in_memory = data.load(cfg)
    assert data.should_preload(cfg, in_memory)
    cfg.preload = Preload.false.value
    assert not data.should_preload(cfg, in_memory)


def test_split_is_disjoint_and_complete():
    train, val = data.split_indices(1797, 0.2, seed=0)
    assert not set(train) & set(val)
    assert sorted([*train, *val]) == list(range(1797))
    assert np.array_equal(data.split_indices(1797, 0.2, seed=0)[1], val)


def test_preload_true_decodes_a_folder_once():
    images = torch.utils.data.TensorDataset(torch.arange(6.0).view(6, 1, 1, 1), torch.arange(6))
    splits = data.Splits("x", 6, (1, 1, 1), images, images)
    cfg = dataset("digits")
    assert not splits.in_memory and not data.should_preload(cfg, splits)  # auto: stream it
    cfg.preload = Preload.true.value
    assert data.should_preload(cfg, splits)
    x, y = data.materialise(images)
    assert torch.equal(y, torch.arange(6)) and x.shape == (6, 1, 1, 1)


def test_an_unknown_data_set_lists_the_choices():
    with pytest.raises(ConfigError, match="dataset.name=imagenet: invalid value: choose one of"):
        data.DATASETS.lookup("imagenet")


def test_imagefolder_preload_true_and_false_give_the_same_batches(tmp_path):
    make_image_folder(tmp_path / "images")
    splits = data.load(dataset("imagefolder", tmp_path / "images", image_size=8))
    streamed = Batches(
        splits.train, 4, CPU, torch.float32, shuffle=True, drop_last=True, seed=3, preload=False
    )
    loaded = Batches(
        data.materialise(splits.train), 4, CPU, torch.float32, shuffle=True, drop_last=True,
        seed=3, preload=True,
    )  # fmt: skip
    for (xa, ya), (xb, yb) in zip(streamed.epoch(1), loaded.epoch(1), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


# ---------------------------------------------------------------- a data set from any callable


class Pairs(torch.utils.data.Dataset):
    """n items (1x2x2 input, label i % k) with no stated number of classes."""

    def __init__(self, n: int, k: int = 3):
        self.n, self.k = n, k

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full((1, 2, 2), float(i), dtype=np.float32), i % self.k


def pairs(n: int = 40):
    return Pairs(n)


def stated(n: int = 40):
    ds = Pairs(n)
    ds.num_classes = 10  # more classes than the labels use: the data set's word wins
    return ds


def pair_of_sets():
    return Pairs(30), Pairs(10)


def tokens(n: int = 12):
    seqs = torch.arange(n * 5).view(n, 5) % 7
    return [(s[:-1], s[1:]) for s in seqs]


def load(target: str, task: str = "classification", **shared) -> data.Splits:
    return data.load(DatasetConfig(name="x", target=f"{HERE}.{target}", **shared), task)


def test_one_data_set_is_split_by_val_fraction_and_split_seed():
    a = load("pairs", val_fraction=0.25, split_seed=3)
    b = load("pairs", val_fraction=0.25, split_seed=3)
    assert a.in_memory and len(a.train[1]) == 30 and len(a.val[1]) == 10
    assert torch.equal(a.val[0], b.val[0])  # the same split every time
    assert not torch.equal(a.val[0], load("pairs", val_fraction=0.25, split_seed=4).val[0])
    seen = torch.cat([a.train[0], a.val[0]])[:, 0, 0, 0].sort().values
    assert torch.equal(seen, torch.arange(40.0))  # every sample once
    assert (a.num_classes, a.input_shape) == (3, (1, 2, 2))  # classes from the labels


def test_a_pair_is_used_as_given_and_a_stated_class_count_wins():
    given = load("pair_of_sets")
    assert len(given.train[1]) == 30 and len(given.val[1]) == 10
    assert load("stated").num_classes == 10


def test_inputs_are_normalised_when_mean_and_std_are_given():
    plain = load("pairs", split_seed=1)
    normalised = load("pairs", split_seed=1, mean=[10.0], std=[2.0])
    assert torch.allclose(normalised.train[0], (plain.train[0] - 10.0) / 2.0)


def test_a_large_data_set_is_read_per_item(monkeypatch):
    monkeypatch.setattr(data, "PRELOAD_MAX_BYTES", 100)  # 40 items x 16 bytes: too large
    splits = load("pairs")
    assert not splits.in_memory and not data.should_preload(DatasetConfig(), splits)
    x, y = splits.train[0]
    assert x.dtype == torch.float32 and y.dtype == torch.long
    assert splits.num_classes == 3  # the labels were read once to count the classes


def test_token_sequences_for_language_modeling():
    splits = load("tokens", "language_modeling")
    x, y = splits.train
    assert x.dtype == torch.long and x.shape[1:] == (4,) and torch.equal(y[:, :-1], x[:, 1:])
    assert splits.num_classes == 7  # the vocabulary, from the largest token


def int_labels():
    return [(torch.arange(4), 1)] * 8


def test_text_needs_token_ids_and_the_next_tokens_as_targets():
    with pytest.raises(ConfigError, match="task=language_modeling needs token ids, got"):
        load("pairs", "language_modeling")  # float inputs
    with pytest.raises(ConfigError, match="needs the next tokens as the label"):
        load("int_labels", "language_modeling")


def prices(n: int = 20):
    """Float targets in the thousands (a regression's), no stated number of outputs."""
    return [(np.full(3, float(i), dtype=np.float32), np.float32([1000.0 * i])) for i in range(n)]


def test_regression_targets_are_numbers_however_large_not_class_indices():
    s = load("prices", "regression")
    assert s.num_classes == 1 and s.in_memory  # one output per target value
    assert float(torch.cat([s.train[1], s.val[1]]).max()) == 19000.0
