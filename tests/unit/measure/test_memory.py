"""measure/memory.py: the saved-tensor meter (activation memory), the peak memory numbers, and
the breakdown of a training step's peak into its parts."""

from __future__ import annotations

import json

import pytest
import torch

from ampsweep.config import compose as config
from ampsweep.engine import build as train
from ampsweep.engine import loop
from ampsweep.measure import memory, step_peak
from ampsweep.measure.memory import SavedTensorMeter
from ampsweep.measure.step_peak import StepPeak


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


def test_the_step_measured_is_the_second_of_a_segment_and_its_cpu_profile_covers_the_first():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert StepPeak(CPU, model, optimizer, done=0, total=10).at == 2
    assert StepPeak(CPU, model, optimizer, done=0, total=1).at == 1  # its only step
    assert StepPeak(CPU, model, optimizer, done=7, total=10).at == 9  # a resumed run's
    # Two steps, one of warm-up: the second is the one to time
    assert StepPeak(CPU, model, optimizer, done=0, total=2, warmup=1).at == 1
    assert StepPeak(CPU, model, optimizer, done=0, total=2, warmup=2).at == 2
    peak = StepPeak(CPU, model, optimizer, done=0, total=10)
    steps = []
    for step in range(1, 5):
        untimed = peak.start(step)
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peak.stop()
        steps.append(untimed)
    assert steps == [True, True, False, False]  # profiled, measured, then timed as usual
    params = 2 * 4 * 4 + 2 * 4
    assert peak.bytes is not None and peak.bytes >= params + params  # the weights and grads


def run_parts(*overrides: str) -> dict[str, float]:
    cfg = config.load(["tracking=none", "trainer.progress=false", "trainer.epochs=1", *overrides])
    s = train.build(cfg)
    summary = loop.fit(s, lambda m, step: None)
    parts = {part: summary[f"mem/{part}_mib"] for part in (*step_peak.PARTS, "other")}
    assert sum(parts.values()) == pytest.approx(summary["mem/step_peak_mib"], rel=1e-9)
    return {**summary, **parts, "peak": summary["mem/step_peak_mib"], "n": s.num_params}


TINY_GPT = [
    "model=gpt", "dataset=pysource", "dataset.max_bytes=100000", "model.n_layer=2",
    "model.n_head=2", "model.n_embd=64", "dataset.seq_len=64", "trainer.batch_size=8",
]  # fmt: skip
MODELS = {
    "cnn": ["model.width=8", "trainer.batch_size=32"],
    "gpt": TINY_GPT,
    "timm": ["model=timm", "model.arch=test_resnet", "trainer.batch_size=16"],
}


@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16_pure"])
@pytest.mark.parametrize("model", list(MODELS))
def test_the_parts_of_the_peak_were_live_at_it(model, mode):
    # What was live at the measured peak never exceeds it: ``other`` (the peak minus the
    # parts) is not negative beyond the bytes of a few tensors. What it holds (the gradients
    # of the activations at a peak in backward, the optimizer's intermediate results at a
    # peak in its step, the CPU kernels' workspace) is about a fifth of these tiny models'
    # peaks, and more where a kernel library allocates its caches in the measured step.
    p = run_parts(*MODELS[model], f"precision={mode}", "trainer.max_steps=2")
    assert p["other"] >= -0.02 * p["peak"], p
    assert p["peak"] > p["params"] + p["optimizer"]  # the step allocates above what is held
    weights = {"fp32": 4, "bf16": 4, "bf16_pure": 2}[mode]
    assert p["params"] == pytest.approx(p["n"] * weights / 2**20, rel=1e-6)
    assert p["master_weights"] == p["fp8"] == 0.0
    assert (p["autocast_cache"] > 0) == (mode == "bf16" and not p["mem/step_peak_at_optimizer"])


def test_a_wide_mlp_at_batch_2_peaks_in_its_weights_and_optimizer_state():
    p = run_parts("model=mlp", "model.width=256", "trainer.batch_size=2", "trainer.max_steps=2")
    assert p["mem/step_peak_at_optimizer"] == 1.0  # AdamW's update: every gradient is live
    assert p["activations"] == p["autocast_cache"] == 0.0  # freed by then
    # The rest: AdamW's intermediate results (torch's foreach update), about twice the weights
    assert (p["params"] + p["grads"] + p["optimizer"]) / p["peak"] > 0.6, p


def test_a_conv_net_at_a_large_batch_peaks_in_its_activations():
    p = run_parts("model.width=16", "trainer.batch_size=512", "trainer.max_steps=2")
    assert p["mem/step_peak_at_optimizer"] == 0.0
    assert p["activations"] / p["peak"] > 0.5, p


def test_on_cuda_the_peak_and_the_gradients_live_at_it_come_from_the_allocators_marks(
    monkeypatch,
):
    # No GPU needed: the allocator's numbers as a CUDA step would leave them. 100 bytes were
    # allocated as the step began; each gradient ready marked (gradient bytes, peak so far).
    model = torch.nn.Linear(4, 2)
    peak = StepPeak(torch.device("cuda"), model, torch.optim.SGD(model.parameters()), 0, 10)
    peak._before, peak._marks, peak._all_grads = 100, [(10, 500), (30, 900), (60, 900)], 60
    peak._forward_backward = 900  # the peak before the optimizer's step
    now = {"allocated": 400}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: now["allocated"])
    # 900 was first seen at the second gradient: the first gradient's 10 bytes were live then
    assert peak._cuda_peak() == (800, 10, False)
    now["allocated"] = 1000  # the optimizer's step went higher: every gradient live
    assert peak._cuda_peak() == (900, 60, True)
    peak._forward_backward, peak._marks = None, []  # no optimizer step (a skipped one)
    assert peak._cuda_peak() == (900, 0, False)


def test_a_run_records_its_peak_in_parts_and_its_activations_by_module(main, store_uri, tmp_path):
    from conftest import QUICK, all_runs

    from ampsweep.tracking.store import client_for

    assert main("train", *QUICK, "precision=bf16", f"tracking.uri={store_uri}").code == 0
    (run,) = all_runs(store_uri)
    metrics = run.data.metrics
    parts = [metrics[f"mem/{part}_mib"] for part in (*step_peak.PARTS, "other")]
    assert sum(parts) == pytest.approx(metrics["mem/step_peak_mib"], rel=1e-9)
    client = client_for(store_uri)
    path = client.download_artifacts(run.info.run_id, "memory", str(tmp_path))
    rows = json.loads((tmp_path / "memory" / "activations_by_module.json").read_text())
    assert path and rows[0]["mib"] >= rows[-1]["mib"] > 0
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    # the cnn's modules by their names in the model ("1": its first BatchNorm, ...)
    assert {r["type"] for r in rows} <= {
        "Conv2d",
        "BatchNorm2d",
        "ReLU",
        "AvgPool2d",
        "AdaptiveAvgPool2d",
        "Flatten",
        "Dropout",
        "Linear",
        "",
    }
