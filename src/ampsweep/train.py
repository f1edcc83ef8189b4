"""Build everything a run needs from its config, then the training loop.

``build`` turns a validated Config into a ``Setup`` (device, precision policy, data, model,
optimizer, schedule, scaler). ``fit`` is the one training loop every precision mode runs
through: the policy supplies an autocast context (or a disabled one) and a GradScaler (a no-op
when disabled), so the loop has no per-mode branches and shows every AMP step in order.
"""

from __future__ import annotations

import itertools
import os
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

from ampsweep import data, distributed, flops, models, optim
from ampsweep.diagnostics import Diagnostics
from ampsweep.divergence import NonfiniteWatch
from ampsweep.metrics import SavedTensorMeter, StepTimer, peak_memory, reset_peak_memory
from ampsweep.precision import PrecisionPolicy, build_policy, found_inf
from ampsweep.schema import Config, ConfigError, Device


def select_device(choice: Device) -> torch.device:
    if choice == Device.cuda and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.device=cuda: no CUDA GPU is visible to PyTorch here: use "
            "trainer.device=cpu (or auto), or run on a machine with a GPU"
        )
    if choice == Device.cpu or (choice == Device.auto and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed every generator and set the determinism flags both ways (sweeps share a process)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic


@dataclass
class Setup:
    cfg: Config  # with the precision mode resolved (what actually runs)
    device: torch.device
    policy: PrecisionPolicy
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    train_batches: data.Batches
    val_batches: data.Batches
    steps_per_epoch: int
    total_steps: int
    num_params: int
    dataset_info: dict = field(default_factory=dict)
    diagnostics: Diagnostics = field(default_factory=Diagnostics)  # off unless configured


def build(cfg: Config) -> Setup:
    """Everything that can refuse the config (hardware, data, shapes) fails here, before a
    run is recorded."""
    t = cfg.trainer
    rank = distributed.current()  # the process group is joined before build (runner)
    device = select_device(t.device)
    policy = build_policy(cfg.precision, device)
    cfg = replace(cfg, precision=policy.resolved_config(cfg.precision))
    seed_everything(t.seed, t.deterministic)
    policy.set_global_state()
    reset_peak_memory(device)

    splits = data.load(cfg.dataset)
    preload = data.should_preload(cfg.dataset, splits)
    train_split, val_split = splits.train, splits.val
    if preload and not splits.in_memory:
        train_split, val_split = data.materialise(train_split), data.materialise(val_split)
    common = dict(
        device=device,
        dtype=policy.param_dtype,
        seed=t.seed,
        preload=preload,
        num_workers=t.num_workers,
        channels_last=t.channels_last,
        rank=rank.rank,
        world_size=rank.world_size,
    )
    augment = data.Augment(cfg.dataset.random_crop_padding, cfg.dataset.horizontal_flip)
    train_batches = data.Batches(
        train_split, t.batch_size, shuffle=True, drop_last=True, augment=augment, **common
    )
    val_batches = data.Batches(val_split, t.batch_size, shuffle=False, drop_last=False, **common)
    steps_per_epoch = len(train_batches) // t.grad_accum_steps
    if steps_per_epoch == 0:
        raise ConfigError(
            f"trainer.grad_accum_steps={t.grad_accum_steps} needs more micro-batches than the "
            f"{len(train_batches)} an epoch has: lower it or trainer.batch_size"
        )
    total = steps_per_epoch * t.epochs
    total = min(total, t.max_steps) if t.max_steps > 0 else total

    model = models.build_model(cfg.model, splits.input_shape, splits.num_classes)
    num_params = models.count_parameters(model)
    model = policy.prepare_model(model.to(device))
    if t.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = distributed.wrap(model, device)  # DDP averages gradients over the ranks
    optimizer = optim.build_optimizer(cfg.optimizer, model, device)
    schedule = optim.build_schedule(cfg.optimizer, optimizer, total)
    if t.compile:
        model = torch.compile(model)
    return Setup(
        cfg=cfg,
        device=device,
        policy=policy,
        model=model,
        optimizer=optimizer,
        schedule=schedule,
        scaler=policy.make_scaler(),
        train_batches=train_batches,
        val_batches=val_batches,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        num_params=num_params,
        dataset_info={
            "train_samples": train_batches.n,
            "val_samples": val_batches.n,
            "input_shape": "x".join(map(str, splits.input_shape)),
            "num_classes": splits.num_classes,
            "preload": preload,
        },
        diagnostics=Diagnostics(cfg.diagnostics, t.loss_multiplier / t.grad_accum_steps),
    )


@torch.inference_mode()
def evaluate(model, batches: data.Batches, policy: PrecisionPolicy) -> tuple[float, float]:
    """Mean loss and accuracy over a whole split, under the run's autocast.

    Under DDP each rank scores its shard with the plain module (DDP's forward would sync
    buffers, and shards may differ by one batch) and the sums are added over the ranks."""
    model = distributed.unwrap(model) if distributed.current().enabled else model
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=batches.device, dtype=torch.float64)
    correct = torch.zeros((), device=batches.device, dtype=torch.long)
    for x, y in batches.epoch(0):
        with policy.autocast():
            logits = model(x)
            loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").double()
        correct += (logits.argmax(dim=1) == y).sum()
    model.train(was_training)
    distributed.all_reduce(loss_sum)
    distributed.all_reduce(correct)
    n = batches.n  # the whole split: every rank's shard together
    return loss_sum.item() / n, correct.item() / n  # one sync per evaluation


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
    activation_bytes: int = 0  # mem/activation_mib, measured on the very first step
    wall_s: float = 0.0  # training time of earlier segments of this run
    nonfinite_run: int = 0  # consecutive non-finite steps (divergence)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or Ctrl-C, honoured at a step boundary after a checkpoint was written."""


LogFn = Callable[[dict[str, float], int], None]


def fit(
    s: Setup,
    log: LogFn,
    progress=None,
    state: TrainState | None = None,
    checkpoints=None,
    stop=None,
) -> dict:
    """Train; call ``log(metrics, step)`` as metrics come; return the final numbers.

    ``state``: where to continue from (a restored checkpoint). ``checkpoints``: a
    ``checkpoint.Checkpointer``. ``stop``: an object whose ``requested`` turns true on
    SIGTERM/Ctrl-C; the loop then checkpoints at the next step boundary and raises Interrupted.
    """
    t = s.cfg.trainer
    model, optimizer, scaler, policy = s.model, s.optimizer, s.scaler, s.policy
    diag = s.diagnostics
    accum = t.grad_accum_steps
    loss_weight = t.loss_multiplier / accum  # what backward sees (train/loss is unweighted)
    state = state or TrainState()
    meter = SavedTensorMeter(model)
    timer = StepTimer(s.device, t.timing_warmup_steps)
    meter.bytes = state.activation_bytes
    # summed on the device: no sync per step
    loss_sum = torch.full((), state.loss_sum, device=s.device)
    loss_terms = state.loss_terms
    skipped = torch.full((), state.skipped, device=s.device)
    watch = NonfiniteWatch(
        t.max_nonfinite_steps, s.cfg.precision.scaler.min_scale, scaler, s.device,
        state.nonfinite_run,
    )  # fmt: skip
    val_loss = val_acc = float("nan")
    started = time.perf_counter() - state.wall_s

    def save_checkpoint(complete: bool = False):
        """Checkpoint with the running totals (a sync; only every checkpoint_every steps)."""
        state.loss_sum, state.loss_terms = loss_sum.item(), loss_terms
        state.skipped, state.activation_bytes = skipped.item(), meter.bytes
        state.wall_s, state.nonfinite_run = time.perf_counter() - started, watch.count()
        return checkpoints.save(s, state, complete=complete)

    # The scheduler steps even when the scaler skipped the optimizer step (the schedule
    # follows steps taken, not updates applied); PyTorch warns about that order once.
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()` before")

    model.train()
    while state.epoch < t.epochs and not _done(state, t.max_steps):
        if progress:
            progress.start_epoch(state.epoch, t.epochs, s.steps_per_epoch)
        micro_batches = s.steps_per_epoch * accum  # a trailing partial accumulation is dropped
        batches = itertools.islice(
            s.train_batches.epoch(state.epoch, state.batch), micro_batches - state.batch
        )
        for x, y in batches:
            if state.batch % accum == 0:
                timer.start()
            # Autocast covers the forward pass and the loss only; backward runs outside it.
            with policy.autocast(), meter.record(enabled=state.step == 0 and state.batch == 0):
                logits = model(x)
                loss = F.cross_entropy(logits.float(), y)
            # Scale the loss so small fp16 gradients do not underflow (a no-op when disabled).
            scaler.scale(loss * loss_weight).backward()
            loss_sum += loss.detach()
            loss_terms += 1
            state.batch += 1
            if state.batch % accum:
                continue  # accumulate gradients over micro-batches
            # Unscale in place first, so clipping sees (and the step applies) true gradients.
            scaler.unscale_(optimizer)
            if diag.due(state.step + 1):  # gradient underflow, on true gradients (issue 6)
                log(diag.measure(model, scaler, x, y), state.step + 1)
            if t.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            step_skipped = found_inf(scaler, optimizer)  # scaler.step skips inf/NaN steps
            skipped += step_skipped
            scaler.step(optimizer)
            scaler.update()  # dynamic: back off on inf, grow after growth_interval clean steps
            optimizer.zero_grad(set_to_none=True)
            s.schedule.step()
            state.step += 1
            timer.stop()
            watch.observe(loss, step_skipped, scaler)  # divergence: settled at log steps

            if state.step % t.log_every == 0:
                distributed.all_reduce(loss_sum)  # the mean over every rank's batches
                world = distributed.current().world_size
                metrics = {"train/loss": loss_sum.item() / loss_terms / world}  # a sync point
                metrics["train/lr"] = s.schedule.get_last_lr()[0]
                if scaler.is_enabled():
                    metrics["amp/loss_scale"] = scaler.get_scale()
                    metrics["amp/skipped_steps"] = skipped.item()
                log(metrics, state.step)
                loss_sum.zero_()
                loss_terms = 0
                if progress:
                    progress.update(state.step, metrics, timer.last_ms())
                watch.check(state.step)  # raises Diverged (the device is synced here anyway)
            if checkpoints and checkpoints.due(state.step) and not _done(state, t.max_steps):
                watch.check(state.step)  # never checkpoint a run that has diverged
                save_checkpoint()
            if stop is not None and stop.requested:  # SIGTERM / Ctrl-C, seen between steps
                if progress:
                    progress.end_epoch()
                where = save_checkpoint() if checkpoints else None
                raise Interrupted(f"stopped at step {state.step}, checkpoint {where}")
            if _done(state, t.max_steps):
                break
        if progress:
            progress.end_epoch()
        finished_epoch = state.batch >= micro_batches
        if finished_epoch:
            state.epoch += 1
            state.batch = 0
        last = state.epoch >= t.epochs or _done(state, t.max_steps)
        if last or (finished_epoch and state.epoch % t.eval_every == 0):
            val_loss, val_acc = evaluate(model, s.val_batches, policy)
            log({"val/loss": val_loss, "val/acc": val_acc}, state.step)

    watch.check(state.step)  # the steps since the last log step
    if checkpoints:
        save_checkpoint(complete=True)
    wall = time.perf_counter() - started
    median_ms = timer.median_ms()
    samples = t.batch_size * accum
    summary: dict[str, float] = {
        "val/loss": val_loss,
        "val/acc": val_acc,
        "perf/wall_s": wall,
        "mem/activation_mib": meter.mib,
        "amp/skipped_steps": skipped.item(),
        "train/steps": state.step,
    }
    if median_ms:
        summary["perf/step_time_ms"] = median_ms
        summary["perf/samples_per_s"] = samples * 1000.0 / median_ms
    if scaler.is_enabled():
        summary["amp/loss_scale"] = scaler.get_scale()
    summary.update(peak_memory(s.device))
    # FLOPs of one step, counted once after training (untimed; after the memory peaks).
    # Per rank under DDP: perf/tflops and perf/mfu are per GPU.
    if median_ms:
        x, y = next(iter(s.train_batches.epoch(0)))
        step_flops = flops.train_step_flops(model, x, y, policy, accum)
        summary.update(flops.speed_metrics(step_flops, median_ms, s.device, policy))
    if distributed.current().enabled:
        # One run for the whole group: throughput adds up, memory is the worst rank's.
        summed = distributed.reduce_floats(
            {"perf/samples_per_s": summary.get("perf/samples_per_s", 0.0)}, "sum", s.device
        )
        peaks = {k: v for k, v in summary.items() if k.startswith("mem/peak")}
        summary.update(summed)
        summary.update(distributed.reduce_floats(peaks, "max", s.device))
    return summary


def _done(state: TrainState, max_steps: int) -> bool:
    return 0 < max_steps <= state.step
