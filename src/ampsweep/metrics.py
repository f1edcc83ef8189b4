"""Measurements: step time, activation memory, peak memory."""

from __future__ import annotations

import contextlib
import resource
import statistics
import sys
import time

import torch

MIB = 1024**2


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


class SavedTensorMeter:
    """Bytes of the tensors autograd saves for backward: the activation memory AMP halves.

    ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor packed for backward. Each
    storage is counted once, and parameters are left out: they exist whatever the precision
    (their half-precision copies made by autocast do count: they are extra memory).
    """

    def __init__(self, model: torch.nn.Module):
        self._param_ptrs = {p.data_ptr() for p in model.parameters()}
        self._seen: set[tuple[str, int]] = set()
        self.bytes = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            size = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
            key, size = (str(t.device), id(t)), t.numel() * t.element_size()
        if key[1] not in self._param_ptrs and key not in self._seen:
            self._seen.add(key)
            self.bytes += size
        return t

    @contextlib.contextmanager
    def record(self, enabled: bool = True):
        if not enabled:
            yield
            return
        self._seen.clear()
        self.bytes = 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield

    @property
    def mib(self) -> float:
        return self.bytes / MIB


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak memory metrics: the process's RSS, and the CUDA allocator's peaks on CUDA."""
    out = {"mem/peak_rss_mib": peak_rss_mib()}
    if device.type == "cuda":
        out["mem/peak_allocated_mib"] = torch.cuda.max_memory_allocated(device) / MIB
        out["mem/peak_reserved_mib"] = torch.cuda.max_memory_reserved(device) / MIB
    return out


def peak_rss_mib() -> float:
    """Peak resident set size of this process (ru_maxrss: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / MIB if sys.platform == "darwin" else rss / 1024
