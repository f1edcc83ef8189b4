"""What a training step costs: its time, the FLOPs it does and model FLOPs utilisation (MFU),
and its memory (what autograd saves for backward, the batch-independent part, the peak).

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

Memory: ``SavedTensorMeter`` counts the bytes autograd saves for backward (the activation
memory AMP halves), ``model_memory`` the batch-independent part (parameters, gradients, optimizer
state), and ``capacity_metrics`` what the two predict of the largest batch that fits
(``measure.capacity``).
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from ampsweep.measure import capacity
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


# ---------------------------------------------------------------- memory

MIB = 1024**2


NO_RECORDING = contextlib.nullcontext()  # stateless: shared by every step not measured


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
        self.by_dtype: dict[str, int] = {}  # the same bytes by the saved tensors' dtype

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
            name = dtype_name(t.dtype)
            self.by_dtype[name] = self.by_dtype.get(name, 0) + size
        return t

    def record(self, enabled: bool = True) -> contextlib.AbstractContextManager:
        """Count what autograd saves inside this context (the loop measures its very first
        micro-batch only; the others get a plain null context, cheaper than a generator's)."""
        return self._recording() if enabled else NO_RECORDING

    @contextlib.contextmanager
    def _recording(self):
        self._seen.clear()
        self.bytes = 0
        self.by_dtype = {}
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


# ---------------------------------------------------------------- capacity

DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8e4m3",
    torch.float8_e5m2: "fp8e5m2",
}


def dtype_name(dtype: torch.dtype) -> str:
    """A short name without underscores (metric names put it after one: ``params_fp32``)."""
    return DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.").replace("_", "")


def _add(out: dict[str, float], part: str, t: torch.Tensor, nbytes: int | None = None) -> None:
    t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor (FSDP): this rank's shard
    key = f"{part}_{dtype_name(t.dtype)}"
    out[key] = out.get(key, 0) + (t.numel() * t.element_size() if nbytes is None else nbytes)


def model_memory(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Bytes that do not depend on the batch, as ``<part>_<dtype>``: ``params`` (under autocast
    these fp32 parameters are the master weights; pure modes keep no fp32 copy), ``grads``
    (one per trainable parameter, in its dtype) and ``optimizer`` state (read from the
    optimizer, so after its first step). Of sharded tensors (FSDP), this rank's shards."""
    out: dict[str, float] = {}
    for p in module.parameters():
        _add(out, "params", p)
        if p.requires_grad:
            _add(out, "grads", p)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                _add(out, "optimizer", value)
    return out


def saved_bytes(module, x: torch.Tensor, y: torch.Tensor, policy, loss=None) -> SavedTensorMeter:
    """What autograd saves for backward in one forward pass and ``loss`` (the run's objective;
    default cross-entropy) on ``(x, y)``, counted as on a run's first step (by dtype too),
    without touching the run's state: the parameters are detached leaves that share their
    memory, buffers are copies, the RNG is restored."""
    loss = loss or cross_entropy
    params = {n: p.detach().requires_grad_(p.requires_grad) for n, p in module.named_parameters()}
    buffers = {n: b.clone() for n, b in module.named_buffers()}
    meter = SavedTensorMeter(module)
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), meter.record(), policy.autocast():
        logits = torch.func.functional_call(module, {**params, **buffers}, (x,))
        loss(logits, y)  # the graph is dropped on return: nothing runs back
    return meter


def capacity_metrics(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    policy,
    loss=None,
    held: dict[str, float] | None = None,
) -> dict[str, float]:
    """What one sample costs and what the model costs, in memory, and on a CUDA GPU the largest
    batch its memory would hold (``measure.capacity``). ``loss``: the run's objective.
    ``held``: the model's memory as one rank holds it, where that is not ``module``'s
    (FSDP: its shards and the gathered parameters; ``module`` is the whole model), so the
    prediction is per rank.

    The saved-tensor count is taken at two batch sizes (``x`` and half of it): the slope is
    the activation bytes per sample, the intercept what autograd saves whatever the batch
    (autocast's low-precision copies of the weights, ``weight_copies``)."""
    batch = x.shape[0]
    other = batch // 2 if batch >= 2 else 2
    # Copies, not views: the meter counts a saved tensor's whole storage.
    xs = x[:other].clone() if other < batch else torch.cat([x, x])
    ys = y[:other].clone() if other < batch else torch.cat([y, y])
    big, small = saved_bytes(module, x, y, policy, loss), saved_bytes(module, xs, ys, policy, loss)
    _, slope = capacity.per_sample({batch: big.bytes, other: small.bytes})
    parts = dict(held) if held is not None else model_memory(module, optimizer)
    for dtype in sorted(set(big.by_dtype) | set(small.by_dtype)):
        copies, _ = capacity.per_sample(
            {batch: big.by_dtype.get(dtype, 0), other: small.by_dtype.get(dtype, 0)}
        )
        if copies >= 1024:  # below that: a few saved scalars, not weights
            parts[f"weight_copies_{dtype}"] = copies
    model_bytes = sum(parts.values())
    out = {capacity.BYTES_PER_SAMPLE: slope, capacity.MODEL_MIB: model_bytes / MIB}
    totals: dict[str, float] = {}
    for key, nbytes in parts.items():
        out[f"mem/{key}_mib"] = nbytes / MIB
        part = key.rsplit("_", 1)[0]
        totals[part] = totals.get(part, 0) + nbytes
    out.update({f"mem/{part}_mib": nbytes / MIB for part, nbytes in totals.items()})
    if x.device.type == "cuda":
        budget = torch.cuda.get_device_properties(x.device).total_memory
        out[capacity.BUDGET_GIB] = budget / capacity.GIB
        predicted = capacity.predict_max_batch(budget, model_bytes, slope)
        if predicted is not None:
            out[capacity.MAX_BATCH_PREDICTED] = predicted
    return out
