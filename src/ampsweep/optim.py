"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch

from ampsweep.schema import OptimizerConfig, OptimizerName, Schedule


def build_optimizer(
    cfg: OptimizerConfig, model: torch.nn.Module, device: torch.device
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.name == OptimizerName.sgd:
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
        )
    # Fused AdamW runs the whole update in one kernel per parameter group on CUDA; GradScaler
    # knows it (it passes the inf flags instead of syncing). Default: on CUDA only.
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=fused or None,
    )


def build_schedule(
    cfg: OptimizerConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """``none``: constant; ``cosine``: linear warm-up, then cosine decay to min_lr_ratio."""
    if cfg.schedule == Schedule.none:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
