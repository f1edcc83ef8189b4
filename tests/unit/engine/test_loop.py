"""engine/loop.py: the one training loop, on CPU, in every mode it can run there: the AMP
step, skipped steps, accumulation, clipping, evaluation, the schedule and what it logs."""

from __future__ import annotations

import warnings

import pytest
import torch

from ampsweep.config import compose as config
from ampsweep.engine import build as train
from ampsweep.engine import loop, optim
from ampsweep.engine.data import batches as data
from ampsweep.precision.policy import build_policy

CPU_MODES = ["fp32", "fp16", "fp16_static", "fp16_noscale", "bf16", "bf16_pure"]


def setup_for(quick, *overrides: str) -> train.Setup:
    return train.build(config.load([*quick, "tracking=none", *overrides]))


def fit(setup: train.Setup) -> tuple[dict, list[tuple[int, dict]]]:
    logged: list[tuple[int, dict]] = []
    summary = loop.fit(setup, lambda metrics, step: logged.append((step, dict(metrics))))
    return summary, logged


@pytest.mark.parametrize("mode", CPU_MODES)
def test_a_few_steps_lower_the_loss(quick, mode):
    s = setup_for(
        quick, f"precision={mode}", "trainer.max_steps=20", "trainer.log_every=1",
        "optimizer.lr=1e-2",
    )  # fmt: skip
    before, _ = loop.evaluate(s.model, s.val_batches, s.policy)
    summary, logged = fit(s)
    assert summary["train/steps"] == 20
    assert summary["val/loss"] < before - 0.2, (before, summary["val/loss"])
    losses = [m["train/loss"] for _, m in logged if "train/loss" in m]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    assert summary["amp/skipped_steps"] == 0
    scaled = mode in ("fp16", "fp16_static")
    assert ("amp/loss_scale" in logged[0][1]) == scaled
    assert ("amp/loss_scale" in summary) == scaled


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone().float() for p in model.parameters()]


def test_clipping_with_a_scaler_sees_unscaled_gradients(quick, monkeypatch):
    """The norm clip_grad_norm_ measures under a 1024x loss scale equals the unscaled one,
    and so do the clipped updates (plain SGD, so a wrongly scaled clip would show)."""
    norms: list[float] = []
    real_clip = torch.nn.utils.clip_grad_norm_

    def recording_clip(params, max_norm, *args, **kwargs):
        norm = real_clip(params, max_norm, *args, **kwargs)
        norms.append(norm.item())
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    common = [
        "model=mlp",
        "optimizer=sgd",
        "optimizer.momentum=0",
        "optimizer.nesterov=false",
        "trainer.max_steps=1",
        "trainer.grad_clip=0.05",
    ]
    results = {}
    for mode in ("fp16", "fp16_noscale"):
        s = setup_for(quick, f"precision={mode}", "precision.scaler.init_scale=1024", *common)
        fit(s)
        results[mode] = (norms[-1], _params(s.model), s.scaler.is_enabled())
    (scaled_norm, scaled_params, on), (plain_norm, plain_params, off) = results.values()
    assert on and not off
    assert plain_norm > 0.05  # clipping really acted
    assert scaled_norm == pytest.approx(plain_norm, rel=1e-2)
    for a, b in zip(scaled_params, plain_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_gradient_accumulation_matches_one_larger_batch(quick):
    # mlp (no BatchNorm: its statistics differ per micro-batch), fp32, no dropout.
    common = [
        "precision=fp32",
        "model=mlp",
        "model.dropout=0",
        "optimizer=sgd",
        "trainer.max_steps=3",
        "trainer.log_every=1",
    ]
    one = setup_for(quick, *common, "trainer.batch_size=64")
    two = setup_for(quick, *common, "trainer.batch_size=32", "trainer.grad_accum_steps=2")
    torch.testing.assert_close(_params(one.model), _params(two.model))  # same start
    _, logged_one = fit(one)
    _, logged_two = fit(two)
    torch.testing.assert_close(_params(one.model), _params(two.model), rtol=1e-5, atol=1e-6)
    loss_one = [m["train/loss"] for _, m in logged_one if "train/loss" in m]
    loss_two = [m["train/loss"] for _, m in logged_two if "train/loss" in m]
    assert loss_one == pytest.approx(loss_two, rel=1e-5)
    assert one.total_steps == two.total_steps == 3


def test_deterministic_runs_are_bit_for_bit_equal(quick):
    runs = []
    for _ in range(2):
        s = setup_for(quick, "trainer.deterministic=true", "trainer.max_steps=5")
        summary, _ = fit(s)
        runs.append((summary["val/loss"], s.model.state_dict()))
    (loss_a, state_a), (loss_b, state_b) = runs
    assert loss_a == loss_b
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key


def test_evaluate_accuracy_and_loss():
    # The "model" returns its input as logits, so the expected numbers are known exactly.
    logits = torch.tensor(
        [[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 5.0, 0.0]]
    )
    labels = torch.tensor([0, 1, 0, 2, 1])  # three of five right
    split = (logits.view(5, 1, 1, 3), labels)
    batches = data.Batches(
        split, 2, torch.device("cpu"), torch.float32, shuffle=False, drop_last=False, seed=0,
        preload=True,
    )  # fmt: skip
    policy = build_policy(config.load(["precision=fp32"]).precision, torch.device("cpu"))
    loss, acc = loop.evaluate(torch.nn.Flatten(), batches, policy)
    assert acc == pytest.approx(3 / 5)
    expected = torch.nn.functional.cross_entropy(logits, labels).item()
    assert loss == pytest.approx(expected, rel=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "tf32", "fp16", "bf16", "fp16_pure", "bf16_pure"])
def test_a_few_steps_lower_the_loss_on_cuda(quick, mode):
    s = setup_for(
        quick, f"precision={mode}", "trainer.device=cuda", "trainer.max_steps=20",
        "optimizer.lr=1e-2",
    )  # fmt: skip
    before, _ = loop.evaluate(s.model, s.val_batches, s.policy)
    summary, logged = fit(s)
    assert summary["val/loss"] < before - 0.2
    assert summary["train/steps"] == 20 and summary["amp/skipped_steps"] == 0
    assert summary["mem/peak_allocated_mib"] > 0
    assert summary["mem/peak_reserved_mib"] >= summary["mem/peak_allocated_mib"]
    # What the mode does to the run: parameter dtype, the scaler, TF32.
    params = {"fp16_pure": torch.float16, "bf16_pure": torch.bfloat16}.get(mode, torch.float32)
    assert {p.dtype for p in s.model.parameters()} == {params}
    assert ("amp/loss_scale" in summary) == (mode == "fp16")
    assert all(p.device.type == "cuda" for p in s.model.parameters())
    from ampsweep.precision.policy import tf32_enabled

    assert tf32_enabled() == ((mode == "tf32"),) * 2


@pytest.mark.parametrize("mode", ["fp16_static", "fp16"])
def test_overflowing_steps_are_skipped_and_counted(quick, mode):
    # A loss scale of 1e30 overflows every fp16 gradient: each step holds inf and is skipped.
    s = setup_for(quick, f"precision={mode}", "model=mlp", "precision.scaler.init_scale=1.0e30")
    start = _params(s.model)
    summary, logged = fit(s)
    assert summary["amp/skipped_steps"] == 6
    assert [m["amp/skipped_steps"] for _, m in logged if "amp/skipped_steps" in m] == [2, 4, 6]
    torch.testing.assert_close(_params(s.model), start, rtol=0, atol=0)  # nothing applied
    expected_scale = 1.0e30 if mode == "fp16_static" else 1.0e30 * 0.5**6
    assert summary["amp/loss_scale"] == pytest.approx(expected_scale, rel=1e-6)


def test_summary_speed_comes_from_the_median_step_time(quick, monkeypatch):
    """With every timed step taking 8 ms, 2 micro-batches of 32 samples per step run at
    64 / 0.008 s = 8,000 samples/s."""
    from ampsweep.measure.cost import StepTimer

    monkeypatch.setattr(StepTimer, "median_ms", lambda self: 8.0)
    summary, _ = fit(setup_for(quick, "trainer.batch_size=32", "trainer.grad_accum_steps=2"))
    assert summary["train/steps"] == 6
    assert summary["perf/step_time_ms"] == 8.0
    assert summary["perf/samples_per_s"] == 8000.0
    assert summary["perf/wall_s"] > 0 and summary["mem/peak_rss_mib"] > 0
    assert "mem/peak_allocated_mib" not in summary  # CUDA only
    assert 0.0 <= summary["val/acc"] <= 1.0


def test_no_timed_step_means_no_speed(quick):
    # Every step inside the timing warm-up: nothing measured, so no speed is claimed.
    summary, _ = fit(setup_for(quick, "trainer.timing_warmup_steps=100"))
    assert "perf/step_time_ms" not in summary and "perf/samples_per_s" not in summary
    assert "perf/tflops" not in summary


def test_evaluation_every_n_epochs_and_at_the_end():
    # digits: 1,438 training samples, batches of 256: 5 steps an epoch, 3 epochs.
    s = train.build(
        config.load(
            ["tracking=none", "model=mlp", "model.width=8", "trainer.batch_size=256",
             "trainer.epochs=3", "trainer.eval_every=2", "trainer.log_every=5",
             "trainer.progress=false"]
        )
    )  # fmt: skip
    summary, logged = fit(s)
    assert s.steps_per_epoch == 5
    evaluated = [step for step, m in logged if "val/acc" in m]
    assert evaluated == [10, 15]  # after epoch 2 (eval_every=2), and the last one
    assert summary["val/acc"] == logged[-1][1]["val/acc"]


def test_the_schedule_steps_once_per_optimizer_step(quick):
    """Cosine with a 4-step warm-up over 12 steps, lr 0.01, min_lr_ratio 0.1, two micro-batches
    a step. The lr after step k is 0.01 * factor(k): warm-up (k+1)/4, then 0.1 + 0.45 * (1 +
    cos(pi * (k-4)/8)): 1.0 at 4, 0.8682 at 6, 0.55 at 8, 0.2318 at 10, 0.1 at 12."""
    s = setup_for(
        quick, "model=mlp", "optimizer.lr=0.01", "optimizer.schedule=cosine",
        "optimizer.warmup_steps=4", "optimizer.min_lr_ratio=0.1", "trainer.max_steps=12",
        "trainer.epochs=2", "trainer.log_every=1", "trainer.grad_accum_steps=2",
    )  # fmt: skip
    _, logged = fit(s)
    lr = {step: m["train/lr"] for step, m in logged if "train/lr" in m}
    expected = {1: 0.005, 2: 0.0075, 3: 0.01, 4: 0.01, 6: 0.0086820, 8: 0.0055, 10: 0.0023180}
    for step, value in expected.items():
        assert lr[step] == pytest.approx(value, abs=1e-7), step
    assert lr[12] == pytest.approx(0.001)
    assert sorted(lr) == list(range(1, 13))


def test_pytorchs_scheduler_order_warning_is_not_shown_for_a_skipped_step(quick, monkeypatch):
    """A skipped first step (an fp16 overflow) steps the schedule without an optimizer step,
    which PyTorch warns about; the loop means it, and the user must not see the warning."""

    def warnings_of_a_skipping_run() -> list[str]:
        # (a schedule that changes the rate: schedule=none steps nothing)
        s = setup_for(quick, "precision=fp16", "precision.scaler.init_scale=1.0e30",
                      "optimizer.schedule=cosine")  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            summary, _ = fit(s)
        assert summary["amp/skipped_steps"] > 0
        return [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]

    assert warnings_of_a_skipping_run() == []
    # Without the loop's filter the same run does warn, so the check above can fail.
    monkeypatch.setattr(optim, "SCHEDULER_ORDER_WARNING", "a message PyTorch never writes")
    assert warnings_of_a_skipping_run() != []
