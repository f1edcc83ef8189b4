"""engine/data/__init__.py: the DATASETS registry, Splits, and the preload decision: a data
set decoded per item and the same data preloaded give the same batches."""

from __future__ import annotations

import pytest
import torch

from ampsweep.config.schema import ConfigError, Preload
from ampsweep.engine import data
from ampsweep.engine.data.batches import Batches
from unit.engine.data.test_images import dataset, make_image_folder

CPU = torch.device("cpu")


def test_should_preload():
    cfg = dataset("digits")
    in_memory = data.load(cfg)
    assert data.should_preload(cfg, in_memory)
    cfg.preload = Preload.false.value
    assert not data.should_preload(cfg, in_memory)


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
