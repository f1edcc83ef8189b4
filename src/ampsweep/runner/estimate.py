"""No surprise durations: what a sweep will cost, said before it starts and once each job has
timed its first steps.

Before the sweep: a mode that the mode table knows to be slow on this CPU (fp16 autocast on a
CPU without native fp16 arithmetic: ``precision.modes.cpu_slowdown``) is named with its
expected slowdown. During each job: after its first timed steps it prints its own training
time left and the sweep's: the jobs still to come at the time their mode (or a mode of the
same 16-bit format) took in this sweep already, else at this job's time scaled by the
slowdown the mode table expects of it here. Estimates of training only: building, evaluation
and logging add a little.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ampsweep.config.schema import Config, Device
from ampsweep.precision import modes

# A job estimates once it has timed this many steps past its warmup, or this many seconds
ESTIMATE_AFTER_STEPS, ESTIMATE_AFTER_S = 5, 3.0


def cpu_flags() -> set[str] | None:
    """The CPU's instruction-set flags (/proc/cpuinfo), None where the OS has no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):  # x86, Arm
            return set(line.split(":", 1)[1].split())
    return None


def _on_cpu(cfg: Config, has_cuda: bool) -> bool:
    return cfg.trainer.device == Device.cpu or (cfg.trainer.device == Device.auto and not has_cuda)


def slowdown(mode: str, flags: set[str] | None) -> float:
    """The expected factor a mode runs slower than fp32 here (1: about as fast): the geometric
    middle of the mode table's range."""
    m = modes.get(mode)
    known = modes.cpu_slowdown(m, flags) if m else None
    return math.sqrt(known[0] * known[1]) if known else 1.0


def slow_mode_notes(configs: Sequence[Config], has_cuda: bool, flags: set[str] | None) -> list[str]:
    """One line per 16-bit format whose modes in this sweep are known to be slow on this
    device: the modes, their jobs and the expected slowdown."""
    jobs: dict[str, int] = {}
    for cfg in configs:
        if _on_cpu(cfg, has_cuda):
            jobs[cfg.precision.name] = jobs.get(cfg.precision.name, 0) + 1
    slow: dict[str, list[str]] = {}  # dtype -> its slow modes
    slowdowns: dict[str, tuple[float, float]] = {}  # dtype -> its expected slowdown range
    for name in jobs:
        m = modes.get(name)
        slowdown = modes.cpu_slowdown(m, flags) if m is not None else None
        if m is not None and slowdown is not None:
            slow.setdefault(m.dtype, []).append(name)
            slowdowns[m.dtype] = slowdown
    notes = []
    for dtype, names in slow.items():
        low, high = slowdowns[dtype]
        native = "/".join(modes.NATIVE_CPU_FLAGS[dtype][:2])
        count = sum(jobs[n] for n in names)
        notes.append(
            f"{', '.join(names)} ({count} job(s)) run {dtype} autocast on a CPU without native "
            f"{dtype} arithmetic (no {native}): expect them {low:.0f}-{high:.0f}x slower than "
            "fp32 (convnets the most); leave them out (precision=...) or run them on a GPU"
        )
    return notes


def duration(seconds: float) -> str:
    """``45 s``, ``3 min 10 s``, ``1 h 5 min``."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class DurationEstimate:
    """A per-step callback of ``fit`` (both hooks of ``engine.loop.Callback``) that says, once,
    how long this job's training and the rest of the sweep will take."""

    def __init__(
        self,
        name: str,
        mode: str,
        total_steps: int,
        warmup: int,
        later: Sequence[str] = (),  # the modes of the sweep's jobs after this one
        known: dict[str, float] | None = None,  # mode -> training seconds it took already
        flags: set[str] | None = None,
        on_cpu: bool = True,
        say: Callable[[str], None] = print,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.name, self.mode, self.total, self.warmup = name, mode, total_steps, warmup
        self.later, self.known = list(later), dict(known or {})
        self.flags, self.on_cpu, self.say, self.clock = flags, on_cpu, say, clock
        self._start: tuple[int, float] | None = None
        self.said = ""

    def before_update(self, view) -> None: ...

    def after_step(self, state) -> None:
        if self.said:
            return
        now = self.clock()
        if self._start is None:
            if state.step >= self.warmup:
                self._start = (state.step, now)
            return
        steps, spent = state.step - self._start[0], now - self._start[1]
        if steps >= ESTIMATE_AFTER_STEPS or (steps and spent >= ESTIMATE_AFTER_S):
            self.said = self.estimate(spent / steps, state.step)
            self.say(self.said)

    def estimate(self, step_s: float, step: int) -> str:
        left = (self.total - step) * step_s
        text = (
            f"{self.name}: about {duration(left)} of training left ({self.total - step} of "
            f"{self.total} steps at {step_s * 1000:,.0f} ms/step)"
        )
        if not self.later:
            return text
        whole = self.total * step_s
        mine = slowdown(self.mode, self.flags) if self.on_cpu else 1.0
        rest = 0.0
        # a mode not run yet: as long as one of its 16-bit format that ran (fp16_static as
        # fp16), else this job scaled by what the mode table expects of it here
        by_dtype = {modes.MODES[m].dtype: s for m, s in self.known.items() if m in modes.MODES}
        for mode in self.later:
            dtype = modes.MODES[mode].dtype if mode in modes.MODES else None
            if mode in self.known:
                rest += self.known[mode]
            elif dtype in by_dtype:
                rest += by_dtype[dtype]
            else:
                factor = slowdown(mode, self.flags) if self.on_cpu else 1.0
                rest += whole * factor / mine
        return (
            f"{text}; the sweep: about {duration(left + rest)} left ({len(self.later)} more job(s))"
        )
