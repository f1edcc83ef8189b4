"""engine/optim.py: the optimizers' own settings, and the learning-rate schedule: constant, or
a linear warm-up then a cosine decay to min_lr_ratio, at values worked out by hand."""

from __future__ import annotations

import pytest
import torch

from ampsweep.config.schema import OptimizerConfig, Schedule
from ampsweep.engine import optim


def factors(schedule_cfg: OptimizerConfig, total: int) -> list[float]:
    """The lr factor after 0, 1, ..., total scheduler steps (base lr 1.0)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = optim.build_schedule(schedule_cfg, opt, total)
    out = [schedule.get_last_lr()[0]]
    for _ in range(total):
        opt.step()
        schedule.step()
        out.append(schedule.get_last_lr()[0])
    return out


def test_no_schedule_is_constant():
    assert factors(OptimizerConfig(), 5) == [1.0] * 6


def test_no_schedule_leaves_the_optimizer_as_it_is_and_takes_an_older_checkpoints_state():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    schedule = optim.build_schedule(OptimizerConfig(), opt, 10)
    assert "step" not in vars(opt)  # a LambdaLR wraps the instance's step to count its calls
    older = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5), lambda step: 1.0
    )
    schedule.load_state_dict(older.state_dict())  # what a checkpoint from before holds
    schedule.load_state_dict(schedule.state_dict())
    assert schedule.get_last_lr() == [0.5] and opt.param_groups[0]["lr"] == 0.5


def test_cosine_with_warm_up():
    # 4 warm-up steps over 12, floor 0.1: (k+1)/4 while warming up, then
    # 0.1 + 0.45 * (1 + cos(pi * (k - 4) / 8)).
    cfg = OptimizerConfig(schedule=Schedule.cosine, warmup_steps=4, min_lr_ratio=0.1)
    got = factors(cfg, 12)
    expected = [0.25, 0.5, 0.75, 1.0, 1.0, 0.965746, 0.868198, 0.722208, 0.55, 0.377792,
                0.231802, 0.134254, 0.1]  # fmt: skip
    assert got == pytest.approx(expected, abs=1e-6)


def test_cosine_without_warm_up_starts_at_the_full_rate():
    got = factors(OptimizerConfig(schedule=Schedule.cosine), 4)
    assert got == pytest.approx([1.0, 0.853553, 0.5, 0.146447, 0.0], abs=1e-6)


def test_an_optimizers_own_settings_reach_it():
    model = torch.nn.Linear(2, 2)
    sgd = optim.build_optimizer(
        OptimizerConfig(name="sgd", lr=0.5, args={"momentum": 0.8, "nesterov": True}),
        model,
        torch.device("cpu"),
    )
    group = sgd.param_groups[0]
    assert isinstance(sgd, torch.optim.SGD)
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.5, 0.8, True)
    adamw = optim.build_optimizer(
        OptimizerConfig(name="adamw", weight_decay=0.1, args={"betas": [0.8, 0.9], "eps": 1e-6}),
        model,
        torch.device("cpu"),
    )
    group = adamw.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.9), 1e-6, 0.1)
    assert not group["fused"]  # fused only on CUDA


def test_sgd_settings_are_checked():
    _, problems = optim.OPTIMIZERS.lookup("sgd").resolve({"momentum": 1.5, "nesterov": True})
    assert problems == ["optimizer.momentum=1.5 must be in [0, 1): use e.g. 0.9"]
    _, problems = optim.OPTIMIZERS.lookup("sgd").resolve({"momentum": 0.0, "nesterov": True})
    assert problems == ["optimizer.nesterov=true needs momentum > 0"]
