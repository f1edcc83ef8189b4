"""measure/memory.py: the saved-tensor meter (activation memory), the peak memory numbers, and
the breakdown of a training step's peak into its parts."""

from __future__ import annotations

import torch

from ampsweep.config import compose as config
from ampsweep.engine import build as train
from ampsweep.engine import loop
from ampsweep.measure import memory
from ampsweep.measure.memory import SavedTensorMeter


def test_saved_tensor_meter_counts_saved_activations_not_parameters():
    layer = torch.nn.Linear(100, 50)
    meter = SavedTensorMeter(layer)
    x = torch.randn(32, 100)
    with meter.record():
        layer(x).sum()
    # Linear saves its input for the weight gradient: 32 x 100 fp32; the weight is a parameter.
    assert meter.bytes == 32 * 100 * 4
    assert meter.mib == 32 * 100 * 4 / 2**20
    with meter.record(enabled=False):
        layer(x).sum()
    assert meter.bytes == 32 * 100 * 4  # a disabled record leaves the count alone


def test_a_tensor_saved_twice_is_counted_once():
    x = torch.randn(16, 8, requires_grad=True)
    meter = SavedTensorMeter(torch.nn.Identity())
    with meter.record():
        (x * x).sum()  # mul saves both operands: the same storage
    assert meter.bytes == 16 * 8 * 4


def test_a_resumed_run_keeps_what_its_first_step_measured():
    assert SavedTensorMeter(torch.nn.Identity(), measured_bytes=1234).bytes == 1234


def test_half_precision_halves_activation_memory_of_the_cnn(quick):
    mib = {}
    for mode in ("fp32", "fp16", "bf16"):
        cfg = config.load([*quick, "tracking=none", f"precision={mode}", "trainer.max_steps=1"])
        mib[mode] = loop.fit(train.build(cfg), lambda m, s: None)["mem/activation_mib"]
    assert mib["fp32"] > 0
    for mode in ("fp16", "bf16"):
        assert 0.4 < mib[mode] / mib["fp32"] <= 0.6, mib


def test_peak_memory_on_cpu_is_the_process_rss(monkeypatch):
    import resource

    class Usage:
        ru_maxrss = 2048 * 1024  # KiB on Linux: 2 GiB

    monkeypatch.setattr(resource, "getrusage", lambda who: Usage())
    monkeypatch.setattr(memory.sys, "platform", "linux")
    assert memory.peak_memory(torch.device("cpu")) == {"mem/peak_rss_mib": 2048.0}
