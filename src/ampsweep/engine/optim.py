"""What training minimises and how: losses (the LOSSES registry), optimizers (the OPTIMIZERS
registry) and the learning-rate schedule.

An optimizer is one function registered with ``@OPTIMIZERS.register(name)`` plus one YAML file
``conf/optimizer/<name>.yaml``. It receives the parameters to train, the shared ``lr`` and
``weight_decay`` and the device, and its own settings as keyword arguments (``optimizer.<key>``).

Losses: the LOSSES registry (``loss=cross_entropy``, the default) and losses from any
callable (``loss._target_``).

A loss builder returns the loss function ``(logits, targets) -> scalar``; the task decides
how logits and targets are shaped for it (flattened over positions for language modeling),
and it always receives fp32 logits. A ``_target_`` loss follows Hydra's ``instantiate``: the
callable is called with the section's other keys (``torch.nn.CrossEntropyLoss`` with
``label_smoothing: 0.1`` makes a loss module); with ``_partial_: true`` the callable is the
loss function itself and the keys are bound to it (``torch.nn.functional.cross_entropy``).
"""

from __future__ import annotations

import functools
import math
import re
import warnings

import torch
import torch.nn.functional as F

from ampsweep.config.schema import ConfigError, LossConfig, OptimizerConfig, Schedule
from ampsweep.engine.registry import Registry, fraction

OPTIMIZERS = Registry("optimizer", provided=("params", "lr", "weight_decay", "device"))


def _check_sgd(s: dict) -> list[str]:
    problems = []
    if not 0.0 <= s["momentum"] < 1.0:
        problems.append(f"momentum={s['momentum']} must be in [0, 1): use e.g. 0.9")
    if s["nesterov"] and s["momentum"] == 0:
        problems.append("nesterov=true needs momentum > 0")
    return problems


@OPTIMIZERS.register("sgd", check=_check_sgd)
def sgd(
    params, lr: float, weight_decay: float, device, *, momentum: float = 0.9, nesterov: bool = False
) -> torch.optim.Optimizer:
    """SGD with momentum (and optionally Nesterov momentum)."""
    return torch.optim.SGD(
        params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay
    )


def _check_adamw(s: dict) -> list[str]:
    problems = []
    betas = s["betas"]
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        problems.append(f"betas={list(betas)} must be two values in [0, 1): use [0.9,0.999]")
    if not s["eps"] > 0:
        problems.append(f"eps={s['eps']} must be > 0: use e.g. 1e-8")
    return problems


@OPTIMIZERS.register("adamw", check=_check_adamw)
def adamw(
    params,
    lr: float,
    weight_decay: float,
    device: torch.device,
    *,
    betas: list[float] = [0.9, 0.999],  # noqa: B006 - read, never changed
    eps: float = 1e-8,
    fused: bool | None = None,
) -> torch.optim.Optimizer:
    """AdamW. ``fused``: None means fused on CUDA, where one kernel per parameter group runs
    the whole update; GradScaler knows it and passes the inf flags instead of syncing."""
    fused = fused if fused is not None else device.type == "cuda"
    return torch.optim.AdamW(
        params,
        lr=lr,
        betas=(betas[0], betas[1]),  # two: _check_adamw
        eps=eps,
        weight_decay=weight_decay,
        fused=fused or None,
    )


def build_optimizer(
    cfg: OptimizerConfig, model: torch.nn.Module, device: torch.device
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    builder = OPTIMIZERS.lookup(cfg.name)
    return builder.fn(params, cfg.lr, cfg.weight_decay, device, **cfg.args)


class ConstantSchedule:
    """``schedule=none``: the optimizer's learning rate, never changed. A null object with the
    methods the loop and the checkpoints use: a ``LambdaLR`` of 1.0 does the same with work on
    every step (its ``step`` and the call counter it wraps around ``optimizer.step``), for
    nothing."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def step(self) -> None: ...

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore (a checkpoint of an older version holds a LambdaLR's state of
        the same constant rate)."""


def build_schedule(
    cfg: OptimizerConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler | ConstantSchedule:
    """``none``: constant; ``cosine``: linear warm-up, then cosine decay to min_lr_ratio."""
    if cfg.schedule == Schedule.none:
        return ConstantSchedule(optimizer)
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# The scheduler steps even when the scaler skipped the optimizer step (the schedule follows
# steps taken, not updates applied); PyTorch warns about that order, which is intended here.
SCHEDULER_ORDER_WARNING = re.escape("Detected call of `lr_scheduler.step()` before")


def step_schedule(schedule, first: bool) -> None:
    """Step the schedule (the training loop does, after each optimizer step), quiet about the
    order above. PyTorch checks the order on the
    schedule's first step only (a resumed schedule's step count comes from its checkpoint), so
    only a run's first step pays for the warning filter (a few microseconds a step)."""
    if not first:
        schedule.step()
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SCHEDULER_ORDER_WARNING)
        schedule.step()


# ---------------------------------------------------------------- losses

LOSSES = Registry("loss", provided=())


@LOSSES.register("cross_entropy", check=fraction("label_smoothing"))
def cross_entropy(*, label_smoothing: float = 0.0):
    """Cross-entropy of the logits against integer targets (mean over targets)."""
    return functools.partial(F.cross_entropy, label_smoothing=label_smoothing)


def build_loss(cfg: LossConfig, device: torch.device):
    """The loss function a config names, on ``device`` (a loss module may hold tensors)."""
    builder = LOSSES.builder(cfg)
    if builder.partial:
        return functools.partial(builder.fn, **cfg.args)
    try:
        loss = builder.fn(**cfg.args)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(
            f"{builder.label}: building the loss failed ({type(err).__name__}: "
            f"{' '.join(str(err).split())}): check the loss's arguments"
        ) from None
    if not callable(loss):
        raise ConfigError(
            f"{builder.label}: returned a {type(loss).__name__}, not a loss function: give a "
            "class or factory that returns one, or add loss._partial_=true if the callable is "
            "the loss itself"
        )
    return loss.to(device) if isinstance(loss, torch.nn.Module) else loss


def check_loss(value, label: str) -> None:
    """Refuse a loss that does not return one number (it is backpropagated and logged)."""
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(
            f"{label}: the loss returned {shape}, not a single number: reduce it over the batch "
            "(e.g. reduction='mean')"
        )
