"""The training loop: one loop for every precision mode, every AMP step in order.

The precision policy supplies an autocast context (or a disabled one) and a GradScaler (a no-op
when disabled), so ``fit`` has no per-mode branches; the run's objective (its task and loss:
``engine.tasks``) turns logits into the loss, so it has no per-task branches either. What is
not a training step lives beside it: the running totals (``Totals``), the end-of-run numbers
(``summarise``), and null objects for the progress bar, the checkpointer and the stop
request, so the loop never asks whether one is there.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ampsweep.engine import distributed
from ampsweep.engine.build import Setup
from ampsweep.engine.data.batches import Batches
from ampsweep.engine.measured import measured
from ampsweep.engine.optim import step_schedule
from ampsweep.engine.tasks import Objective, default_objective
from ampsweep.measure import names
from ampsweep.measure.cost import StepTimer
from ampsweep.measure.memory import SavedTensorMeter
from ampsweep.measure.numerics import NonfiniteWatch
from ampsweep.measure.step_peak import StepPeak
from ampsweep.precision.policy import PrecisionPolicy, found_inf

LogFn = Callable[[dict[str, float], int], None]


@dataclass
class TrainState:
    """Where training is: enough to continue it (the optimizer steps taken so far)."""

    step: int = 0
    epoch: int = 0
    batch: int = 0  # micro-batches of ``epoch`` already consumed
    # Running totals a resumed run continues from (plain numbers, stored in checkpoints).
    loss_sum: float = 0.0  # train/loss of the steps since the last log step, not yet logged
    loss_terms: int = 0
    skipped: float = 0.0  # amp/skipped_steps so far
    activation_bytes: int = 0  # mem/activation_mib, measured on a segment's first step
    wall_s: float = 0.0  # training time of earlier segments of this run
    nonfinite_run: int = 0  # consecutive non-finite steps (divergence)


@dataclass
class StepView:
    """What a callback sees of an optimizer step before its update: the gradients are
    unscaled (true) and not yet clipped or applied, so the weights are those the step saw."""

    step: int  # the step being taken (1-based)
    module: torch.nn.Module  # the plain model (not DDP's wrapper, not torch.compile's)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]  # (inputs, targets) of the step
    losses: list[torch.Tensor]  # each micro-batch's loss (unweighted, detached, on the device)
    # 1.0 where the scaler found inf/NaN gradients (on the device); None until the step's
    # gradients are unscaled, before a callback sees the view
    skipped: torch.Tensor | None
    log: LogFn  # record metrics at this step

    def add(self, x: torch.Tensor, y: torch.Tensor, loss: torch.Tensor) -> None:
        """One micro-batch of the step: its inputs, targets and detached loss."""
        self.micro_batches.append((x, y))
        self.losses.append(loss)


class Callback:
    """A per-step hook of ``fit``: override what you need (both are no-ops here).

    ``before_update(view)``: after ``scaler.unscale_``, before clipping and the update.
    ``after_step(state)``: after the update, the scheduler and any checkpoint; raising here
    stops the run (the job records it FAILED with the message)."""

    def before_update(self, view: StepView) -> None: ...
    def after_step(self, state: TrainState) -> None: ...


class Interrupted(KeyboardInterrupt):
    """SIGTERM or Ctrl-C, honoured at a step boundary after a checkpoint was written."""


# ---------------------------------------------------------------- null objects


class NoProgress:
    """No progress bar (the console's bar has the same methods)."""

    def start_epoch(self, epoch: int, epochs: int, steps: int) -> None: ...
    def update(self, step: int, metrics: dict, step_ms: float | None) -> None: ...
    def end_epoch(self) -> None: ...


class NoCheckpoints:
    """No checkpoints (ranks other than 0, or tests): never due, saves nothing."""

    def due(self, step: int) -> bool:
        return False

    def save(self, setup: Setup, state: TrainState, complete: bool = False) -> None:
        return None


class NoStop:
    """No stop request ever arrives."""

    requested = False


# ---------------------------------------------------------------- running totals


class Totals:
    """The running totals of a run, kept on the device so that a step adds no sync, and as
    few device ops a step as they can: a step's loss is kept (detached) and summed at the log
    step in one op, and a run without a scaler never adds its skipped steps (always zero).
    Losses are summed in float64, which holds the exact sum of up to ``FOLD`` fp32 values
    within a factor of a million of each other, in any order: a run resumed mid-window (its
    partial sum from the checkpoint) logs the very loss the uncut run logs."""

    FOLD = 256  # losses kept at most before they are summed (a run that rarely logs)

    def __init__(
        self,
        device: torch.device,
        state: TrainState,
        timer: StepTimer,
        watch: NonfiniteWatch,
        peak: StepPeak,
        scaled: bool,
        by_module: bool = True,  # activations by module (not under torch.compile)
    ):
        self.scaled = scaled
        self._losses: list[torch.Tensor] = []  # this log window's, detached
        self._carried = torch.full((), state.loss_sum, dtype=torch.float64, device=device)
        self.loss_terms = state.loss_terms
        self.skipped = torch.full((), state.skipped, device=device)
        plain = distributed.unwrap(peak.model)
        self.meter = SavedTensorMeter(plain, state.activation_bytes, by_module)
        self.saved_at = state.step  # the step whose first micro-batch's saved tensors count
        self.peak = peak  # the measured peak of one step
        self.watch = watch  # stops the run when its loss stays non-finite
        self.timer = timer
        self.started = time.perf_counter() - state.wall_s

    def start_step(self, step: int) -> None:
        """Optimizer step ``step`` begins: timed, unless its memory is measured (once a run)."""
        if not self.peak.start(step):
            self.timer.start()

    def saving(self, measured: bool):
        """Around forward: on the ``measured`` micro-batch, what it saves for backward is
        counted (the meter) and followed until backward lets go of it (the step's peak)."""
        return self.meter.record(enabled=measured, keep=self.peak.keep)

    def add_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Count a micro-batch's loss; returns it detached (the graph is not kept alive)."""
        detached = loss.detach()
        self._losses.append(detached)
        self.loss_terms += 1
        if len(self._losses) == self.FOLD:
            self._carried = self._loss_sum()
            self._losses.clear()
        return detached

    def add_skipped(self, skipped: torch.Tensor) -> None:
        if self.scaled:  # without a scaler no step is ever skipped
            self.skipped += skipped

    def end_step(self, loss: torch.Tensor, skipped: torch.Tensor, scaler) -> None:
        """An optimizer step ended: its time, its skip, and the divergence watch told of its
        last micro-batch's loss (detached; settled at log steps)."""
        self.timer.stop()
        self.peak.stop()
        self.add_skipped(skipped)
        self.watch.observe(loss, skipped, scaler)

    def _loss_sum(self) -> torch.Tensor:
        if not self._losses:
            return self._carried.clone()
        return self._carried + torch.stack(self._losses).double().sum()

    def take_metrics(self, schedule, scaler: torch.amp.GradScaler) -> dict[str, float]:
        """The metrics of a log step, then a fresh loss window (a sync point)."""
        loss_sum = self._loss_sum()
        distributed.all_reduce(loss_sum)  # the mean over every rank's batches
        world = distributed.current().world_size
        metrics = {"train/loss": loss_sum.item() / self.loss_terms / world}
        metrics["train/lr"] = schedule.get_last_lr()[0]
        if scaler.is_enabled():
            metrics["amp/loss_scale"] = scaler.get_scale()
            metrics["amp/skipped_steps"] = self.skipped.item()
        self._losses.clear()
        self._carried.zero_()
        self.loss_terms = 0
        return metrics

    def wall_s(self) -> float:
        return time.perf_counter() - self.started

    def state_dict(self) -> dict:
        """The totals as plain numbers, for a checkpoint's TrainState (a sync)."""
        return {
            "loss_sum": self._loss_sum().item(),
            "loss_terms": self.loss_terms,
            "skipped": self.skipped.item(),
            "activation_bytes": self.meter.bytes,
            "wall_s": self.wall_s(),
            "nonfinite_run": self.watch.count() if self.watch else 0,
        }

    def save_to(self, state: TrainState) -> TrainState:
        for key, value in self.state_dict().items():
            setattr(state, key, value)
        return state


# ---------------------------------------------------------------- the loop


def _weighted(loss: torch.Tensor, weight: float) -> torch.Tensor:
    """What backward sees: the loss times ``loss_multiplier / grad_accum_steps``, without a
    multiply (a kernel on the device, each micro-batch) where that is 1."""
    return loss if weight == 1 else loss * weight


def fit(
    s: Setup,
    log: LogFn,
    progress=NoProgress(),  # noqa: B008 - stateless null objects
    state: TrainState | None = None,
    checkpoints=NoCheckpoints(),  # noqa: B008
    stop=NoStop(),  # noqa: B008
    callbacks: Sequence[Callback] = (),
) -> dict[str, float]:
    """Train; call ``log(metrics, step)`` as metrics come; return the final numbers.

    ``state``: where to continue from (a restored checkpoint). ``checkpoints``: decides when a
    save is due and writes it. ``stop.requested`` turns true on SIGTERM/Ctrl-C; the loop then
    checkpoints at the next step boundary and raises Interrupted. ``callbacks``: per-step
    hooks (``Callback``), after the run's own (``s.callbacks``: gradient-underflow diagnostics,
    the non-finite locator).
    """
    t = s.cfg.trainer
    model, optimizer, scaler, policy = s.model, s.optimizer, s.scaler, s.policy
    objective, plain = s.objective, distributed.unwrap(s.model)
    accum = t.grad_accum_steps
    loss_weight = t.loss_multiplier / accum  # what backward sees (train/loss is unweighted)
    state = state or TrainState()
    totals = _totals(s, state)
    before_update, after_step = _hooked([*s.callbacks, *callbacks])
    evaluation: tuple[float, ...] = (float("nan"), float("nan"))  # (val/loss, the task's score)
    model.train()
    while not _finished(state, t):
        progress.start_epoch(state.epoch, t.epochs, s.steps_per_epoch)
        for x, y in _batches_left(s, state):
            if state.batch % accum == 0:  # a new optimizer step: its micro-batches to come
                totals.start_step(state.step + 1)
                view = StepView(state.step + 1, plain, optimizer, scaler, [], [], None, log)
            first_batch = state.step == totals.saved_at and state.batch % accum == 0  # measured
            # Under DDP, gradients are all-reduced on the step's last micro-batch only (the
            # others accumulate locally): one synchronisation per optimizer step.
            with distributed.gradient_sync(model, sync=(state.batch + 1) % accum == 0):
                # Autocast covers the forward pass and the loss only; backward runs outside
                # it. The loss is computed in fp32 on fp32 logits (the objective upcasts them).
                with policy.autocast(), totals.saving(measured=first_batch):
                    logits = model(x)
                    loss = objective(logits, y)
                totals.peak.watch(loss)  # the measured step's backward, node by node
                # Scale the loss so small fp16 gradients do not underflow (a no-op when off).
                scaler.scale(_weighted(loss, loss_weight)).backward()
            detached = totals.add_loss(loss)
            view.add(x, y, detached)
            state.batch += 1
            if state.batch % accum:
                continue  # accumulate gradients over micro-batches
            # Unscale in place first, so clipping sees (and the step applies) true gradients.
            scaler.unscale_(optimizer)
            view.skipped = found_inf(scaler, optimizer)  # scaler.step skips an inf/NaN step
            for callback in before_update:  # gradient underflow; where a non-finite step began
                callback.before_update(view)
            if t.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            scaler.step(optimizer)
            scaler.update()  # dynamic: back off on inf, grow after growth_interval clean steps
            optimizer.zero_grad(set_to_none=True)
            step_schedule(s.schedule, first=state.step == 0)
            state.step += 1
            totals.end_step(detached, view.skipped, scaler)
            _log_and_save(s, state, totals, log, progress, checkpoints)
            for callback in after_step:
                callback.after_step(state)
            if stop.requested:  # SIGTERM / Ctrl-C, seen between optimizer steps
                progress.end_epoch()
                where = checkpoints.save(s, totals.save_to(state))
                raise Interrupted(f"stopped at step {state.step}, checkpoint {where}")
            if _reached_max_steps(state, t.max_steps):
                break
        progress.end_epoch()
        if _end_of_epoch(s, state):
            evaluation = evaluate(model, s.val_batches, policy, objective)
            log(objective.task.metrics(evaluation), state.step)

    totals.watch.check(state.step)  # the steps since the last log step
    checkpoints.save(s, totals.save_to(state), complete=True)
    return summarise(s, state, totals, evaluation)


def _totals(s: Setup, state: TrainState) -> Totals:
    """The running totals of a run starting at ``state``, with its step timer and the watch
    that stops it when its loss stays non-finite."""
    t = s.cfg.trainer
    timer = StepTimer(s.device, t.timing_warmup_steps)
    watch = NonfiniteWatch(
        t.max_nonfinite_steps,
        s.cfg.precision.scaler.min_scale,
        s.scaler,
        state.nonfinite_run,
        explain=s.locator.advice,
    )
    peak = StepPeak(
        s.device, s.model, s.optimizer, state.step, s.total_steps, t.timing_warmup_steps
    )
    compiled = s.cfg.trainer.compile
    return Totals(s.device, state, timer, watch, peak, s.scaler.is_enabled(), not compiled)


def _log_and_save(s: Setup, state: TrainState, totals: Totals, log, progress, checkpoints) -> None:
    """After an optimizer step: the metrics at a log step, a checkpoint when one is due."""
    t, watch = s.cfg.trainer, totals.watch
    if state.step % t.log_every == 0:
        metrics = totals.take_metrics(s.schedule, s.scaler)  # a sync point
        log(metrics, state.step)
        progress.update(state.step, metrics, totals.timer.last_ms())
        watch.check(state.step)  # raises Diverged (the device is synced here anyway)
    if checkpoints.due(state.step) and not _finished(state, t):
        watch.check(state.step)  # never checkpoint a run that has diverged
        checkpoints.save(s, totals.save_to(state))


def _hooked(callbacks: list[Callback]) -> tuple[list[Callback], list[Callback]]:
    """The callbacks that do something at ``before_update``, and those at ``after_step``: an
    inherited no-op of ``Callback`` is left out (a call a step, for nothing)."""

    def overriding(hook: str) -> list[Callback]:
        return [c for c in callbacks if getattr(type(c), hook, None) is not getattr(Callback, hook)]

    return overriding("before_update"), overriding("after_step")


def _batches_left(s: Setup, state: TrainState):
    """The micro-batches of ``state.epoch`` not consumed yet (a trailing partial accumulation
    is dropped, so every optimizer step sees ``grad_accum_steps`` micro-batches)."""
    micro_batches = s.steps_per_epoch * s.cfg.trainer.grad_accum_steps
    left = micro_batches - state.batch
    return itertools.islice(s.train_batches.epoch(state.epoch, state.batch), left)


def _end_of_epoch(s: Setup, state: TrainState) -> bool:
    """Advance to the next epoch if this one is complete; whether to evaluate now (every
    ``eval_every`` epochs, and always at the end of training)."""
    t = s.cfg.trainer
    complete = state.batch >= s.steps_per_epoch * t.grad_accum_steps
    if complete:
        state.epoch += 1
        state.batch = 0
    return _finished(state, t) or (complete and state.epoch % t.eval_every == 0)


def _finished(state: TrainState, t) -> bool:
    return state.epoch >= t.epochs or _reached_max_steps(state, t.max_steps)


def _reached_max_steps(state: TrainState, max_steps: int) -> bool:
    return 0 < max_steps <= state.step


# no_grad rather than inference_mode: torchao's float8 layers (the fp8 modes) refuse the
# inference tensors that inference_mode makes.
@torch.no_grad()
def evaluate(
    model, batches: Batches, policy: PrecisionPolicy, objective: Objective | None = None
) -> tuple[float, ...]:
    """Mean loss, the task's score (accuracy, perplexity, RMSE, ...) and any other metrics of
    the task (``task.names``) over a whole split, under the run's autocast. ``objective``: the
    run's task and loss (default: classification with cross-entropy).

    Under DDP each rank scores its shard with the plain module (DDP's forward would sync
    buffers, and shards may differ by one batch) and the task's evaluation adds the ranks'
    shards together."""
    objective = objective or default_objective()
    task = objective.task
    model = distributed.unwrap(model) if distributed.current().enabled else model
    was_training = model.training
    model.eval()
    evaluation = task.evaluation(objective.loss_fn, sync=batches.world_size > 1)
    for x, y in batches.epoch(0):
        with policy.autocast():
            evaluation.update(model(x), y)
    model.train(was_training)
    return evaluation.compute()  # the whole split (every rank's shard): one sync


def summarise(
    s: Setup, state: TrainState, totals: Totals, evaluation: tuple[float, ...]
) -> dict[str, float]:
    """The run's final numbers: accuracy, speed, memory, loss scaling, FLOPs/MFU."""
    t = s.cfg.trainer
    median_ms = totals.timer.median_ms()
    summary: dict[str, float] = {
        **s.objective.task.metrics(evaluation),
        **s.reference,  # e.g. data/unigram_perplexity, the floor a language model must beat
        "perf/wall_s": totals.wall_s(),
        "mem/activation_mib": totals.meter.mib,
        "amp/skipped_steps": totals.skipped.item(),
        names.NONFINITE_STEPS: float(s.locator.nonfinite_steps),  # of this process's steps
        "train/steps": state.step,
    }
    if median_ms:
        x, y = next(iter(s.train_batches.epoch(0)))  # a batch's shape; FLOPs are counted on it
        summary["perf/step_time_ms"] = median_ms
        summary["perf/samples_per_s"] = t.batch_size * t.grad_accum_steps * 1000.0 / median_ms
        summary.update(s.objective.task.throughput(summary["perf/samples_per_s"], y))
    if s.scaler.is_enabled():
        summary["amp/loss_scale"] = s.scaler.get_scale()
    summary.update(totals.peak.peak_memory())
    summary.update(measured(s, median_ms, totals.meter, totals.peak))
    summary.update(s.fp8.metrics())
    if distributed.current().enabled:
        # One run for the whole group: throughput adds up, memory is the worst rank's.
        rates = ("perf/samples_per_s", "perf/tokens_per_s")
        summed = distributed.reduce_floats(
            {k: summary[k] for k in rates if k in summary}, "sum", s.device
        )
        peaks = {k: v for k, v in summary.items() if k.startswith("mem/peak")}
        summary.update(summed)
        summary.update(distributed.reduce_floats(peaks, "max", s.device))
    return summary
