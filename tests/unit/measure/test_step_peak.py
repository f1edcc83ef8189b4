"""measure/step_peak.py: the measured peak of a training step and the parts live at it."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ampsweep.config import compose as config
from ampsweep.engine import build as train
from ampsweep.engine import loop
from ampsweep.measure import step_peak
from ampsweep.measure.live import LIVE, Live
from ampsweep.measure.memory import SavedTensorMeter
from ampsweep.measure.step_peak import StepPeak

CPU = torch.device("cpu")
PARTS = (*step_peak.PARTS, "other")


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
    parts = {part: summary[f"mem/{part}_mib"] for part in PARTS}
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
def test_the_parts_add_up_to_the_peak(model, mode):
    # What was live at the measured peak never exceeds it: ``other`` (the peak minus the
    # parts) is not negative beyond the bytes of a few tensors; and what the parts leave out
    # (a kernel's temporaries and workspace, the batch) is at most a tenth of the peak.
    # On a machine loaded by other processes, one step in a few dozen measured a few MiB more
    # in backward than its siblings, which no part names (workspace; the cause is not known):
    # such a step is measured once more, and the check fails only where the second shows it too.
    for _ in range(2):
        p = run_parts(*MODELS[model], f"precision={mode}", "trainer.max_steps=2")
        if p["other"] <= 0.10 * p["peak"]:
            break
    assert -0.01 * p["peak"] <= p["other"] <= 0.10 * p["peak"], p
    assert p["peak"] > p["params"] + p["optimizer"]  # the step allocates above what is held
    weights = {"fp32": 4, "bf16": 4, "bf16_pure": 2}[mode]
    assert p["params"] == pytest.approx(p["n"] * weights / 2**20, rel=1e-6)
    assert p["master_weights"] == p["fp8"] == 0.0
    assert (p["autocast_cache"] > 0) == (mode == "bf16" and not p["mem/step_peak_at_optimizer"])


def test_a_wide_mlp_at_batch_2_peaks_in_its_weights_and_optimizer_state():
    p = run_parts("model=mlp", "model.width=256", "trainer.batch_size=2", "trainer.max_steps=2")
    assert p["mem/step_peak_at_optimizer"] == 1.0  # AdamW's update: every gradient is live
    assert p["activations"] == p["autocast_cache"] == p["activation_grads"] == 0.0  # freed
    assert p["grads"] == pytest.approx(p["params"])
    # AdamW's intermediate results (torch's foreach update) count in the optimizer's part,
    # beside its two moments (and a step count per parameter): about as large as the weights
    state = 2 * p["params"]
    assert p["optimizer"] == pytest.approx(state + p["mem/optimizer_intermediates_mib"], 1e-4)
    assert p["mem/optimizer_intermediates_mib"] > 0.5 * p["params"], p
    assert abs(p["other"]) <= 0.01 * p["peak"], p


def test_a_conv_net_at_a_large_batch_peaks_in_its_activations():
    p = run_parts("model.width=16", "trainer.batch_size=512", "trainer.max_steps=2")
    assert p["mem/step_peak_at_optimizer"] == 0.0 == p["mem/optimizer_intermediates_mib"]
    assert p["activations"] / p["peak"] > 0.5, p
    assert p["activation_grads"] > 0.0


def test_a_step_of_two_micro_batches_holds_at_most_one_micro_batchs_saved_tensors():
    # Each micro-batch's backward frees what its forward saved before the next one runs
    p = run_parts(
        "model.width=8",
        "trainer.batch_size=16",
        "trainer.grad_accum_steps=2",
        "trainer.max_steps=2",
    )
    assert p["mem/step_peak_at_optimizer"] == 0.0
    saved = p["activations"] + p["autocast_cache"]
    assert 0 < saved <= p["mem/activation_mib"] and p["activation_grads"] > 0
    assert p["other"] >= -0.01 * p["peak"], p


def test_what_backward_frees_and_the_gradients_in_flight_are_marked_as_they_change():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    marks: list[tuple[dict, dict]] = []

    def mark(state, made):
        marks.append((dict(zip(LIVE, state, strict=True)), dict(zip(LIVE, made, strict=True))))

    live = Live(mark)
    meter = SavedTensorMeter(model)
    with meter.record(keep=live.keep):
        out = model(torch.randn(32, 8))
        loss = (out.relu() + out.sigmoid()).sum()  # two nodes feed the gradient of ``out``
    live.watch(loss)
    # Saved: the input (1 KiB), the hidden activation (2 KiB: saved by ReLU and the second
    # Linear, counted once), the outputs of relu and sigmoid (512 B each)
    assert marks[-1][0]["activations"] == meter.parts["activations"] == 4096
    before = len(marks)
    loss.backward()
    states = [state for state, _ in marks[before:]]
    # The first Linear's saved input is freed once its node has run, not before
    assert [s["activations"] for s in states].count(0) == 3 and states[-4]["activations"] > 0
    assert states[-1]["activations"] == states[-1]["activation_grads"] == 0  # all freed
    # ``out``'s gradient, fed by relu's and sigmoid's nodes into one buffer, counts once
    assert 512 in {s["activation_grads"] for s in states}
    assert all(s["activation_grads"] < 1024 for s in states[:6])
    # The most in flight: while ReLU's node runs, the gradient of the hidden activation it
    # received (2 KiB) and the one it makes for the first Linear (2 KiB)
    in_node = [
        state["activation_grads"] + made["activation_grads"]
        for (state, _), (_, made) in zip(marks[before - 1 :], marks[before:], strict=False)
    ]
    assert max(in_node) == 4096


def grads(n: int, saved: int = 0, flying: int = 0) -> tuple[int, ...]:
    return (n, saved, 0, 0, flying)  # in the order of step_peak.LIVE


def test_on_cuda_the_peak_and_the_parts_live_at_it_come_from_the_allocators_marks(
    monkeypatch,
):
    # No GPU needed: the allocator's numbers as a CUDA step would leave them. 100 bytes were
    # allocated as the step began; each change marked (the parts now, what a node ending now
    # made, the peak so far).
    model = torch.nn.Linear(4, 2)
    peak = StepPeak(torch.device("cuda"), model, torch.optim.SGD(model.parameters()), 0, 10)
    nothing = grads(0)
    peak._before, peak._all_grads = 100, 60
    peak._marks = [
        (grads(10, 50, 0), nothing, 500),
        (grads(10, 40, 8), grads(0, 0, 8), 900),  # a node that ran at the peak ends
        (grads(60, 0, 0), nothing, 900),
    ]
    peak._forward_backward, peak._at_optimizer = 900, 300  # the peak before the optimizer's
    now = {"allocated": 400}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: now["allocated"])
    # 900 was first seen as the node ended: the parts before it, and what it made, were live
    assert peak._cuda_peak() == (800, grads(10, 50, 8), False, 0)
    now["allocated"] = 1000  # the optimizer's step went higher: every gradient live
    assert peak._cuda_peak() == (900, grads(60), True, 700)  # 700 allocated by its step
    peak._forward_backward, peak._marks = None, []  # no optimizer step (a skipped one)
    assert peak._cuda_peak() == (900, grads(0), False, 0)


def test_a_run_records_its_peak_in_parts_and_its_activations_by_module(main, store_uri, tmp_path):
    from conftest import QUICK, all_runs

    from ampsweep.tracking.store import client_for

    assert main("train", *QUICK, "precision=bf16", f"tracking.uri={store_uri}").code == 0
    (run,) = all_runs(store_uri)
    metrics = run.data.metrics
    parts = [metrics[f"mem/{part}_mib"] for part in PARTS]
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
