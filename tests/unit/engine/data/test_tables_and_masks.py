"""The data sets of the tasks beyond class labels: scikit-learn's diabetes (regression) and
breast cancer (binary) tables, the synthetic shapes masks, and Oxford-IIIT Pet's trimaps read
from files written here in torchvision's layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ampsweep.config import compose
from ampsweep.config.schema import ConfigError
from ampsweep.engine import data


def load(*overrides: str) -> data.Splits:
    cfg = compose.load(list(overrides))
    return data.load(cfg.dataset, cfg.task.name)


def test_diabetes_gives_one_standardised_float_target_per_row():
    s = load("dataset=diabetes", "model=mlp")
    (x, y), (_, yv) = s.train, s.val
    assert (s.num_classes, s.input_shape) == (1, (10,))
    assert (len(y), len(yv)) == (354, 88) and y.shape == (354, 1) and y.dtype == torch.float32
    assert abs(y.mean().item()) < 1e-5 and y.std().item() == pytest.approx(1.0, abs=0.01)
    assert x.mean(dim=0).abs().max() < 1e-5  # features standardised by the training split
    assert 100 < s.info["target_mean"] < 200  # the raw unit, recorded (data.target_mean)
    raw = load("dataset=diabetes", "model=mlp", "dataset.standardize_targets=false")
    assert raw.train[1].min() >= 25 and raw.train[1].max() <= 346


def test_breast_cancer_gives_float_zero_one_targets():
    s = load("dataset=breast_cancer", "model=mlp")
    (x, y), (_, yv) = s.train, s.val
    assert (s.num_classes, s.input_shape, x.dtype) == (1, (30,), torch.float32)
    assert set(y.unique().tolist()) == {0.0, 1.0} and len(y) + len(yv) == 569


def test_shapes_masks_are_fixed_by_the_seed_and_hold_three_classes():
    a, b = load("dataset=shape_masks", "model=unet"), load("dataset=shape_masks", "model=unet")
    x, y = a.train
    assert torch.equal(x, b.train[0]) and torch.equal(y, b.train[1])
    assert (a.num_classes, a.input_shape) == (3, (3, 32, 32))
    assert y.shape == (len(x), 32, 32) and y.dtype == torch.int64
    assert set(y.unique().tolist()) == {0, 1, 2}
    assert a.info["classes"] == "background,square,disc"


def write_pets(root: Path, names: dict[str, list[str]], size: int = 12) -> None:
    """Oxford-IIIT Pet as torchvision keeps it: images/<name>.jpg, annotations/trimaps/<name>.png
    (1 pet, 2 background, 3 border), annotations/<split>.txt ("name class species breed")."""
    base = root / "oxford-iiit-pet"
    (base / "images").mkdir(parents=True)
    (base / "annotations" / "trimaps").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, files in names.items():
        lines = []
        for i, name in enumerate(files):
            pixels = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(base / "images" / f"{name}.jpg")
            trimap = np.full((size, size), 2, dtype=np.uint8)
            trimap[2:8, 2:8], trimap[2:8, 8] = 1, 3
            Image.fromarray(trimap).save(base / "annotations" / "trimaps" / f"{name}.png")
            lines.append(f"{name} {i % 2 + 1} 1 1")
        (base / "annotations" / f"{split}.txt").write_text("\n".join(lines) + "\n")


def test_oxford_pet_reads_torchvisions_files_pet_background_and_the_border_ignored(tmp_path):
    write_pets(tmp_path, {"trainval": ["Abyssinian_1", "beagle_2", "pug_3"], "test": ["pug_4"]})
    s = load("dataset=oxford_pet", "model=unet", f"dataset.root={tmp_path}", "dataset.image_size=8")
    assert (len(s.train), len(s.val), s.num_classes, s.input_shape) == (3, 1, 2, (3, 8, 8))
    x, mask = s.train[0]
    assert x.shape == (3, 8, 8) and mask.shape == (8, 8) and mask.dtype == torch.int64
    assert set(mask.unique().tolist()) <= {0, 1, 255} and (mask == 1).any() and (mask == 0).any()


def test_oxford_pet_without_its_files_is_one_line_saying_where_it_looked(tmp_path):
    with pytest.raises(ConfigError) as err:
        load("dataset=oxford_pet", "model=unet", f"dataset.root={tmp_path}")
    text = str(err.value)
    assert "dataset=oxford_pet: no data under" in text and "oxford-iiit-pet" in text
    assert "\n" not in text
