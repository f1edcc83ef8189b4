"""engine.fingerprint: what data a run saw, named, sourced and digested over all of its content."""

from __future__ import annotations

import shutil

import pytest
import torch

from ampsweep.config.schema import DatasetConfig
from ampsweep.engine import fingerprint
from ampsweep.engine.data import Splits, images


@pytest.fixture(autouse=True)
def _no_memo(monkeypatch):
    monkeypatch.setattr(fingerprint, "_digests", {})  # each test starts with an empty memo


def _splits(x: torch.Tensor, y: torch.Tensor) -> Splits:
    return Splits("toy", 10, tuple(x.shape[1:]), (x[:80], y[:80]), (x[80:], y[80:]))


def test_digits_train_and_val_are_named_sourced_and_digested():
    cfg = DatasetConfig()
    train, val = fingerprint.describe(cfg, images.digits(cfg))
    assert (train.name, train.split, val.name, val.split) == (
        "digits-train", "train", "digits-val", "val",
    )  # fmt: skip
    assert train.source_type == "local"
    assert train.source["uri"].endswith("sklearn/datasets/data/digits.csv.gz")
    assert (train.rows, val.rows) == (1438, 359)
    assert train.features == ("float32", (1, 8, 8)) and train.targets == ("int64", ())
    assert train.digest != val.digest and len(train.digest) == fingerprint.DIGEST_CHARS
    # the same data loaded again (a second run) gets the same digests, computed afresh
    fingerprint._digests.clear()
    again = fingerprint.describe(cfg, images.digits(cfg))
    assert [d.digest for d in again] == [train.digest, val.digest]


def test_a_change_beyond_the_first_ten_thousand_values_changes_the_digest():
    """MLflow's own digest of an array reads its first 10,000 values only."""
    x, y = torch.zeros(100, 1, 16, 16), torch.zeros(100, dtype=torch.long)  # 25,600 values
    before = fingerprint.describe(DatasetConfig(name="synthetic"), _splits(x, y))
    x2 = x.clone()
    x2[-1, 0, -1, -1] = 1.0  # the very last value of the validation inputs
    fingerprint._digests.clear()
    after = fingerprint.describe(DatasetConfig(name="synthetic"), _splits(x2, y))
    assert after[0].digest == before[0].digest  # the training split did not change
    assert after[1].digest != before[1].digest


def test_a_sweep_hashes_each_split_once(monkeypatch):
    hashed = []
    real = fingerprint._hash_tensors
    monkeypatch.setattr(fingerprint, "_hash_tensors", lambda h, ts: hashed.append(1) or real(h, ts))
    cfg = DatasetConfig()
    digests = {tuple(d.digest for d in fingerprint.describe(cfg, images.digits(cfg)))
               for _ in range(6)}  # fmt: skip
    assert len(digests) == 1
    assert len(hashed) == 2  # train and validation, once each, for six jobs


def test_generated_data_is_sourced_from_its_loader_and_settings():
    cfg = DatasetConfig(name="synthetic", args={"num_samples": 64, "image_size": 8})
    kind, source = fingerprint.source_of(cfg)
    assert kind == "code"
    assert source["tags"]["loader"] == "ampsweep.engine.data.images.synthetic"
    assert source["tags"]["num_samples"] == 64 and source["tags"]["split_seed"] == 0


def _image_folder(root):
    from PIL import Image

    for label in ("cat", "dog"):
        (root / label).mkdir(parents=True)
        for i in range(4):
            colour = (40 * i, 255 - 40 * i, 7) if label == "cat" else (9, 40 * i, 200)
            Image.new("RGB", (6, 6), colour).save(root / label / f"{i}.png")


def test_an_image_folder_is_digested_by_file_names_labels_and_sizes(tmp_path):
    """Per-item data sets read from files: a copy elsewhere has the same digest (no paths or
    modification times in it); a file whose content (and size) changes does not."""
    first, second = tmp_path / "a", tmp_path / "b"
    _image_folder(first)
    shutil.copytree(first, second)  # new modification times, another absolute path
    cfg_a = DatasetConfig(name="imagefolder", args={"root": str(first), "image_size": 6})
    cfg_b = DatasetConfig(name="imagefolder", args={"root": str(second), "image_size": 6})
    a = fingerprint.describe(cfg_a, images.imagefolder(cfg_a, root=str(first), image_size=6))
    b = fingerprint.describe(cfg_b, images.imagefolder(cfg_b, root=str(second), image_size=6))
    assert [d.digest for d in a] == [d.digest for d in b]
    assert a[0].source == {"uri": str(first.resolve())} and a[0].source_type == "local"
    assert a[0].features == ("float32", (3, 6, 6)) and a[0].rows + a[1].rows == 8

    from PIL import Image

    victim = next(p for p in sorted(second.rglob("*.png")))
    noise = Image.frombytes("RGB", (16, 16), bytes(range(256)) * 3)
    noise.save(victim)  # a different image, a larger file
    assert victim.stat().st_size != (first / victim.relative_to(second)).stat().st_size
    fingerprint._digests.clear()
    c = fingerprint.describe(cfg_b, images.imagefolder(cfg_b, root=str(second), image_size=6))
    assert [d.digest for d in c] != [d.digest for d in a]


def test_a_per_item_data_set_without_files_is_read_and_hashed_once():
    x, y = torch.randn(10, 3), torch.arange(10) % 2
    items = torch.utils.data.TensorDataset(x, y)
    split = torch.utils.data.Subset(items, list(range(8)))
    one = fingerprint.digest(split, ("train", "k"))
    x2 = x.clone()
    x2[7, 2] += 1
    other = torch.utils.data.Subset(torch.utils.data.TensorDataset(x2, y), list(range(8)))
    fingerprint._digests.clear()
    assert fingerprint.digest(other, ("train", "k")) != one
