"""measure/memory.py: the saved-tensor meter (activation memory) and the peak memory numbers."""

from __future__ import annotations

import json

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


# ---------------------------------------------------------------- the parts of a step's peak

CPU = torch.device("cpu")


def test_autocast_weight_copies_are_told_apart_from_activations():
    layer = torch.nn.Linear(100, 50)
    meter = SavedTensorMeter(layer)
    x = torch.randn(32, 100, requires_grad=True)  # its gradient needs the weight
    with meter.record(), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x).float().sum()
    # Linear under autocast saves its input's bf16 copy (an activation: x is no parameter)
    # and the bf16 copy of its weight (autocast's cache, reached from the weight by a cast).
    assert meter.parts == {"activations": 32 * 100 * 2, "autocast_cache": 50 * 100 * 2}
    assert meter.bytes == 32 * 100 * 2 + 50 * 100 * 2


def test_a_computed_tensor_of_one_parameter_is_an_activation_not_a_weight_copy():
    conv = torch.nn.Conv2d(1, 4, 3, bias=False)  # its output: computed from the weight alone
    norm = torch.nn.BatchNorm2d(4)
    meter = SavedTensorMeter(torch.nn.Sequential(conv, norm))
    with meter.record():
        norm(conv(torch.randn(2, 1, 6, 6))).sum()
    assert "autocast_cache" not in meter.parts
    assert meter.parts["activations"] >= 2 * 4 * 4 * 4 * 4  # the conv's output, saved by BN


def test_activations_by_module_rank_the_innermost_modules_then_the_rest():
    model = torch.nn.Sequential(
        torch.nn.Linear(10, 40), torch.nn.ReLU(), torch.nn.Linear(40, 20), torch.nn.Tanh()
    )
    meter = SavedTensorMeter(model)
    x = torch.randn(8, 10, requires_grad=True)
    with meter.record():
        model(x).sum()
    rows = meter.by_module_rows()
    # Linear 0 saves x (8x10), ReLU its output (8x40), Linear 2 nothing new (that same
    # output), Tanh its output (8x20); fp32.
    assert [(r["module"], r["type"], r["mib"] * 2**20) for r in rows] == [
        ("1", "ReLU", 8 * 40 * 4),
        ("3", "Tanh", 8 * 20 * 4),
        ("0", "Linear", 8 * 10 * 4),
    ]
    assert sum(r["share"] for r in rows) == 1.0
    top = meter.by_module_rows(top=1)
    assert top[-1] == {
        "module": memory.OTHER_MODULES,
        "type": "",
        "mib": 8 * 30 * 4 / 2**20,
        "share": 30 / 70,
    }


def test_the_activations_by_module_artifact_is_logged_under_memory(tmp_path):
    logged = {}

    class Recorder:
        def log_artifact(self, path, artifact_path=None):
            logged[f"{artifact_path}/{path.name}"] = json.loads(path.read_text())

    rows = [{"module": "fc", "type": "Linear", "mib": 1.0, "share": 1.0}]
    memory.log_activations_by_module(Recorder(), rows)
    assert logged == {"memory/activations_by_module.json": rows}
