"""Step timing: the median optimizer-step time, without adding a sync per step."""

from __future__ import annotations

import statistics
import time

import torch


class StepTimer:
    """Per-optimizer-step wall time, excluding the first ``warmup`` steps.

    On CUDA a step is timed with CUDA events recorded on the stream, so asynchronous kernel
    launches are not mistaken for speed and no synchronisation is added per step: the events
    are read once, at ``median_ms``. On CPU, ``perf_counter`` around the step is exact.
    """

    def __init__(self, device: torch.device, warmup: int):
        self.cuda = device.type == "cuda"
        self.warmup = warmup
        self.seen = 0
        self._cpu_ms: list[float] = []
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start: float | torch.cuda.Event | None = None

    def start(self) -> None:
        if self.seen < self.warmup:
            self._start = None
        elif self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        self.seen += 1
        if self._start is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self._cpu_ms.append((time.perf_counter() - self._start) * 1e3)
        self._start = None

    def times_ms(self) -> list[float]:
        if self._events:
            torch.cuda.synchronize()
            self._cpu_ms.extend(s.elapsed_time(e) for s, e in self._events)
            self._events.clear()
        return self._cpu_ms

    def median_ms(self) -> float | None:
        times = self.times_ms()
        return statistics.median(times) if times else None

    def last_ms(self) -> float | None:
        """The latest CPU-timed step (None on CUDA, where reading it would synchronise)."""
        return self._cpu_ms[-1] if self._cpu_ms and not self.cuda else None
