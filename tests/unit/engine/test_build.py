"""engine/build.py: a config built into what the loop runs: channels_last and compile in every
mode this CPU can run, the batches the preload choice gives, the refusals of impossible sizes."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from conftest import require_tool

from ampsweep.config import compose as config
from ampsweep.config.schema import ConfigError
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
@pytest.mark.parametrize("mode", CPU_MODES)
def test_compile_with_channels_last_trains_in_every_mode(mode):
    """Inductor compiles forward and backward (tens of seconds per mode on a small CPU)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    require_tool("compiler", None if compiler else "torch.compile on CPU needs a C++ compiler")
    setup, summary = fit(
        mode, ["trainer.compile=true", "trainer.channels_last=true", "trainer.max_steps=2"]
    )
    assert hasattr(setup.model, "_orig_mod")  # really compiled
    assert math.isfinite(summary["val/loss"]) and summary["train/steps"] == 2
    assert summary["mem/activation_mib"] > 0  # the saved-tensor meter still sees activations
    assert summary["perf/gflops_per_step"] > 0  # counted on the uncompiled module


def test_batch_larger_than_data_is_refused():
    with pytest.raises(ConfigError, match="trainer.batch_size=100000"):
        train.build(config.load(["tracking=none", "trainer.batch_size=100000"]))


def test_more_accumulation_than_an_epoch_has_is_refused():
    # digits: 1,438 training samples, 5 batches of 256; 6 micro-batches a step cannot fit.
    cfg = config.load(["tracking=none", "trainer.batch_size=256", "trainer.grad_accum_steps=6"])
    with pytest.raises(ConfigError, match="trainer.grad_accum_steps=6 needs more micro-batches"):
        train.build(cfg)


@pytest.mark.parametrize("value, preloaded", [("true", True), ("false", False), ("auto", True)])
def test_the_preload_choice_chooses_the_batches(value, preloaded, quick):
    setup = train.build(config.load([*quick, "tracking=none", f"dataset.preload={value}"]))
    assert setup.train_batches.preload is preloaded and setup.dataset_info["preload"] is preloaded
    assert setup.val_batches.preload is preloaded


def test_max_steps_caps_the_total_and_the_schedule(quick):
    setup = train.build(config.load([*quick, "tracking=none", "trainer.epochs=3"]))
    assert setup.steps_per_epoch == 1438 // 64 and setup.total_steps == 6  # max_steps=6
