"""What a training step costs in memory: what autograd saves for backward, the batch-independent
part, the peak.

``SavedTensorMeter`` counts the bytes autograd saves for backward (the activation memory AMP
halves), ``model_memory`` the batch-independent part (parameters, gradients, optimizer state),
and ``capacity_metrics`` what the two predict of the largest batch that fits
(``measure.capacity``).
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from ampsweep.measure import capacity
from ampsweep.measure.cost import cross_entropy

MIB = 1024**2


NO_RECORDING = contextlib.nullcontext()  # stateless: shared by every step not measured
TOP_MODULES = 10  # the rows of memory/activations_by_module.json before "(other modules)"
OUTSIDE = ("(outside the model: the loss)", "")
OTHER_MODULES = "(other modules)"
FP8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
# Single-input steps between a weight and what is saved of it: a cast, then views of the cast
# (transpose, reshape, ...). Deeper than this, a tensor is a computation, not a copy.
WEIGHT_COPY_DEPTH = 4
COPIES_AND_VIEWS = {
    f"{op}Backward0"
    for op in (
        "ToCopy", "T", "Transpose", "Permute", "View", "UnsafeView", "Reshape", "Expand",
        "Unsqueeze", "Squeeze", "Alias", "Slice", "Select",
    )
}  # fmt: skip


class SavedTensorMeter:
    """Bytes of the tensors autograd saves for backward, by part and by module.

    ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor packed for backward. Each
    storage is counted once, and the weights themselves are left out: they exist whatever the
    precision. A saved tensor that autograd's graph leads back to a parameter through a cast
    (and views of it: a Linear saves its weight's transpose) is autocast's half-precision copy
    of that weight (``autocast_cache``); one in an fp8 dtype is ``fp8``; the rest are
    ``activations``. ``bytes`` is all three (the saved-for-backward bytes AMP halves). Each
    activation is also put to the innermost module whose forward was running when it was
    saved (module forward hooks, registered for the recording only).
    """

    def __init__(self, model: torch.nn.Module, measured_bytes: int = 0, by_module: bool = True):
        self._param_ptrs = {p.data_ptr() for p in model.parameters()}
        # Not under torch.compile, whose graphs would be compiled again once hooks come and go
        self._modules = [(n, m) for n, m in model.named_modules() if n] if by_module else []
        self._seen: set[tuple[str, int]] = set()
        self._running: list[tuple[str, str]] = []  # the modules running, inside each other
        self.bytes = measured_bytes  # a resumed run keeps what its first step measured
        self.by_dtype: dict[str, int] = {}  # the same bytes by the saved tensors' dtype
        self.parts: dict[str, int] = {}  # activations, autocast_cache, fp8
        self.by_module: dict[tuple[str, str], int] = {}  # (name, class) -> bytes
        self._counting = False  # while recording: whether this context counts
        self._keep: Keep | None = None  # and what it tells of each saved tensor

    def _pack(self, t: torch.Tensor) -> object:
        key, size = storage_of(t)
        if key[1] in self._param_ptrs:
            return t
        part = _part(t)
        if part is None:  # a weight itself (FSDP's gathered parameters): no saved memory
            return t
        if self._counting and key not in self._seen:
            self._seen.add(key)
            self._count(t, size, part)
        return t if self._keep is None else self._keep(t, key, part, size)

    def _count(self, t: torch.Tensor, size: int, part: str) -> None:
        self.bytes += size
        name = dtype_name(t.dtype)
        self.by_dtype[name] = self.by_dtype.get(name, 0) + size
        self.parts[part] = self.parts.get(part, 0) + size
        if part == "activations":  # the weight copies are the weights', not a module's doing
            where = self._running[-1] if self._running else OUTSIDE
            self.by_module[where] = self.by_module.get(where, 0) + size

    def record(
        self, enabled: bool = True, keep: Keep | None = None
    ) -> contextlib.AbstractContextManager:
        """Count what autograd saves inside this context (the loop measures its very first
        micro-batch only; the others get a plain null context, cheaper than a generator's).
        ``keep``: told of every tensor saved here, counted or not, with its storage, part and
        bytes; what it returns is what autograd holds until backward has used it (the
        measured step's ``StepPeak.keep``: what backward has not freed yet). One pair of
        saved-tensor hooks serves both: autograd applies only the innermost pair."""
        if keep is None and not enabled:
            return NO_RECORDING
        return self._recording(enabled, keep)

    @contextlib.contextmanager
    def _recording(self, counting: bool, keep: Keep | None):
        self._counting, self._keep = counting, keep
        hooks = []
        if counting:
            self._seen.clear()
            self.bytes = 0
            self.by_dtype, self.parts, self.by_module = {}, {}, {}
            self._running.clear()
            for name, module in self._modules:
                where = (name, type(module).__name__)
                hooks.append(module.register_forward_pre_hook(partial(self._enter, where)))
                hooks.append(module.register_forward_hook(self._leave, always_call=True))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            self._counting, self._keep = False, None
            for hook in hooks:
                hook.remove()

    def _enter(self, where: tuple[str, str], module, args) -> None:
        self._running.append(where)

    def _leave(self, module, args, output) -> None:
        if self._running:
            self._running.pop()

    @property
    def mib(self) -> float:
        return self.bytes / MIB

    def by_module_rows(self, top: int = TOP_MODULES) -> list[dict]:
        """The modules holding the most saved bytes, largest first, then one row for the
        rest: ``module`` (its qualified name), ``type`` (its class), ``mib``, ``share``."""
        total = sum(self.by_module.values())
        ranked = sorted(self.by_module.items(), key=lambda item: -item[1])
        rows = [_row(name, kind, nbytes, total) for (name, kind), nbytes in ranked[:top]]
        rest = sum(nbytes for _, nbytes in ranked[top:])
        if rest:
            rows.append(_row(OTHER_MODULES, "", rest, total))
        return rows


ACTIVATIONS_BY_MODULE = ("memory", "activations_by_module.json")  # a run's artifact


def log_activations_by_module(recorder, rows: list[dict]) -> None:
    """Log ``SavedTensorMeter.by_module_rows`` as the run's
    ``memory/activations_by_module.json``."""
    folder, name = ACTIVATIONS_BY_MODULE
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_text(json.dumps(rows, indent=2))
        recorder.log_artifact(path, folder)


# Told of a saved tensor (the tensor, its storage's key, its part, its storage's bytes), returns
# what autograd holds in its place until backward has used it
Keep = Callable[[torch.Tensor, tuple[str, int], str, int], object]


class Held:
    """A saved tensor as autograd holds it while a step is measured: ``release`` is called
    when autograd lets go of it (once its node has run in backward, or with the graph)."""

    __slots__ = ("release", "tensor")

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None]):
        self.tensor, self.release = tensor, release

    def __del__(self) -> None:
        self.release()


def _unpack(saved: object) -> torch.Tensor:
    return saved.tensor if isinstance(saved, Held) else saved  # type: ignore[return-value]


def storage_of(t: torch.Tensor) -> tuple[tuple[str, int], int]:
    """``((device, storage address), storage bytes)`` of a tensor: views of one storage share
    it (a tensor subclass without a storage: its own identity and its elements' bytes)."""
    try:
        storage = t.untyped_storage()
        return (str(t.device), storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
        return (str(t.device), id(t)), t.numel() * t.element_size()


def _row(name: str, kind: str, nbytes: int, total: int) -> dict:
    return {"module": name, "type": kind, "mib": nbytes / MIB, "share": nbytes / total}


def _part(t: torch.Tensor) -> str | None:
    """Which part of the saved memory ``t`` is: ``fp8``, ``autocast_cache`` (a cast of a
    parameter, or a view of one), ``activations``; None for a parameter itself."""
    if t.dtype in FP8_DTYPES:
        return "fp8"
    weight = _weight_of(t)
    if weight is None:
        return "activations"
    return None if weight.dtype == t.dtype else "autocast_cache"


def _weight_of(t: torch.Tensor) -> torch.nn.Parameter | None:
    """The parameter ``t`` is (or is a cast or view of), following autograd's graph back
    through casts and views only; None for anything computed."""
    if isinstance(t, torch.nn.Parameter):
        return t
    fn = t.grad_fn
    for _ in range(WEIGHT_COPY_DEPTH):
        if fn is None or fn.name() not in COPIES_AND_VIEWS:
            return None
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if len(inputs) != 1:
            return None
        fn = inputs[0]
        leaf = getattr(fn, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if leaf is not None:
            return leaf if isinstance(leaf, torch.nn.Parameter) else None
    return None


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes the model holds between steps: its parameters, the gradients that exist and the
    optimizer's state (this rank's shards under FSDP)."""
    tensors: list[torch.Tensor] = list(model.parameters())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values()]
    return sum(tensor_bytes(t) for t in tensors if isinstance(t, torch.Tensor))


def tensor_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor (FSDP): this rank's shard
    return t.numel() * t.element_size()


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
    the fp32 parameters are the weights the optimizer updates, not extra copies), ``grads``
    (one per trainable parameter, in its dtype), ``optimizer`` state (read from the
    optimizer, so after its first step) and ``master_weights``: fp32 copies an optimizer keeps
    beside half-precision parameters, in a state entry named for them (``master_param``, as
    optimizers that keep them name it): a pure mode's with ``precision.master_weights=true``
    (``engine.optim.MasterWeights``). Of sharded tensors (FSDP), this rank's
    shards."""
    out: dict[str, float] = {}
    for p in module.parameters():
        _add(out, "params", p)
        if p.requires_grad:
            _add(out, "grads", p)
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                _add(out, "master_weights" if "master" in str(key) else "optimizer", value)
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
    (autocast's low-precision copies of the weights: ``autocast_cache_<dtype>``). The totals
    ``mem/<part>_mib`` it gives are the sizes; a run's own are what was live at its step's
    peak (``breakdown``), which replace them."""
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
            parts[f"autocast_cache_{dtype}"] = copies
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
