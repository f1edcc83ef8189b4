"""Where a run's first non-finite value began: the replay names the module, the kind and the
format limit for each known defect (a forward overflow, a NaN weight gradient, a NaN input
gradient, a loss of log(0)); a run records it (tags, artifact, console) and a divergence
names it with its fix instead of the generic advice; finite steps locate nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import QUICK, REPO, Gain, all_runs
from torch import nn

from ampsweep.app import api
from ampsweep.engine.tasks import default_objective
from ampsweep.measure.numerics import GradientCheck, replay
from ampsweep.measure.probe import HookError
from ampsweep.precision.modes import PrecisionConfig
from ampsweep.precision.policy import build_policy

CPU = torch.device("cpu")
EXAMPLE = REPO / "examples" / "doctor"


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


def example(*args: str) -> list[str]:
    quick = [o for o in QUICK if not o.startswith("model.")]
    return ["--config-dir", str(EXAMPLE / "conf"), *quick, "trainer.max_steps=30",
            "trainer.log_every=5", *args]  # fmt: skip


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))


def test_a_run_records_where_its_first_nan_began(store_uri, on_path, capsys):
    res = api.train(example("model=flaky_net", "precision=bf16", f"tracking.uri={store_uri}"))
    assert res.summary["numerics/nonfinite_steps"] > 0
    (run,) = all_runs(store_uri)
    tags = run.data.tags
    assert tags["numerics.nonfinite_step"] == "3"  # the model's kernel breaks at its 3rd step
    assert (tags["numerics.nonfinite_kind"], tags["numerics.nonfinite_module"]) == (
        "weight_grad", "fc2")  # fmt: skip
    assert tags["numerics.nonfinite_fix"] == "precision.keep_fp32=[fc2]"
    from ampsweep.tracking.store import client_for

    path = client_for(store_uri).download_artifacts(
        run.info.run_id, "numerics/first_nonfinite.json"
    )
    record = json.loads(Path(path).read_text())
    assert record["param"] == "fc2.weight" and record["mode"] == "bf16"
    assert "weight gradient of fc2 (FlakyLinear)" in capsys.readouterr().err  # the summary's note


def test_a_divergence_names_the_module_and_its_fix_instead_of_the_learning_rate(store_uri, on_path):
    with pytest.raises(api.TrainError) as err:
        args = ["model=overflow_net", "precision=fp16_noscale", "trainer.max_nonfinite_steps=5"]
        api.train(example(*args, f"tracking.uri={store_uri}"))
    text = str(err.value)
    assert "the first non-finite value was the fp16 output of amplify (Amplify)" in text
    assert "fix: precision.keep_fp32=[amplify]" in text and "lower optimizer.lr" not in text
    (run,) = all_runs(store_uri)
    assert run.info.status == "FAILED" and run.data.tags["numerics.nonfinite_module"] == "amplify"
    assert run.data.metrics["numerics/nonfinite_steps"] >= 5


def test_the_prescribed_keep_fp32_trains_finite(store_uri, on_path):
    res = api.train(example("model=flaky_net", "precision=bf16", "precision.keep_fp32=[fc2]",
                            f"tracking.uri={store_uri}"))  # fmt: skip
    assert res.summary["numerics/nonfinite_steps"] == 0
    (run,) = all_runs(store_uri)
    assert not any(k.startswith("numerics.nonfinite") for k in run.data.tags)


def test_locating_can_be_turned_off(on_path):
    res = api.train(example("model=flaky_net", "precision=bf16", "tracking=none",
                            "diagnostics.locate_nonfinite=false"))  # fmt: skip
    assert res.summary["numerics/nonfinite_steps"] == 0  # nothing read, nothing counted


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_the_gradient_check_flags_a_non_finite_value_in_any_dtype_and_changes_nothing(bad):
    """One flag per device serves every dtype's group: a bad bf16 gradient beside good fp32
    ones is found whichever group is checked last, and every gradient keeps its bits."""
    check = GradientCheck()
    good = [torch.randn(5), torch.randn(3, 2).bfloat16(), torch.randn(4)]
    kept = [g.clone() for g in good]
    assert not check.nonfinite(good)
    assert all(torch.equal(g, k) for g, k in zip(good, kept, strict=True))
    for i in range(len(good)):
        grads = [g.clone() for g in good]
        grads[i].view(-1)[0] = bad
        assert check.nonfinite(grads), i
        assert not check.nonfinite(good), i  # the flag is cleared for the next step


def test_the_gradient_check_reads_a_sparse_gradient_by_its_values():
    """An embedding with sparse gradients (SGD takes them): its stored values are checked."""
    check = GradientCheck()
    dense = torch.randn(3)
    sparse = torch.sparse_coo_tensor(
        [[0, 2]], torch.tensor([1.0, 2.0]), (4,), check_invariants=True
    )
    assert not check.nonfinite([dense, sparse])
    bad = torch.sparse_coo_tensor(
        [[0, 2]], torch.tensor([1.0, float("inf")]), (4,), check_invariants=True
    )
    assert check.nonfinite([dense, bad])
