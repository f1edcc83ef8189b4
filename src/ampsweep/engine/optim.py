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
from collections import ChainMap, defaultdict
from collections.abc import Callable, Sequence

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
    cfg: OptimizerConfig, model: torch.nn.Module, device: torch.device, master_weights: bool = False
) -> torch.optim.Optimizer:
    """The configured optimizer over the model's trainable parameters; ``master_weights``
    (``precision.master_weights``, a pure mode): over fp32 copies of them (``MasterWeights``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    builder = OPTIMIZERS.lookup(cfg.name)

    def make(tensors: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        return builder.fn(tensors, cfg.lr, cfg.weight_decay, device, **cfg.args)

    return MasterWeights(params, make) if master_weights else make(params)


MASTER = "master_param"  # the state entry of a parameter's fp32 copy (measure.memory counts it)


class MasterWeights(torch.optim.Optimizer):
    """fp32 master weights for a pure mode's 16-bit parameters, as Apex's O2 and DeepSpeed's
    bf16 optimizer keep them: the model runs forward and backward on its 16-bit parameters;
    ``inner`` (the configured optimizer, its state fp32) steps fp32 copies of them, and each
    copy is rounded back into its parameter after the step. An update below half a unit in
    the 16-bit weight's last place, which the weight alone would round away, accumulates in
    the copy until it moves the weight.

    ``param_groups`` are the inner optimizer's (a schedule's learning rate reaches it), over
    the copies; ``state``, keyed by the copies, shows each one's inner state and the copy
    itself (``MASTER``).
    ``step`` consumes the 16-bit gradients: each is cast to fp32 and freed as it is, so the
    step holds one gradient of each parameter (fp32), not two."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        make: Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer],
    ):
        self.params = list(params)
        self.masters = [p.detach().to(torch.float32, copy=True) for p in self.params]
        self.inner = make(self.masters)
        super().__init__(self.masters, self.inner.defaults)
        self._link()

    def _link(self) -> None:
        """Share the inner optimizer's groups and show its state (both replaced when it
        loads a state dict)."""
        self.param_groups = self.inner.param_groups
        self.state = defaultdict(
            dict, {m: ChainMap({MASTER: m}, self.inner.state[m]) for m in self.masters}
        )

    @torch.no_grad()
    def step(self, closure=None) -> None:  # type: ignore[override]
        """Cast the gradients into the copies', step the copies, round them into the model.
        (The training loop passes no closure: a closure's backward would miss the copies.)"""
        if closure is not None:
            raise ValueError("MasterWeights.step takes no closure")
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None
        self.inner.step()
        for p, m in zip(self.params, self.masters, strict=True):
            p.copy_(m)  # round to nearest
            m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """The inner optimizer's state and the fp32 copies themselves: a resumed run continues
        from the copies, not from their rounded 16-bit weights."""
        return {"optimizer": self.inner.state_dict(), "master_weights": list(self.masters)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            for m, saved in zip(self.masters, state_dict["master_weights"], strict=True):
                m.copy_(saved)
        self._link()


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
