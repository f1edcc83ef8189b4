"""measure/contention.py: a run's share of the machine over its timed steps, and the rule that
calls a timing contended; a span too short for the kernel's clock ticks is not judged."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ampsweep.measure import contention


def share_over(readings: list[tuple[float, float, float]], warmup: int = 1):
    """A MachineShare fed ``readings`` (wall s, own CPU s, machine busy CPU s) in turn, one
    per read, over a run of ``len(readings) - 1`` timed steps after ``warmup``."""
    share = contention.MachineShare(warmup, last_step=warmup + len(readings) - 1)
    feed = iter(readings)
    share._read = lambda: next(feed)
    for step in range(warmup, warmup + len(readings)):
        share.after_step(SimpleNamespace(step=step))
    return share


def test_the_share_is_cpu_seconds_per_wall_second_of_the_timed_steps():
    share = share_over([(10.0, 5.0, 8.0), (11.0, 6.5, 10.0), (12.0, 8.0, 12.0)])
    metrics = share.metrics()
    assert metrics[contention.CORES_USED] == pytest.approx(1.5)  # 3 s of own CPU in 2 s
    assert metrics[contention.CORES_OTHERS] == pytest.approx(0.5)  # 4 s busy in all, less own
    assert metrics[contention.CORES] == contention.available_cores()


def test_a_span_shorter_than_the_kernels_clock_ticks_is_not_judged():
    short = contention.min_span_s() * 0.9
    share = share_over([(10.0, 5.0, 8.0), (10.0 + short, 5.0, 8.02)])
    assert share.metrics() == {}
    long = contention.min_span_s() * 1.1
    assert share_over([(10.0, 5.0, 8.0), (10.0 + long, 5.1, 8.2)]).metrics()


def test_contended_needs_others_holding_a_share_of_a_full_machine():
    assert contention.contended(used=1.2, others=0.6, cores=2)  # 90% busy, others 0.6 cores
    assert not contention.contended(used=1.0, others=0.6, cores=2)  # 80%: the run had room
    assert not contention.contended(used=1.9, others=0.1, cores=2)  # the run alone filled it
    assert not contention.contended(used=None, others=None, cores=None)  # not measured
