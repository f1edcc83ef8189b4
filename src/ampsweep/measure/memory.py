"""Memory: what autograd saves for backward (activation memory), and peak memory."""

from __future__ import annotations

import contextlib
import resource
import sys

import torch

MIB = 1024**2


class SavedTensorMeter:
    """Bytes of the tensors autograd saves for backward: the activation memory AMP halves.

    ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor packed for backward. Each
    storage is counted once, and parameters are left out: they exist whatever the precision
    (their half-precision copies made by autocast do count: they are extra memory).
    """

    def __init__(self, model: torch.nn.Module, measured_bytes: int = 0):
        self._param_ptrs = {p.data_ptr() for p in model.parameters()}
        self._seen: set[tuple[str, int]] = set()
        self.bytes = measured_bytes  # a resumed run keeps what its first step measured

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
