"""engine/optim.py: the optimizers' own settings, and the learning-rate schedule: constant, or
a linear warm-up then a cosine decay to min_lr_ratio, at values worked out by hand; fp32 master
weights keep the updates bf16 weights round away, show in the optimizer's state, restore
exactly and are recorded in a run's memory."""

from __future__ import annotations

import copy

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


def ones_bf16() -> torch.nn.Linear:
    """A bf16 layer whose weights are all 1.0, where bf16's spacing is 2^-8 (below 1.0) to
    2^-7 (above): an update of 1e-3 is under half of it, and rounds back to 1.0."""
    layer = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    torch.nn.init.ones_(layer.weight)
    return layer


@pytest.mark.parametrize("master_weights", [False, True])
def test_master_weights_keep_the_updates_bf16_weights_round_away(master_weights):
    layer = ones_bf16()
    cfg = OptimizerConfig(name="sgd", lr=2e-3, args={"momentum": 0.0})
    opt = optim.build_optimizer(cfg, layer, torch.device("cpu"), master_weights)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)  # lr 1e-3
    for _ in range(10):
        layer.weight.grad = torch.ones_like(layer.weight)  # each update: -1e-3
        torch.nn.utils.clip_grad_norm_(layer.parameters(), 100.0)  # on the bf16 gradients
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        assert layer.weight.grad is None
    if not master_weights:  # each update rounded away: the weights never moved
        assert torch.equal(layer.weight, torch.ones_like(layer.weight))
        return
    assert isinstance(opt, optim.MasterWeights)
    assert opt.param_groups is opt.inner.param_groups and opt.param_groups[0]["lr"] == 1e-3
    (master,) = opt.masters
    assert master.dtype == torch.float32
    assert master == pytest.approx(torch.full((4, 4), 0.99), abs=1e-6)  # ten updates kept
    assert layer.weight.dtype == torch.bfloat16
    assert torch.equal(layer.weight, master.to(torch.bfloat16))  # 0.9921875, the nearest


def test_master_weights_show_as_optimizer_state_and_restore_exactly():
    layer = torch.nn.Linear(8, 8).to(torch.bfloat16)
    cfg = OptimizerConfig(name="adamw", lr=1e-3)
    opt = optim.build_optimizer(cfg, layer, torch.device("cpu"), master_weights=True)
    for _ in range(3):
        layer(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        opt.zero_grad()
    # every state entry of a parameter's copy, and the copy itself, under a "master" key
    for master in opt.masters:
        assert set(opt.state[master]) == {"master_param", "step", "exp_avg", "exp_avg_sq"}
        assert opt.state[master]["master_param"] is master
        assert opt.state[master]["exp_avg"].dtype == torch.float32
    saved = copy.deepcopy(opt.state_dict())
    other = torch.nn.Linear(8, 8).to(torch.bfloat16)
    other.load_state_dict(layer.state_dict())
    again = optim.build_optimizer(cfg, other, torch.device("cpu"), master_weights=True)
    again.load_state_dict(saved)
    for a, b in zip(again.masters, opt.masters, strict=True):
        assert torch.equal(a, b)
    assert again.state[again.masters[0]]["master_param"] is again.masters[0]
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    for model, o in ((layer, opt), (other, again)):
        model(x).float().sum().backward()
        o.step()
    assert torch.equal(layer.weight, other.weight) and torch.equal(layer.bias, other.bias)


def test_a_run_with_master_weights_records_four_bytes_a_parameter_for_them(quick):
    import ampsweep

    masters = ["precision=bf16_pure", "precision.master_weights=true", "diagnostics.every=2"]
    run = ampsweep.train([*quick, *masters, "tracking=none"])
    mem = run.summary
    params = mem["mem/params_bf16_mib"] / 2  # Mi-parameters
    assert mem["mem/master_weights_fp32_mib"] == pytest.approx(4 * params)
    assert mem["mem/master_weights_mib"] == pytest.approx(4 * params)
    assert mem["mem/grads_bf16_mib"] == pytest.approx(2 * params)
    # AdamW's two moments in fp32 beside the fp32 copies (and a step count per parameter)
    assert mem["mem/optimizer_fp32_mib"] == pytest.approx(8 * params, rel=0.01)
    assert run.config["precision"]["master_weights"] is True
    # no update is rounded away, so none is measured as lost (bf16_pure alone measures it)
    assert "amp/grad_underflow_frac" in run.history and "amp/update_lost_frac" not in run.history
