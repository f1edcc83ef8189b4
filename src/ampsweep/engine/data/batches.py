"""Mini-batches of a split, in a seeded order that depends only on (seed, epoch).

Data that fits in memory is preloaded onto the device once and batches are indexed there
(no host-to-device copy per step); otherwise a DataLoader with pinned memory feeds
non-blocking copies. Augmentation runs on the device in both cases. A run is repeatable, and a
resumed run sees the same order, because nothing here draws from a global generator.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ampsweep.config.schema import ConfigError


def seed_for(seed: int, *parts: int) -> int:
    """A generator seed for (seed, epoch[, batch]): one formula for every seeded order."""
    value = seed
    for part, prime in zip(parts, (1_000_003, 1_000_033), strict=False):
        value = value * prime + part
    return value


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch: a function of (seed, epoch) only."""
    g = torch.Generator().manual_seed(seed_for(seed, epoch))
    return torch.randperm(n, generator=g)


@dataclass
class Augment:
    """Random crop (zero padding) and horizontal flip, applied to a batch on its device."""

    padding: int = 0
    flip: bool = False

    @property
    def active(self) -> bool:
        return self.padding > 0 or self.flip

    def __call__(self, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        b, _, h, w = x.shape
        if self.padding:
            p = self.padding
            padded = torch.nn.functional.pad(x, (p, p, p, p))
            dy = torch.randint(0, 2 * p + 1, (b, 1), generator=g, device=g.device).to(x.device)
            dx = torch.randint(0, 2 * p + 1, (b, 1), generator=g, device=g.device).to(x.device)
            rows = (torch.arange(h, device=x.device) + dy)[:, None, :, None]  # b,1,h,1
            cols = (torch.arange(w, device=x.device) + dx)[:, None, None, :]  # b,1,1,w
            bi = torch.arange(b, device=x.device)[:, None, None, None]
            ci = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
            x = padded[bi, ci, rows, cols]
        if self.flip:
            mask = torch.rand(b, generator=g, device=g.device).to(x.device) < 0.5
            x = torch.where(mask[:, None, None, None], x.flip(3), x)
        return x


class Batches:
    """Mini-batches of one split, in the seeded order of each epoch.

    ``preload``: tensors live on the device and batches are gathered there. Otherwise a
    DataLoader (pinned memory, ``num_workers``) yields CPU batches copied non-blocking.
    """

    def __init__(
        self,
        split,
        batch_size: int,
        device: torch.device,
        dtype: torch.dtype,
        *,
        shuffle: bool,
        drop_last: bool,
        seed: int,
        preload: bool,
        num_workers: int = 0,
        augment: Augment | None = None,
        channels_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.batch_size, self.device, self.dtype = batch_size, device, dtype
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.drop_last, self.seed = shuffle, drop_last, seed
        self.augment = augment if augment and augment.active else None
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.preload = preload
        if isinstance(split, tuple) and preload:
            x, y = split
            self.x = self._place(x.to(device))
            self.y = y.to(device)
            self.n = len(y)
        else:
            dataset = torch.utils.data.TensorDataset(*split) if isinstance(split, tuple) else split
            self.dataset, self.n, self.num_workers = dataset, len(dataset), num_workers
        # Under DDP each rank reads every world_size-th sample of the epoch's order (like
        # torch's DistributedSampler); training drops the tail so all ranks take as many steps.
        shares = self.n // world_size if drop_last else len(range(rank, self.n, world_size))
        self.shard_n = shares
        if self.n == 0 or (drop_last and shares < batch_size):
            per_rank = f" ({shares} per process for {world_size})" if world_size > 1 else ""
            raise ConfigError(
                f"trainer.batch_size={batch_size} is larger than the {self.n} training samples"
                f"{per_rank}: lower trainer.batch_size"
            )

    def __len__(self) -> int:
        full, rest = divmod(self.shard_n, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches ``start``.. of ``epoch`` (``start`` > 0 resumes mid-epoch)."""
        order = epoch_order(self.n, self.seed, epoch) if self.shuffle else torch.arange(self.n)
        if self.world_size > 1:
            # Every rank draws the same (seed, epoch) permutation and keeps its own slice: the
            # ranks' batch i together are the single-process batch i of a world_size-times
            # larger batch size.
            order = order[: self.shard_n * self.world_size if self.drop_last else self.n]
            order = order[self.rank :: self.world_size]
        order = order[: len(self) * self.batch_size] if self.drop_last else order
        g = torch.Generator(device=self.device) if self.augment else None
        if self.preload:
            order = order.to(self.device)
            for i in range(start, len(self)):
                idx = order[i * self.batch_size : (i + 1) * self.batch_size]
                yield self._finish(self.x[idx], g, epoch, i), self.y[idx]
            return
        batches = [
            order[i * self.batch_size : (i + 1) * self.batch_size].tolist()
            for i in range(start, len(self))
        ]
        loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_sampler=batches,
            num_workers=self.num_workers,
            pin_memory=self.device.type == "cuda",
            persistent_workers=False,
            # Its own generator: the loader's worker seed must not draw from the global RNG,
            # or a run resumed mid-epoch would continue from a different global RNG state.
            generator=torch.Generator().manual_seed(seed_for(self.seed, epoch)),
        )
        for i, (x, y) in enumerate(loader, start):
            x = self._place(x.to(self.device, non_blocking=True))
            yield self._finish(x, g, epoch, i), y.to(self.device, non_blocking=True)

    def _place(self, x: torch.Tensor) -> torch.Tensor:
        """Inputs in the run's dtype and memory format; token ids stay integers, and only
        image batches (4-D) take channels_last."""
        if x.is_floating_point():
            x = x.to(self.dtype)
        return x.contiguous(memory_format=self.memory_format) if x.dim() == 4 else x

    def _finish(self, x: torch.Tensor, g: torch.Generator | None, epoch: int, i: int):
        if g is None or self.augment is None:  # (a generator is made only to augment)
            return x
        # Seeded per batch from (seed, epoch, batch index), not once per epoch: a run resumed
        # at batch ``start`` then augments each batch exactly as the uninterrupted run did.
        g.manual_seed(seed_for(self.seed, epoch, i))
        return self.augment(x, g)
