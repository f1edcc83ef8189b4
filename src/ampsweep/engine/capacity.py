"""The largest batch a run's config really fits on its GPU, found by trying
(``ampsweep capacity``; the search itself is ``measure.capacity.search``).

Each try is one training step of the loop's AMP sequence on a batch of the requested size,
made of the data set's real samples repeated (so any input shape and dtype works). A try that
runs out of CUDA memory is caught, and every tensor it made is released (gradients, the
exception's frames, the allocator's cache) before the next, so one failed try cannot make the
next one fail.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from ampsweep.engine import sharded
from ampsweep.engine.build import Setup
from ampsweep.measure import capacity, memory

Step = Callable[[Setup, int], None]


def batch_of(setup: Setup, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` training samples: the first real batch, repeated as often as needed."""
    x, y = next(iter(setup.train_batches.epoch(0)))
    index = torch.arange(size, device=x.device) % x.shape[0]
    return x[index], y[index]


def probe_step(setup: Setup, size: int) -> None:
    """One training step on ``size`` samples: what a step of that batch needs in memory. The
    loop's steps in the loop's order (autocast around forward and loss, scaled backward,
    unscale, step, update); no clipping or logging, which allocate nothing batch-sized."""
    x, y = batch_of(setup, size)
    model, optimizer, scaler = setup.model, setup.optimizer, setup.scaler
    with setup.policy.autocast():
        loss = setup.objective(model(x), y)  # the run's loss, on fp32 logits
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if setup.device.type == "cuda":
        torch.cuda.synchronize(setup.device)  # an out-of-memory error surfaces here at the latest


def free_memory(setup: Setup) -> None:
    """Release what a try left: gradients, unreachable tensors, the CUDA allocator's cache."""
    setup.optimizer.zero_grad(set_to_none=True)
    torch.clear_autocast_cache()
    gc.collect()
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()


class Probe:
    """``fits(batch)`` for the search: one step, True unless it ran out of CUDA memory (any
    other error is a real one and propagates); memory is freed after every try."""

    def __init__(self, setup: Setup, step: Step = probe_step, free=free_memory):
        self.setup, self.step, self.free = setup, step, free

    def __call__(self, size: int) -> bool:
        try:
            self.step(self.setup, size)
            return True
        except torch.cuda.OutOfMemoryError:
            return False  # the exception (and the frames holding its tensors) ends here
        finally:
            self.free(self.setup)


def largest_batch(
    setup: Setup, limit: int, step: Step = probe_step, free=free_memory
) -> capacity.Search:
    """The largest batch (``<= limit``) whose training step fits, starting the search at
    ``trainer.batch_size``. The optimizer's state exists from its first step on, so a
    one-sample step first makes it part of every try, as it is of every step but the first."""
    probe = Probe(setup, step, free)
    # What exists before the search (modules, the model, the data) is no try's garbage: frozen,
    # the collection after every try skips it (else each try's collection scans every object
    # of torch, MLflow and Hydra again). Unfrozen after, unless the process had frozen objects
    # before (the test suite does): then the model and data stay frozen until it ends, which
    # only keeps the cycle collector from scanning them (reference counting still frees them).
    frozen_before = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        if not probe(1):
            return capacity.Search(0, [(1, False)])
        start = min(setup.cfg.trainer.batch_size, limit)
        return capacity.search(probe, start, limit)
    finally:
        if not frozen_before:
            gc.unfreeze()


def per_rank(cfg) -> bool:
    """An FSDP configuration over several ranks: predicted per rank, never searched (one
    process cannot hold what a rank of the sharded group holds)."""
    return sharded.wanted(cfg) and cfg.trainer.nproc > 1


def prediction(setup: Setup, budget: float | None) -> dict[str, float]:
    """What the run's own measurements predict (``measure.memory.capacity_metrics``), for
    ``budget`` bytes when given, else for the GPU's memory. Measured after one step, so that the
    optimizer's state is counted."""
    probe_step(setup, 1)
    x, y = batch_of(setup, setup.cfg.trainer.batch_size)
    held = None  # FSDP over trainer.nproc ranks: what one rank would hold
    if per_rank(setup.cfg):
        held = sharded.predicted_held(setup.model, setup.optimizer, setup.cfg)
    out = memory.capacity_metrics(
        setup.model, setup.optimizer, x, y, setup.policy, setup.objective, held=held
    )
    free_memory(setup)
    # The activations at the run's batch, where the measurement gives only their slope: the
    # bytes saved for backward beyond the batch-independent autocast cache
    per_sample = out[capacity.BYTES_PER_SAMPLE]
    activations = per_sample * setup.cfg.trainer.batch_size / capacity.MIB
    out.setdefault(capacity.part_metric("activations"), activations)
    if budget:
        out[capacity.BUDGET_GIB] = budget / capacity.GIB
        model_bytes = out[capacity.MODEL_MIB] * capacity.MIB
        predicted = capacity.predict_max_batch(budget, model_bytes, out[capacity.BYTES_PER_SAMPLE])
        if predicted is not None:
            out[capacity.MAX_BATCH_PREDICTED] = predicted
    return out
