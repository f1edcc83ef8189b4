"""Losses: the LOSSES registry (``loss=cross_entropy``, the default) and losses from any
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

import torch
import torch.nn.functional as F

from ampsweep.config.schema import ConfigError, LossConfig
from ampsweep.engine.registry import Registry, fraction

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
