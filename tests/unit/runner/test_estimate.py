"""app/estimate: a slow mode named before the sweep from the CPU's flags (never from its
name), and each job's estimate of its own and the sweep's remaining time."""

from __future__ import annotations

from ampsweep.config.compose import load
from ampsweep.engine.loop import TrainState
from ampsweep.runner import estimate
from ampsweep.runner.estimate import DurationEstimate, slow_mode_notes

NO_FP16 = {"avx2", "avx512f", "avx512_bf16"}  # an AMD EPYC's, say
FP16 = NO_FP16 | {"avx512_fp16"}  # a Sapphire Rapids'


def configs(*modes, device="cpu"):
    return [load([f"precision={m}", f"trainer.device={device}"]) for m in modes]


def test_fp16_is_announced_slow_only_on_a_cpu_without_native_fp16():
    sweep = configs("fp32", "fp16", "fp16_noscale", "bf16", "fp16")
    (fp16,) = slow_mode_notes(sweep, False, NO_FP16)
    assert fp16.startswith("fp16, fp16_noscale (3 job(s)) run fp16 autocast on a CPU without ")
    assert "(no avx512_fp16/amx_fp16): expect them 3-60x slower than fp32" in fp16
    assert slow_mode_notes(sweep, False, FP16) == []  # native fp16 arithmetic
    assert slow_mode_notes(sweep, False, None) == []  # flags unknown: no guess
    assert slow_mode_notes(configs("fp16", device="auto"), True, NO_FP16) == []  # on the GPU
    assert slow_mode_notes(configs("fp16", device="auto"), False, NO_FP16) != []


def test_a_job_estimates_itself_and_the_rest_of_the_sweep_once():
    said, now = [], [0.0]
    est = DurationEstimate(
        "fp32-cnn-digits", "fp32", total_steps=105, warmup=2,
        later=["fp16", "fp32", "bf16", "fp16_static"], known={"bf16": 30.0}, flags=NO_FP16,
        say=said.append, clock=lambda: now[0],
    )  # fmt: skip
    for step in range(1, 9):
        now[0] = step * 0.2  # 200 ms a step
        est.after_step(TrainState(step=step))
    (line,) = said  # after 5 timed steps, once
    assert line.startswith("fp32-cnn-digits: about 20 s of training left (98 of 105 steps at")
    assert "200 ms/step" in line
    # 98 steps left + fp16 at 21 s x sqrt(3 x 60) + fp32 21 s + bf16's own 30 s, and
    # fp16_static as fp16
    whole = 105 * 0.2
    left = 98 * 0.2 + 2 * whole * (3 * 60) ** 0.5 + whole + 30.0
    assert line.endswith(f"the sweep: about {estimate.duration(left)} left (4 more job(s))")


def test_a_mode_not_run_yet_takes_the_time_of_its_format_that_ran():
    said = []
    est = DurationEstimate("bf16-x", "bf16", 10, 0, later=["fp16_static"], known={"fp16": 50.0},
                           flags=NO_FP16, say=said.append)  # fmt: skip
    assert est.estimate(0.1, 5).endswith("the sweep: about 50 s left (1 more job(s))")


def test_durations_read_as_people_say_them():
    assert [estimate.duration(s) for s in (4.4, 190, 3900)] == ["4 s", "3 min 10 s", "1 h 5 min"]
