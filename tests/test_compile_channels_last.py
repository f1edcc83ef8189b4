"""trainer.channels_last and trainer.compile with every precision mode this CPU can run."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from ampsweep.config import compose as config
from ampsweep.engine import build as train
from ampsweep.engine import loop
from ampsweep.precision.modes import MODES

# fp8 runs on a CPU only in torchao's emulation, which does not compile (its own tests).
CPU_MODES = [name for name, mode in MODES.items() if "cpu" in mode.devices and not mode.fp8]
TINY = [
    "tracking=none",
    "trainer.progress=false",
    "trainer.device=cpu",
    "model=cnn",
    "model.width=4",
    "model.depth=1",
    "trainer.batch_size=16",
    "trainer.timing_warmup_steps=0",
]


def fit(mode: str, extra: list[str]):
    setup = train.build(config.load([*TINY, f"precision={mode}", *extra]))
    summary = loop.fit(setup, lambda m, s: None)
    return setup, summary


@pytest.mark.parametrize("mode", CPU_MODES)
def test_channels_last_trains_in_every_mode(mode):
    setup, summary = fit(mode, ["trainer.channels_last=true", "trainer.max_steps=4"])
    conv = next(m for m in setup.model.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    x, _ = next(iter(setup.train_batches.epoch(0)))
    assert x.is_contiguous(memory_format=torch.channels_last) and x.shape[1] == 1
    assert math.isfinite(summary["val/loss"]) and summary["train/steps"] == 4
    assert all(torch.isfinite(p).all() for p in setup.model.parameters())


def test_cpu_modes_cover_every_mode_but_the_cuda_only_ones():
    fp8 = {name for name, mode in MODES.items() if mode.fp8}
    assert set(CPU_MODES) == set(MODES) - {"tf32", "fp16_pure"} - fp8


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs a C++ compiler")
@pytest.mark.parametrize("mode", CPU_MODES)
def test_compile_with_channels_last_trains_in_every_mode(mode):
    """Inductor compiles forward and backward (tens of seconds per mode on a small CPU)."""
    setup, summary = fit(
        mode, ["trainer.compile=true", "trainer.channels_last=true", "trainer.max_steps=2"]
    )
    assert hasattr(setup.model, "_orig_mod")  # really compiled
    assert math.isfinite(summary["val/loss"]) and summary["train/steps"] == 2
    assert summary["mem/activation_mib"] > 0  # the saved-tensor meter still sees activations
    assert summary["perf/gflops_per_step"] > 0  # counted on the uncompiled module
