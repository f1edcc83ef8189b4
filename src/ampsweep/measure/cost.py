"""What a training step costs in time and compute: its time, the FLOPs it does and model FLOPs
utilisation (MFU). What it costs in memory is ``measure.memory``'s.

``StepTimer`` times each optimizer step after ``trainer.timing_warmup_steps``, without adding a
sync per step; the run reports the median.

The FLOPs of one training step (forward and backward of every micro-batch; the optimizer's
element-wise update is left out, as in the usual MFU definition) are counted once, with
``torch.utils.flop_counter.FlopCounterMode``, which counts matmuls, convolutions and attention
from their shapes. The count does not depend on the dtype, so the same number serves every
precision mode. ``perf/tflops`` is that count over the median step time; ``perf/mfu`` divides
it by the GPU's peak dense throughput for the mode's math (the GPU table of
``measure.roofline``; an fp8 mode is measured against the fp8 peak, the hardware's best,
although only its converted Linear layers run in fp8 and the rest runs in bf16). An unknown
GPU gets no MFU rather than a wrong one; CPUs get ``perf/tflops`` only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from ampsweep.measure.roofline import lookup_peak
from ampsweep.precision.policy import PrecisionPolicy

# ---------------------------------------------------------------- step time


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
        if isinstance(self._start, torch.cuda.Event):  # on CUDA
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


# ---------------------------------------------------------------- FLOPs and MFU


def peak_tflops(device_name: str, kind: str) -> float | None:
    """Dense TFLOPS of a kind of math on a GPU named as CUDA names it (the table lives in
    ``measure.roofline``); None for an unknown GPU or one without that kind."""
    found = lookup_peak(device_name)
    return None if found is None else getattr(found[1], kind)


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A classifier's loss, for counting a model on its own (a run passes its own loss)."""
    return F.cross_entropy(logits.float(), y)


def train_step_flops(
    module: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    policy: PrecisionPolicy,
    micro_batches: int = 1,
    loss: LossFn = cross_entropy,
) -> int:
    """FLOPs of one optimizer step: forward + backward on batch ``(x, y)``, times micro-batches.

    ``loss(logits, y)``: the run's loss (the training loop's objective), computed as in a
    training step. Runs one real forward/backward on ``module`` (the plain module: not
    compiled, not DDP) without touching the run's state: the gradients go to detached leaves
    (not ``.grad``), buffers (BatchNorm running stats) are copies, and the RNG is restored
    afterwards.
    """
    params = {n: p.detach().requires_grad_(p.requires_grad) for n, p in module.named_parameters()}
    buffers = {n: b.clone() for n, b in module.named_buffers()}
    leaves = [p for p in params.values() if p.requires_grad]
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), FlopCounterMode(display=False) as counter:
        with policy.autocast():
            logits = torch.func.functional_call(module, {**params, **buffers}, (x,))
            value = loss(logits, y)
        torch.autograd.grad(value, leaves)
    return int(counter.get_total_flops()) * micro_batches


def speed_metrics(
    flops_per_step: int, step_ms: float | None, device: torch.device, policy: PrecisionPolicy
) -> dict[str, float]:
    """``perf/tflops`` (achieved), and ``perf/mfu`` on a GPU whose peak is known."""
    if not flops_per_step or not step_ms:
        return {}
    tflops = flops_per_step / (step_ms / 1e3) / 1e12
    out = {"perf/tflops": tflops, "perf/gflops_per_step": flops_per_step / 1e9}
    # An emulated fp8 run computes its fp8 matmuls in higher precision: no MFU against a peak.
    if device.type == "cuda" and not policy.emulated:
        peak = peak_tflops(torch.cuda.get_device_name(device), policy.mode.flop_kind)
        if peak:
            out["perf/mfu"] = tflops / peak
    return out
