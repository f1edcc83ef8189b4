"""How much of the machine a run had while its steps were timed.

A throughput measured while other processes competed for the CPU says as much about them as
about the precision mode. Over the timed steps (after ``trainer.timing_warmup_steps``) this
reads the run's own CPU time (every thread of the process, from psutil) and the whole
machine's busy CPU time, and logs, per second of wall time, the cores the run used and the
cores every other process used, beside the number of cores it could run on. The report calls
a run's timing contended (``contended``) when other processes took a real share of the
machine while the machine was full: then the run waited for cores it would have used.
"""

from __future__ import annotations

import os
import time

import psutil

CORES_USED = "perf/cpu_cores_used"  # this run's CPU seconds per wall second while timed
CORES_OTHERS = "perf/cpu_cores_others"  # every other process's, over the same time
CORES = "perf/cpu_cores"  # the cores this process may run on
# Contended: the other processes used at least this share of the cores (a quarter: half a
# core on a 2-core machine) while all the cores together were at least FULL busy.
OTHERS_SHARE = 0.25
FULL = 0.85
# The kernel counts CPU time in clock ticks (10 ms where USER_HZ is 100), so each reading is
# off by up to a tick per core: over a timed span of 20 ticks (0.2 s) that is at most about 5%
# of the machine. A shorter span (a few dozen fast steps) reads noise: it can read a machine
# that other processes fill as less than FULL busy. Its share is not logged, and not judged.
MIN_SPAN_TICKS = 20


def contended(used: float | None, others: float | None, cores: float | None) -> bool:
    """Whether a run's timing was contended, from the three numbers it logged (False where
    they were not measured)."""
    number = int | float
    if not (isinstance(used, number) and isinstance(others, number) and isinstance(cores, number)):
        return False
    if not cores:
        return False
    return others >= OTHERS_SHARE * cores and used + others >= FULL * cores


def describe(used: float, others: float, cores: float) -> str:
    """``other processes used 1.2 of 2 cores (this run 0.8)``."""
    return f"other processes used {others:.1f} of {cores:.0f} cores (this run {used:.1f})"


def available_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return psutil.cpu_count() or 1


def min_span_s() -> float:
    """The shortest timed span whose share of the machine is logged (``MIN_SPAN_TICKS``)."""
    try:
        ticks_per_s = os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):  # not a POSIX system: psutil's own clock
        ticks_per_s = 100
    return MIN_SPAN_TICKS / ticks_per_s


def _busy_s() -> float:
    """The machine's busy CPU seconds so far, over every core."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _own_s(process: psutil.Process) -> float:
    t = process.cpu_times()
    return t.user + t.system


class MachineShare:
    """A per-step callback of ``fit`` (both hooks of ``engine.loop.Callback``) that measures
    the run's share of the machine over its timed steps: from the end of the warmup steps (or
    the first step of a resumed run) to the last step, read every ``every`` steps on the way
    (two /proc reads each) so that a run stopped early has its share too. The evaluation and
    the untimed work after the last step are left out, as they are from the timings."""

    def __init__(self, warmup: int, last_step: int, every: int = 1):
        self.warmup, self.last_step, self.every = warmup, last_step, max(1, every)
        self.process = psutil.Process()
        self.cores = available_cores()
        self._start: tuple[float, float, float] | None = None
        self._last: tuple[float, float, float] | None = None

    def _read(self) -> tuple[float, float, float]:
        return time.perf_counter(), _own_s(self.process), _busy_s()

    def before_update(self, view) -> None:
        if self._start is None and view.step > self.warmup:
            self._start = self._read()  # a timed step begins (warmup 0, or a resumed run)

    def after_step(self, state) -> None:
        if state.step == self.warmup:
            self._start = self._read()  # the timed steps begin after this one
        elif self._start is not None and (
            state.step % self.every == 0 or state.step >= self.last_step
        ):
            self._last = self._read()

    def metrics(self) -> dict[str, float]:
        """The cores this run and the others used per wall second while timed, and the
        cores it may run on; nothing before a timed step was read, or over a span too short
        for the kernel's clock ticks (``min_span_s``)."""
        if self._start is None or self._last is None:
            return {}
        wall = self._last[0] - self._start[0]
        if wall < min_span_s():
            return {}
        own = (self._last[1] - self._start[1]) / wall
        busy = (self._last[2] - self._start[2]) / wall
        return {CORES_USED: own, CORES_OTHERS: max(0.0, busy - own), CORES: float(self.cores)}
