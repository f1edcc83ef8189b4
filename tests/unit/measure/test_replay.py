"""measure/replay.py: the replay names the module, the kind and the format limit for each
known defect (a forward overflow, a NaN weight gradient, a NaN input gradient, a loss of
log(0)), a module that takes no hooks, and nothing for a finite step."""

from __future__ import annotations

import pytest
import torch
from conftest import Gain
from torch import nn

from ampsweep.engine.tasks import default_objective
from ampsweep.measure.hooks import HookError
from ampsweep.measure.replay import replay
from ampsweep.precision.modes import PrecisionConfig
from ampsweep.precision.policy import build_policy

CPU = torch.device("cpu")


class _NanBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, float("nan"))


class NanWeightGrad(nn.Linear):
    def forward(self, x):
        return nn.functional.linear(x, _NanBackward.apply(self.weight), self.bias)


class NanInputGrad(nn.Module):
    def forward(self, x):
        return _NanBackward.apply(x)


def locate(model: nn.Module, mode: str = "fp32", weight: float = 1.0):
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    policy = build_policy(PrecisionConfig(name=mode), CPU)
    return replay(model, x, y, policy, default_objective(), weight)


def test_a_forward_overflow_in_fp16_names_the_module_its_value_and_the_limit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Gain(1e5), nn.LayerNorm(8), nn.Linear(8, 3))
    origin = locate(model, "fp16")
    assert (origin.kind, origin.module, origin.module_type, origin.dtype) == (
        "forward", "1", "Gain", "fp16")  # fmt: skip
    assert origin.limit == 65504.0 and origin.value > 65504.0
    assert "beyond fp16's largest value 65504 (a forward overflow)" in origin.sentence()
    assert origin.fix() == "precision.keep_fp32=[1], or precision=bf16 (fp32's range)"
    assert locate(model, "bf16") is None  # bf16 has fp32's range: nothing to locate


def test_a_nan_weight_gradient_names_that_parameter():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), NanWeightGrad(8, 8), nn.Linear(8, 3))
    origin = locate(model)
    assert (origin.kind, origin.module, origin.param) == ("weight_grad", "2", "2.weight")
    assert "with finite input and output gradient" in origin.sentence()
    assert origin.fix() == "precision.keep_fp32=[2]"


def test_a_nan_input_gradient_names_the_module_whose_backward_made_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), NanInputGrad(), nn.Linear(8, 3))
    origin = locate(model)
    assert (origin.kind, origin.module, origin.consumers) == ("input_grad", "1", ["1"])
    assert origin.fix() == "precision.keep_fp32=[1]"


def test_a_loss_that_is_not_finite_from_finite_outputs_is_named_as_the_loss():
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    policy = build_policy(PrecisionConfig(name="fp32"), CPU)
    log_of_zero = lambda out, y: out.mean() + torch.log(torch.zeros(()))  # noqa: E731
    origin = replay(nn.Sequential(nn.Linear(4, 3)), x, y, policy, log_of_zero, 1.0)
    assert origin.kind == "loss" and "the loss was not" in origin.sentence()
    assert locate(nn.Sequential(nn.Linear(4, 3))) is None  # a finite step locates nothing


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_a_module_that_takes_no_hooks_is_named():
    scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 3)))
    with pytest.raises(HookError, match=r"takes no forward hook .*pass the eager model"):
        locate(nn.Sequential(scripted))


# ------------------------------------------- the right culprit in every mode (and its op)

MODES = [("fp32", 1.0), ("bf16", 1.0), ("fp16", 1.0), ("fp16", 65536.0)]  # 65536: a scaler's


class _InfBackward(torch.autograd.Function):
    """Identity forward; an inf gradient back to its input (a broken custom or fused op)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, float("inf"))


class BrokenOp(nn.Module):
    """No parameters: its backward alone makes the bad value."""

    def forward(self, x):
        return _InfBackward.apply(x)


class Block(nn.Module):
    """A container whose own forward runs the broken op inline, between its children."""

    def __init__(self):
        super().__init__()
        self.inner, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.out(_InfBackward.apply(self.inner(x)))


class Scores(nn.Module):
    """Attention-like scores inline in ``forward``: ``q @ k.T * scale``, then a softmax."""

    def __init__(self, scale: float):
        super().__init__()
        self.q, self.k, self.scale = nn.Linear(8, 8), nn.Linear(8, 8), scale

    def forward(self, x):
        return torch.softmax((self.q(x) @ self.k(x).T * self.scale).float(), -1).to(x.dtype) @ x


@pytest.mark.parametrize("mode,scale", MODES)
def test_a_parameterless_module_whose_backward_fails_is_named_under_autocast_too(mode, scale):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), BrokenOp(), nn.ReLU(), nn.Linear(8, 3))
    origin = locate(model, mode, scale)
    assert (origin.kind, origin.module, origin.module_type) == ("input_grad", "1", "BrokenOp")
    assert origin.op == "_InfBackward" and "1 (BrokenOp) (its _InfBackward)" in origin.sentence()
    assert origin.fix() == "precision.keep_fp32=[1]"  # the locator adds fp32_too, kept


@pytest.mark.parametrize("mode,scale", MODES)
def test_an_op_inline_in_a_containers_forward_names_the_container_and_the_op(mode, scale):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Block(), nn.Linear(8, 3))
    origin = locate(model, mode, scale)
    assert (origin.kind, origin.module, origin.op) == ("input_grad", "1", "_InfBackward")


@pytest.mark.parametrize("mode,scale", MODES)
def test_an_overflow_inside_a_forward_names_the_op_and_its_value(mode, scale):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Scores(1e6), nn.Linear(8, 3))
    origin = locate(model, mode, scale)
    if mode != "fp16":
        assert origin is None  # fp32's range holds it
        return
    assert (origin.kind, origin.module, origin.op, origin.dtype) == ("forward", "1", "mul", "fp16")
    assert origin.value > 65504 and "(its mul), with finite inputs: it reaches" in origin.sentence()


def test_an_origin_prescribes_keep_fp32_only_where_it_changes_something():
    from ampsweep.measure.replay import Origin

    origin = Origin(3, "input_grad", "act", "FusedAct", dtype="bf16", consumers=["act"], op="relu")
    assert origin.fix() == "precision.keep_fp32=[act]" and origin.cause == ""
    origin.fp32_too = False
    assert origin.cause == "precision"
    origin.keepable = False  # an fp32 run, or act already kept: nothing to prescribe
    assert origin.fix() == ""
    origin.fp32_too = True
    assert origin.cause == "computation"
    assert origin.fix() == "fix the backward of act (its relu) (no precision setting changes it)"
    assert "it fails in fp32 too, at the same weights: not the format" in origin.sentence()
    origin.growth = "the weights grew from 1e+01 to 1e+17 over 10 step(s)"
    assert origin.cause == origin.tags()["numerics.nonfinite_cause"] == "divergence"
    assert origin.sentence().endswith("over 10 step(s): a divergence, not the format")
    assert origin.fix().startswith("lower optimizer.lr") and "keep_fp32" not in origin.fix()


def regress(model: nn.Module, y: torch.Tensor, weight: float = 1.0):
    """The replay of one fp16 step of a regression (MSE on the fp32 output, as its task)."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    policy = build_policy(PrecisionConfig(name="fp16"), CPU)
    mse = lambda out, y: nn.functional.mse_loss(out.float(), y)  # noqa: E731
    return replay(model, x, y, policy, mse, weight)


def head_net(bias: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    nn.init.constant_(model[2].bias, bias)
    return model


def test_large_regression_targets_overflowing_the_heads_gradient_are_blamed():
    # 2 * 3e5 / 8 outputs: the gradient of the head's output is past 65504 even unscaled
    origin = regress(head_net(), torch.full((8, 1), 3e5))
    assert (origin.kind, origin.module, origin.head, origin.dtype) == (
        "output_grad", "2", "2", "fp16")  # fmt: skip
    assert origin.targets == 3e5 and origin.large_targets
    said = origin.sentence()
    head = "2 (Linear, the model's head)"
    assert f"the gradient the loss passed back to the fp16 output of {head}" in said
    assert "the targets reach 3e+05: the head's output and the gradient" in said
    assert origin.fix().startswith("standardise the targets, (y - mean) / std")
    assert origin.fix().endswith("or precision=bf16 (fp32's range)")


def test_a_heads_forward_overflow_names_the_head_and_its_targets():
    origin = regress(head_net(bias=2e5), torch.full((8, 1), 2.5e5))
    assert (origin.kind, origin.module, origin.head) == ("forward", "2", "2")
    said = origin.sentence()
    assert "the fp16 output of 2 (Linear, the model's head), with finite inputs: it reaches" in said
    assert "the targets reach 2.5e+05" in said and origin.fix().startswith("standardise")


def test_standardised_targets_leave_the_head_to_keep_fp32():
    # targets of a few units: a scale of 2^24 overflows the head's output gradient, not them
    origin = regress(head_net(), torch.randn(8, 1), weight=2.0**24)
    assert (origin.kind, origin.module, origin.head) == ("output_grad", "2", "2")
    assert not origin.large_targets and "the targets reach" not in origin.sentence()
    assert origin.keep() == "2" and origin.fix() == "precision.keep_fp32=[2]"
