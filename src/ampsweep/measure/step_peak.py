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

from ampsweep.measure.memory import MIB, SavedTensorMeter, held_bytes, peak_memory, tensor_bytes


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

    When: a hook before the optimizer's step splits the step in two phases, forward and
    backward, then the optimizer (``at_optimizer``: whether the peak is there; by then
    autograd has freed what it saved). Each gradient's post-accumulate hook marks how many
    gradient bytes exist (with a profiler event on a CPU; with the allocator's peak so far on
    CUDA), so the gradients live at a peak in backward are known (``grads``).
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
        self.grads = 0  # gradient bytes live at the peak
        self.at_optimizer = False  # whether the peak is in the optimizer's step
        self._held = self._before = self._start_grads = self._grads_now = 0
        self._counted: set[int] = set()
        self._marks: list[tuple[int, int]] = []  # CUDA: (gradient bytes, allocator peak so far)
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
        self._start_grads = self._grads_now = sum(
            tensor_bytes(p.grad) for p in params if p.grad is not None
        )
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

    def _grad_ready(self, p: torch.Tensor) -> None:
        if id(p) not in self._counted and p.grad is not None:  # new (later ones add in place)
            self._counted.add(id(p))
            self._grads_now += tensor_bytes(p.grad)
        if self.device.type == "cuda":  # a host-side count: no synchronisation
            peak = torch.cuda.max_memory_allocated(self.device)
            self._marks.append((self._grads_now, peak))
        else:
            with torch.profiler.record_function(f"{GRADS_MARK}{self._grads_now}"):
                pass

    def _optimizer_begins(self, optimizer, args, kwargs) -> None:
        params = self.model.parameters()
        self._all_grads = sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
        if self.device.type == "cuda":
            self._forward_backward = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with torch.profiler.record_function(OPTIMIZER_MARK):
                pass

    def stop(self) -> None:
        if not self._measuring:
            return
        self._measuring = False
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            above, self.grads, self.at_optimizer = self._cuda_peak()
        else:
            assert self._profile is not None  # started at this step
            self._profile.stop()
            above, self.grads, self.at_optimizer = self._cpu_peak(self._profile)
            self._profile = None
        self.bytes = self._held + max(0, above)

    def _cuda_peak(self) -> tuple[int, int, bool]:
        """(bytes above the start, gradient bytes then, whether in the optimizer's step)."""
        now = torch.cuda.max_memory_allocated(self.device)
        if self._forward_backward is not None and now >= self._forward_backward:
            return now - self._before, self._all_grads, True
        peak = now if self._forward_backward is None else self._forward_backward
        grads = self._start_grads  # the gradients before the first mark that saw the peak
        for grads_then, peak_then in self._marks:
            if peak_then >= peak:
                return peak - self._before, grads, False
            grads = grads_then
        return peak - self._before, grads, False

    def _cpu_peak(self, profile) -> tuple[int, int, bool]:
        """The same from a CPU profile's events, walked in time order: the live bytes are
        counted from the profile's start, their peak from the measured step's start."""
        events = sorted(profile.profiler.kineto_results.events(), key=lambda e: e.start_ns())
        live = most = 0
        start: int | None = None  # the live bytes as the measured step starts
        grads = most_grads = self._start_grads
        optimizer = at_optimizer = False
        for event in events:
            name = event.name()
            if name == "[memory]":
                live += event.nbytes()
                if start is not None and live - start > most:
                    most, most_grads, at_optimizer = live - start, grads, optimizer
            elif name == STEP_MARK:
                start = live
            elif name.startswith(GRADS_MARK):
                grads = int(name.removeprefix(GRADS_MARK))
            elif name == OPTIMIZER_MARK:
                optimizer, grads = True, self._all_grads
        return most, most_grads, at_optimizer

    def peak_memory(self) -> dict[str, float]:
        """``peak_memory`` of the whole run: on CUDA, the larger of the peaks before the
        measured step's reset and after it."""
        now = peak_memory(self.device)
        return {key: max(value, self._earlier.get(key, 0.0)) for key, value in now.items()}


KINETO_QUIET = "6"  # above its highest level (USDT, 5): nothing printed
GRADS_MARK = "ampsweep::gradient bytes "  # profiler events the measured step adds
OPTIMIZER_MARK = "ampsweep::optimizer step"
STEP_MARK = "ampsweep::measured step"


PARTS = ("params", "grads", "optimizer", "master_weights", "autocast_cache", "activations", "fp8")


def breakdown(peak: StepPeak, held: dict[str, float], meter: SavedTensorMeter) -> dict[str, float]:
    """The measured step's peak and what was live at it, as metrics in MiB:
    ``mem/step_peak_mib``, ``mem/<part>_mib`` for each of ``PARTS`` (0.0 for a part the mode
    does not have, or that was not live then), ``mem/other_mib`` (the peak minus the parts:
    temporaries such as the gradients of activations in backward or the optimizer's
    intermediate results, workspace; never hidden), and ``mem/step_peak_at_optimizer`` (1.0
    when the peak is in the optimizer's step).

    ``held``: the model's memory by ``<part>_<dtype>`` (``model_memory``; under FSDP
    ``params`` are this rank's shards and ``params_gathered`` the unsharded parameters it
    holds at once while forward and backward run, recorded apart as ``params_sharded`` and
    ``params_gathered``; ``params`` counts both at a peak in forward or backward).
    ``meter``: what a micro-batch saved for backward, all of it live until backward begins:
    at a peak in backward, some of it may already be freed (then ``other`` is understated).
    At a peak in the optimizer's step, autograd has freed it all."""
    assert peak.bytes is not None  # measured
    totals: dict[str, float] = {}
    for key, nbytes in held.items():
        part = key.rsplit("_", 1)[0]
        totals[part] = totals.get(part, 0) + nbytes
    saved = {} if peak.at_optimizer else meter.parts
    sizes = {part: float(totals.get(part, 0) + saved.get(part, 0)) for part in PARTS}
    sizes["grads"] = float(peak.grads)
    if not peak.at_optimizer:  # FSDP's gathered parameters: freed before the optimizer's step
        sizes["params"] += totals.get("params_gathered", 0)
    out = {f"mem/{part}_mib": nbytes / MIB for part, nbytes in sizes.items()}
    if "params_gathered" in totals:
        out["mem/params_sharded_mib"] = totals.get("params", 0) / MIB
        out["mem/params_gathered_mib"] = totals["params_gathered"] / MIB
    out["mem/step_peak_mib"] = peak.bytes / MIB
    out["mem/other_mib"] = (peak.bytes - sum(sizes.values())) / MIB
    out["mem/step_peak_at_optimizer"] = float(peak.at_optimizer)
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
