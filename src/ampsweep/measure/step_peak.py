"""The measured peak of one training step, and what was live at that moment.

How it is measured, on CUDA and on a CPU, is ``StepPeak``'s docstring; what the peak is made
of, ``breakdown``.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

import torch

from ampsweep.measure.live import LIVE, Live, Snapshot, made_before, numbers, plus, text
from ampsweep.measure.memory import MIB, Keep, held_bytes, peak_memory, tensor_bytes


class StepPeak:
    """The measured peak of one training step (forward, loss, backward, optimizer step,
    zero_grad), taken once per run, and what was live at that moment: the loop calls
    ``start(step)`` and ``stop()`` around every optimizer step, and they do nothing but on
    step ``at``: the second step of the run (or of a resumed run's segment), once the
    optimizer's state exists; the first where the second would leave no step to time (a
    one-step run, or two steps with one of warm-up), which then measures the peak of a step
    whose optimizer's state is made in it. That step is left out of the step time.

    The peak is what the model holds as the step begins (parameters, gradients, optimizer
    state: ``held_bytes``) plus the most the step allocated above that. On CUDA the allocator
    says it (``torch.cuda.max_memory_allocated`` after a reset, minus what was allocated at
    the start). On a CPU, ``torch.profiler.profile(profile_memory=True)`` records every
    allocation and free of the step in time order (the ``[memory]`` events of the profile's
    results); their running sum is the live bytes above the start, its maximum the peak.
    Blocks allocated before the step and freed in it are not seen (the profiler cannot size
    them), which can only overstate the peak.

    What was live then is counted as the step runs (``Live``), and each change marked in time
    beside the allocations: with a profiler event on a CPU, with the allocator's peak so far
    on CUDA (a host-side count: no synchronisation). The parts live at the peak are those of
    the last mark before it. Marked: each gradient's post-accumulate hook (the gradient bytes
    that exist), each tensor saved for backward as autograd takes it and lets go of it once
    its node has run (``keep``: activations, the autocast cache, fp8), and each node of the
    backward graph as it begins and ends (``watch``: the gradients of activations in
    flight). A hook before the optimizer's step splits the step in two phases, forward and
    backward, then the optimizer (``at_optimizer``: whether the peak is there), whose
    intermediate results are what it allocated and still held at the peak
    (``intermediates``).
    """

    def __init__(self, device, model, optimizer, done: int, total: int, warmup: int = 0):
        """``done``: the steps taken before this segment; ``total``: the run's steps;
        ``warmup``: the segment's first steps the step time leaves out."""
        self.device, self.model, self.optimizer = device, model, optimizer
        steps = total - done
        # The second step, unless that would leave no step to time: then the first
        self.at = done + 2 if steps >= 3 or (steps == 2 and warmup >= 2) else done + 1
        self._measuring = False
        self.bytes: float | None = None  # the step's peak, once measured
        self.live: dict[str, int] = {}  # the parts live at the peak (``LIVE``), in bytes
        self.at_optimizer = False  # whether the peak is in the optimizer's step
        self.intermediates = 0  # at a peak in the optimizer's step: what its step held then
        self._held = self._before = self._at_optimizer = 0
        self._now = Live(self._mark)
        self._counted: set[int] = set()
        self._marks: list[tuple[Snapshot, Snapshot, int]] = []  # CUDA: (state, made, peak)
        self._forward_backward: int | None = None  # CUDA: the peak before the optimizer's step
        self._all_grads = 0  # gradient bytes as the optimizer's step begins
        self._hooks: list = []
        self._earlier: dict[str, float] = {}  # CUDA: the run's peaks before the reset
        self._profile: torch.profiler.profile | None = None

    def start(self, step: int) -> bool:
        """Begin measuring if ``step`` (1-based) is the measured one; whether it is (or is the
        step before it, which a CPU profile covers too: the tensors it leaves, freed in the
        measured step, are then known to the profiler)."""
        if step == self.at - 1 and self.device.type != "cuda":
            self._profile_cpu()
            return True
        if step != self.at:
            return False
        self._measuring = True
        self._held = held_bytes(self.model, self.optimizer)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self._counted = {id(p) for p in params if p.grad is not None}  # accumulated into
        grads = sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
        self._now = Live(self._mark, grads)
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        self._hooks.append(self.optimizer.register_step_pre_hook(self._optimizer_begins))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._earlier = peak_memory(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            if self._profile is None:  # a one-step run: no step before
                self._profile_cpu()
            with torch.profiler.record_function(STEP_MARK):
                pass
        return True

    def _profile_cpu(self) -> None:
        # Kineto, which the profiler starts, prints start/stop lines on stderr at its
        # default log level: one step measured is not worth a console message.
        os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)
        spend_allocator_note()
        self._profile = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        self._profile.start()

    @property
    def keep(self) -> Keep | None:
        """What the saved-tensor hooks tell of each tensor saved in the measured step
        (``SavedTensorMeter.record``); None in every other step."""
        return self._now.keep if self._measuring else None

    def watch(self, loss: torch.Tensor) -> None:
        """Mark the gradients of activations in flight in the backward pass from ``loss``,
        node by node, in the measured step (nothing in every other step)."""
        if self._measuring:
            self._now.watch(loss)

    def _mark(self, state: Snapshot, made: Snapshot) -> None:
        if self.device.type == "cuda":
            self._marks.append((state, made, torch.cuda.max_memory_allocated(self.device)))
        else:
            with torch.profiler.record_function(f"{LIVE_MARK}{text(state)}|{text(made)}"):
                pass

    def _grad_ready(self, p: torch.Tensor) -> None:
        if id(p) not in self._counted and p.grad is not None:  # new (later ones add in place)
            self._counted.add(id(p))
            self._now.add("grads", tensor_bytes(p.grad))

    def _optimizer_begins(self, optimizer, args, kwargs) -> None:
        params = self.model.parameters()
        self._all_grads = sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
        if self.device.type == "cuda":
            self._forward_backward = torch.cuda.max_memory_allocated(self.device)
            self._at_optimizer = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with torch.profiler.record_function(OPTIMIZER_MARK):
                pass

    def stop(self) -> None:
        if not self._measuring:
            return
        self._measuring = False
        self._now.close()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            above, live, self.at_optimizer, self.intermediates = self._cuda_peak()
        else:
            assert self._profile is not None  # started at this step
            self._profile.stop()
            above, live, self.at_optimizer, self.intermediates = self._cpu_peak(self._profile)
            self._profile = None
        self.live = dict(zip(LIVE, live, strict=True))
        self.bytes = self._held + max(0, above)

    def _at_optimizer_state(self) -> Snapshot:
        """What is live as the optimizer's step begins: every gradient, nothing saved."""
        return Live(None, self._all_grads).snapshot()

    def _cuda_peak(self) -> tuple[int, Snapshot, bool, int]:
        """(bytes above the start, the parts live then, whether in the optimizer's step, its
        intermediate results then)."""
        now = torch.cuda.max_memory_allocated(self.device)
        if self._forward_backward is not None and now >= self._forward_backward:
            return now - self._before, self._at_optimizer_state(), True, now - self._at_optimizer
        peak = now if self._forward_backward is None else self._forward_backward
        state = self._now.first  # the parts as the step began
        for then, made, peak_then in self._marks:
            if peak_then >= peak:  # reached since the mark before: its state, what a node made
                return peak - self._before, plus(state, made), False, 0
            state = then
        return peak - self._before, state, False, 0

    def _cpu_peak(self, profile) -> tuple[int, Snapshot, bool, int]:
        """The same from a CPU profile's events, walked in time order: the live bytes are
        counted from the profile's start, their peak from the measured step's start."""
        events = sorted(profile.profiler.kineto_results.events(), key=lambda e: e.start_ns())
        live = most = optimizer_live = 0
        start: int | None = None  # the live bytes as the measured step starts
        state = most_state = self._now.first
        optimizer = at_optimizer = reached = False  # reached: the peak, since the last mark
        later = 0  # bytes allocated since the peak
        for event in events:
            name = event.name()
            if name == "[memory]":
                live += event.nbytes()
                later += max(0, event.nbytes())
                if start is not None and live - start > most:
                    most, most_state, at_optimizer, reached = live - start, state, optimizer, True
                    later = 0
            elif name == STEP_MARK:
                start = live
            elif name.startswith(LIVE_MARK) and not optimizer:
                then, made = (numbers(n) for n in name.removeprefix(LIVE_MARK).split("|"))
                if reached:  # a node ending now ran at the peak: what it made before it
                    most_state = plus(state, made_before(made, later))
                state, reached = then, False
            elif name == OPTIMIZER_MARK:
                optimizer, state, optimizer_live = True, self._at_optimizer_state(), live
        intermediates = most + (start or 0) - optimizer_live if at_optimizer else 0
        return most, most_state, at_optimizer, intermediates

    def peak_memory(self) -> dict[str, float]:
        """``peak_memory`` of the whole run: on CUDA, the larger of the peaks before the
        measured step's reset and after it."""
        now = peak_memory(self.device)
        return {key: max(value, self._earlier.get(key, 0.0)) for key, value in now.items()}


KINETO_QUIET = "6"  # above its highest level (USDT, 5): nothing printed
LIVE_MARK = "ampsweep::live "  # profiler events the measured step adds
OPTIMIZER_MARK = "ampsweep::optimizer step"
STEP_MARK = "ampsweep::measured step"

PARTS = (
    "params", "grads", "optimizer", "master_weights", "autocast_cache", "activations",
    "activation_grads", "fp8",
)  # fmt: skip


def breakdown(peak: StepPeak, held: dict[str, float]) -> dict[str, float]:
    """The measured step's peak and what was live at it, as metrics in MiB:
    ``mem/step_peak_mib``, ``mem/<part>_mib`` for each of ``PARTS`` (0.0 for a part the mode
    does not have, or that was not live then), ``mem/other_mib`` (the peak minus the parts:
    a kernel's temporaries and workspace, the batch, what the loop holds; never hidden),
    ``mem/step_peak_at_optimizer`` (1.0 when the peak is in the optimizer's step) and
    ``mem/optimizer_intermediates_mib`` (then: what its step allocated and still held,
    counted in ``optimizer`` with its state).

    ``held``: the model's memory by ``<part>_<dtype>`` (``model_memory``; under FSDP
    ``params`` are this rank's shards and ``params_gathered`` the unsharded parameters it
    holds at once while forward and backward run, recorded apart as ``params_sharded`` and
    ``params_gathered``; ``params`` counts both at a peak in forward or backward). The
    gradients, what autograd saved and the gradients of activations are those live at the
    peak (``StepPeak.live``)."""
    assert peak.bytes is not None  # measured
    totals: dict[str, float] = {}
    for key, nbytes in held.items():
        part = key.rsplit("_", 1)[0]
        totals[part] = totals.get(part, 0) + nbytes
    sizes = {part: float(totals.get(part, 0)) for part in PARTS}
    sizes.update({part: float(nbytes) for part, nbytes in peak.live.items()})
    sizes["optimizer"] += peak.intermediates
    if not peak.at_optimizer:  # FSDP's gathered parameters: freed before the optimizer's step
        sizes["params"] += totals.get("params_gathered", 0)
    out = {f"mem/{part}_mib": nbytes / MIB for part, nbytes in sizes.items()}
    if "params_gathered" in totals:
        out["mem/params_sharded_mib"] = totals.get("params", 0) / MIB
        out["mem/params_gathered_mib"] = totals["params_gathered"] / MIB
    out["mem/step_peak_mib"] = peak.bytes / MIB
    out["mem/other_mib"] = (peak.bytes - sum(sizes.values())) / MIB
    out["mem/step_peak_at_optimizer"] = float(peak.at_optimizer)
    out["mem/optimizer_intermediates_mib"] = peak.intermediates / MIB
    return out


# What the CPU allocator prints, once a process, when a block allocated before a profile is
# freed in it (the profile's own business, said in StepPeak's docstring)
PROFILER_NOTE = re.compile(r"CPUAllocator\.cpp.*allocated before the profiling started")


def spend_allocator_note() -> None:
    """Have the CPU allocator print its note (``PROFILER_NOTE``) now, in a profile of a free
    and nothing else, with the process's stderr (file descriptor 2, where C++ writes) held in
    a temporary file, and written out without it: it is printed once a process, so the
    measured step's profile does not print it on the console."""
    block = torch.empty(1)
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            ):
                del block
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        lines = held.read().decode(errors="replace").splitlines(keepends=True)
    kept = "".join(line for line in lines if not PROFILER_NOTE.search(line))
    if kept:
        os.write(2, kept.encode())
