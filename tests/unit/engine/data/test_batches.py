"""engine/data/batches.py: mini-batches in a seeded order that depends only on (seed, epoch),
resumed mid-epoch exactly (preloaded or through DataLoader workers), augmentation on the
device, and the shards of DDP ranks."""

from __future__ import annotations

import pytest
import torch

from ampsweep.config.schema import ConfigError
from ampsweep.engine.data.batches import Augment, Batches, seed_for

CPU = torch.device("cpu")


def indexed_split(n: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose every pixel is the sample's index, so a batch shows which samples it holds."""
    idx = torch.arange(n)
    return idx.float().view(n, 1, 1, 1).expand(n, 1, 4, 4).contiguous(), idx


def batches(split=None, seed: int = 0, preload: bool = True, augment=None, bs: int = 8):
    return Batches(
        split or indexed_split(), bs, CPU, torch.float32, shuffle=True, drop_last=True,
        seed=seed, preload=preload, augment=augment,
    )  # fmt: skip


def order(b: Batches, epoch: int, start: int = 0) -> list[int]:
    return [i for _, y in b.epoch(epoch, start) for i in y.tolist()]


def test_batch_order_depends_only_on_seed_and_epoch():
    first = order(batches(seed=1), 2)
    assert order(batches(seed=1), 2) == first  # a fresh object: same order
    assert order(batches(seed=1), 3) != first
    assert order(batches(seed=2), 2) != first
    assert len(first) == len(set(first)) == 40  # each sample once per epoch


def test_start_resumes_mid_epoch():
    b = batches(seed=1)
    assert order(b, 1, start=2) == order(b, 1)[16:]


def test_start_resumes_mid_epoch_with_augmentation():
    # Resuming must give the same images as the uninterrupted epoch, augmentation included.
    aug = Augment(padding=1, flip=True)
    b = batches(split=(torch.randn(40, 2, 5, 5), torch.arange(40)), seed=1, augment=aug)
    full = [x for x, _ in b.epoch(1)]
    resumed = [x for x, _ in b.epoch(1, start=2)]
    assert len(resumed) == len(full) - 2
    for a, r in zip(full[2:], resumed, strict=True):
        assert torch.equal(a, r)


def test_augmentation_keeps_shapes_and_changes_images():
    split = (torch.randn(40, 3, 6, 6), torch.arange(40))
    plain = [x for x, _ in batches(split).epoch(0)]
    augmented = [x for x, _ in batches(split, augment=Augment(padding=2, flip=True)).epoch(0)]
    assert all(a.shape == p.shape == (8, 3, 6, 6) for a, p in zip(augmented, plain, strict=True))
    assert any(not torch.equal(a, p) for a, p in zip(augmented, plain, strict=True))
    again = [x for x, _ in batches(split, augment=Augment(padding=2, flip=True)).epoch(0)]
    assert all(torch.equal(a, b) for a, b in zip(augmented, again, strict=True))


def test_flip_only_mirrors():
    x = torch.randn(64, 1, 3, 5)
    out = Augment(flip=True)(x, torch.Generator().manual_seed(0))
    same = (out == x).flatten(1).all(1)
    mirrored = (out == x.flip(3)).flatten(1).all(1)
    assert bool((same | mirrored).all()) and mirrored.any() and same.any()


@pytest.mark.parametrize("augment", [None, Augment(padding=1, flip=True)])
def test_preload_true_and_false_give_the_same_batches(augment):
    split = (torch.randn(40, 2, 5, 5), torch.arange(40))
    on = batches(split, preload=True, augment=augment)
    off = batches(split, preload=False, augment=augment)
    for (xa, ya), (xb, yb) in zip(on.epoch(2), off.epoch(2), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_validation_batches_keep_the_tail():
    b = Batches(
        indexed_split(10), 4, CPU, torch.float32, shuffle=False, drop_last=False, seed=0,
        preload=True,
    )  # fmt: skip
    assert len(b) == 3 and order(b, 0) == list(range(10))


def test_start_resumes_mid_epoch_through_dataloader_workers():
    # preload=false with worker processes: batch i of a resumed epoch is batch i of the whole.
    split = (torch.randn(40, 2, 5, 5), torch.arange(40))
    streamed = Batches(
        split, 8, CPU, torch.float32, shuffle=True, drop_last=True, seed=1, preload=False,
        num_workers=2, augment=Augment(padding=1, flip=True),
    )  # fmt: skip
    full = list(streamed.epoch(1))
    resumed = list(streamed.epoch(1, start=2))
    assert len(full) == 5 and len(resumed) == 3
    for (xa, ya), (xb, yb) in zip(full[2:], resumed, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_seeds_differ_for_every_epoch_and_batch():
    seeds = {seed_for(0, epoch, batch) for epoch in range(50) for batch in range(50)}
    assert len(seeds) == 2500
    assert seed_for(3) == 3 and seed_for(3, 1) != seed_for(4, 1)


# ---------------------------------------------------------------- DDP shards


def _batches(n, batch_size, rank=0, world=1, shuffle=True, drop_last=True):
    x = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1)
    y = torch.arange(n)
    return Batches(
        (x, y),
        batch_size,
        CPU,
        torch.float32,
        shuffle=shuffle,
        drop_last=drop_last,
        seed=3,
        preload=True,
        rank=rank,
        world_size=world,
    )


@pytest.mark.parametrize("epoch", [0, 1])
def test_ranks_together_see_the_single_process_batch(epoch):
    single = [y.tolist() for _, y in _batches(103, 8).epoch(epoch)]
    shards = [[y.tolist() for _, y in _batches(103, 4, r, 2).epoch(epoch)] for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == len(single) == 103 // 8
    for i, batch in enumerate(single):
        assert sorted(shards[0][i] + shards[1][i]) == sorted(batch)
        assert not set(shards[0][i]) & set(shards[1][i])
    # reshuffled each epoch, the same way on every rank
    other = [y.tolist() for _, y in _batches(103, 4, 0, 2).epoch(epoch + 1)]
    assert other != shards[0]


def test_validation_shards_cover_the_split_once():
    seen = []
    for r in range(3):
        for _, y in _batches(10, 4, r, 3, shuffle=False, drop_last=False).epoch(0):
            seen += y.tolist()
    assert sorted(seen) == list(range(10))


def test_too_small_shard_names_the_key():
    with pytest.raises(ConfigError, match=r"trainer.batch_size=8 .*4 per process for 2"):
        _batches(9, 8, 0, 2)
