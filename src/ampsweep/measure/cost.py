"""What a training step costs in time and compute: its time, the FLOPs it does and model FLOPs
utilisation (MFU). What it costs in memory is ``measure.memory``'s.

``StepTimer`` times each optimizer step after ``trainer.timing_warmup_steps``, without adding a
sync per step; the run reports the median.

The FLOPs of one training step (forward and backward of every micro-batch; the optimizer's
element-wise update is left out, as in the usual MFU definition) are counted once, with
``torch.utils.flop_counter.FlopCounterMode``, which counts matmuls, convolutions and attention
from their shapes. The count does not depend on the dtype, so the same number serves every
precision mode. ``perf/tflops`` is that count over the median step time; ``perf/mfu`` divides
it by the GPU's peak dense throughput for the mode's math (table below; an fp8 mode is measured
against the fp8 peak, the hardware's best, although only its converted Linear layers run in fp8
and the rest runs in bf16). An unknown GPU gets no MFU rather than a wrong one; CPUs get
``perf/tflops`` only.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

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


@dataclass(frozen=True)
class Peak:
    """Peak dense TFLOPS (no structured sparsity) of one GPU model, per kind of math."""

    fp32: float  # plain fp32 (CUDA cores)
    tf32: float | None  # fp32 inputs on tensor cores (None: no TF32, pre-Ampere)
    fp16: float  # fp16 tensor cores, fp32 accumulate
    bf16: float | None  # None: no bf16 tensor cores (pre-Ampere)
    fp8: float | None = None  # fp8 (E4M3/E5M2) tensor cores; None: none (before Ada/Hopper)


# Vendor datasheet numbers. NVIDIA quotes tensor-core figures "with sparsity" (marked * in the
# datasheets); the dense figure, which is what training runs at, is half of it.
# Matched against torch.cuda.get_device_name() in order (first match wins).
PEAKS: list[tuple[str, str, Peak]] = [
    # NVIDIA H200 Tensor Core GPU datasheet: H200 SXM FP32 67, TF32 989*, BF16/FP16 1979*,
    # FP8 3958*; H200 NVL FP32 60, TF32 835*, BF16/FP16 1671*, FP8 3341*.
    (r"\bH200 NVL\b", "H200 NVL", Peak(60.0, 417.5, 835.5, 835.5, 1670.5)),
    (r"\bH200\b", "H200 SXM", Peak(67.0, 494.5, 989.5, 989.5, 1979.0)),
    # NVIDIA H100 Tensor Core GPU datasheet: SXM FP32 67, TF32 989*, BF16/FP16 1979*,
    # FP8 3958*; PCIe FP32 51, TF32 756*, BF16/FP16 1513*, FP8 3026*; NVL FP32 60, TF32 835*,
    # BF16/FP16 1671*, FP8 3341*.
    (r"\bH100 NVL\b", "H100 NVL", Peak(60.0, 417.5, 835.5, 835.5, 1670.5)),
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe", Peak(51.0, 378.0, 756.5, 756.5, 1513.0)),
    (r"\bH100\b", "H100 SXM", Peak(67.0, 494.5, 989.5, 989.5, 1979.0)),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM and PCIe, 40 and 80 GB): FP32 19.5,
    # TF32 156 (312*), BF16 312 (624*), FP16 312 (624*).
    (r"\bA100\b", "A100", Peak(19.5, 156.0, 312.0, 312.0)),
    # NVIDIA L40S datasheet: FP32 91.6, TF32 183 (366*), BF16/FP16 362.05 (733*),
    # FP8 733 (1466*).
    (r"\bL40S\b", "L40S", Peak(91.6, 183.0, 362.05, 362.05, 733.0)),
    # NVIDIA A40 datasheet: FP32 37.4, TF32 74.8 (149.6*), BF16/FP16 149.7 (299.4*).
    (r"\bA40\b", "A40", Peak(37.4, 74.8, 149.7, 149.7)),
    # NVIDIA L4 datasheet: FP32 30.3, TF32 120*, BF16/FP16 242*, FP8 485*.
    (r"\bL4\b", "L4", Peak(30.3, 60.0, 121.0, 121.0, 242.5)),
    # NVIDIA A10 datasheet: FP32 31.2, TF32 62.5 (125*), BF16/FP16 125 (250*). The AWS A10G
    # is a different part and does not match (\b stops "A10" at "A10G").
    (r"\bA10\b", "A10", Peak(31.2, 62.5, 125.0, 125.0)),
    # NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090: FP32 82.6, TF32 82.6
    # (165.2*), FP16/BF16 tensor with FP32 accumulate 165.2 (330.4*), FP8 tensor with FP32
    # accumulate 330.3 (660.6*) (autocast and torchao accumulate in fp32, so the
    # fp16-accumulate figures do not apply).
    (r"\bRTX 4090\b", "RTX 4090", Peak(82.6, 82.6, 165.2, 165.2, 330.3)),
    # NVIDIA V100 datasheet: SXM2 FP32 15.7, tensor 125; PCIe 14, 112; V100S PCIe 16.4, 130.
    # Volta has neither TF32 nor bf16.
    (r"\bV100S\b", "V100S PCIe", Peak(16.4, None, 130.0, None)),
    (r"\bV100\b.*\bPCIE\b", "V100 PCIe", Peak(14.0, None, 112.0, None)),
    (r"\bV100\b", "V100 SXM2", Peak(15.7, None, 125.0, None)),
    # NVIDIA T4 datasheet: FP32 8.1, mixed precision (FP16/FP32) 65.
    (r"\bT4\b", "T4", Peak(8.1, None, 65.0, None)),
]


def lookup_peak(device_name: str) -> tuple[str, Peak] | None:
    """The table entry for a GPU name as CUDA reports it, or None for an unknown GPU."""
    for pattern, label, peak in PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return label, peak
    return None


def peak_tflops(device_name: str, kind: str) -> float | None:
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
