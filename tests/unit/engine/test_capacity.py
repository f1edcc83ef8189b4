"""The largest-batch search on a real (CPU) setup, with an out-of-memory error injected at a
known batch size: every try is a real training step until the injected limit."""

from __future__ import annotations

import gc

import pytest
import torch

from ampsweep.config.compose import load
from ampsweep.engine import capacity
from ampsweep.engine.build import build
from ampsweep.measure import capacity as cap


@pytest.fixture
def setup(quick):
    cfg = load([*quick, "model=mlp", "trainer.batch_size=16", "precision=bf16", "tracking=none"])
    return build(cfg)


class InjectedDevice:
    """Real training steps up to ``largest`` samples; beyond, CUDA's out-of-memory error,
    raised after the step has allocated (as a real one is, mid-backward)."""

    def __init__(self, largest: int):
        self.largest, self.tries, self.freed = largest, [], []

    def step(self, setup, size: int) -> None:
        self.tries.append(size)
        if size > self.largest:
            x, y = capacity.batch_of(setup, size)
            setup.model(x).float().sum().backward()  # gradients left behind
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected at {size})")
        capacity.probe_step(setup, size)

    def free(self, setup) -> None:
        self.freed.append(all(p.grad is None for p in setup.model.parameters()))
        capacity.free_memory(setup)


def test_the_search_finds_the_injected_limit_with_real_steps(setup):
    device = InjectedDevice(largest=37)
    before = [p.detach().clone() for p in setup.model.parameters()]
    gc.unfreeze()  # what this test process froze after collection
    try:
        found = capacity.largest_batch(setup, limit=1000, step=device.step, free=device.free)
        # the objects frozen for the search are collectable again
        assert gc.get_freeze_count() == 0
    finally:
        gc.freeze()
    assert found.largest == 37 and found.first_failure == 38
    # a one-sample step first (the optimizer's state), then from trainer.batch_size=16
    assert device.tries == [1, 16, 32, 64, 48, 40, 36, 38, 37]
    # memory freed after every try; the failed ones had left their gradients behind
    assert device.freed == [size <= 37 for size in device.tries]
    assert all(p.grad is None for p in setup.model.parameters())  # nothing left behind
    after = list(setup.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))  # real steps


def test_any_other_error_is_not_taken_for_out_of_memory(setup):
    def broken(setup, size):
        raise RuntimeError("a real bug")

    with pytest.raises(RuntimeError, match="a real bug"):
        capacity.largest_batch(setup, limit=100, step=broken)


def test_nothing_fits(setup):
    device = InjectedDevice(largest=0)
    assert gc.get_freeze_count() > 0  # this test process froze its imports after collection
    found = capacity.largest_batch(setup, limit=100, step=device.step, free=device.free)
    assert found.largest == 0 and device.tries == [1]
    assert gc.get_freeze_count() > 0  # what was frozen before the search stays so


def test_batches_repeat_the_real_samples(setup):
    x, y = capacity.batch_of(setup, 40)
    first, labels = next(iter(setup.train_batches.epoch(0)))
    assert x.shape[0] == 40 and torch.equal(x[16:32], first) and torch.equal(y[32:], labels[:8])


def test_the_prediction_for_a_budget(setup):
    out = capacity.prediction(setup, budget=64 * 1024**2)
    per_sample, model_mib = out[cap.BYTES_PER_SAMPLE], out[cap.MODEL_MIB]
    assert per_sample > 0 and model_mib > 0
    expected = int((64 * 1024**2 - model_mib * 1024**2) // per_sample)
    assert out[cap.MAX_BATCH_PREDICTED] == expected
    assert out[cap.BUDGET_GIB] == pytest.approx(1 / 16)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_the_search_on_a_gpu_recovers_from_out_of_memory_and_meets_the_prediction(mode):
    """A real search on a real GPU, inside a small budget (the caching allocator limited to a
    fraction of the GPU): out-of-memory errors are caught, and the largest batch found is
    within 15% of the one predicted for that budget."""
    total = torch.cuda.get_device_properties(0).total_memory
    budget = 2 * 1024**3
    torch.cuda.set_per_process_memory_fraction(budget / total)
    try:
        args = [f"precision={mode}", "trainer.device=cuda", "model=resnet18", "dataset=synthetic"]
        args += ["dataset.image_size=32", "dataset.channels=3", "dataset.num_samples=512"]
        cfg = load([*args, "trainer.batch_size=64", "tracking=none"])
        setup = build(cfg)
        predicted = capacity.prediction(setup, budget)[cap.MAX_BATCH_PREDICTED]
        found = capacity.largest_batch(setup, limit=1 << 16)
        assert found.first_failure is not None  # it did run out of memory, and went on
        assert found.largest > 0
        assert abs(predicted - found.largest) / found.largest < 0.15, (predicted, found.largest)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
