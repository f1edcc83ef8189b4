"""measure/timing.py: the median step time, with the warm-up steps left out."""

from __future__ import annotations

import torch

from ampsweep.measure import timing
from ampsweep.measure.timing import StepTimer


def test_the_median_leaves_out_the_warm_up_steps(monkeypatch):
    # Five steps, the first two warm-up (the clock is not even read); the other three take 5,
    # 9 and 7 ms, so the median is 7 ms.
    ticks = iter([0.0, 0.005, 1.0, 1.009, 2.0, 2.007])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks, 9.0))
    timer = StepTimer(torch.device("cpu"), warmup=2)
    for _ in range(5):
        timer.start()
        timer.stop()
    assert [round(t, 6) for t in timer.times_ms()] == [5.0, 9.0, 7.0]
    assert round(timer.median_ms(), 6) == 7.0
    assert round(timer.last_ms(), 6) == 7.0


def test_no_step_after_the_warm_up_means_no_time():
    timer = StepTimer(torch.device("cpu"), warmup=3)
    for _ in range(3):
        timer.start()
        timer.stop()
    assert timer.median_ms() is None and timer.last_ms() is None
