"""measure/numerics.py: a run records where its first non-finite value began (tags, artifact,
console) and a divergence names it with its fix instead of the generic advice; finite steps
locate nothing; the gradient check the locator reads each step; a run whose loss stays
non-finite is stopped, but not a dynamic scaler that is still lowering its scale. (The replay
that names the place: test_replay.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import QUICK, REPO, all_runs

from ampsweep import api
from ampsweep.measure.numerics import Diverged, GradientCheck, NonfiniteWatch
from ampsweep.precision.policy import StaticGradScaler

EXAMPLE = REPO / "examples" / "doctor"


def example(*args: str) -> list[str]:
    quick = [o for o in QUICK if not o.startswith("model.")]
    return ["--config-dir", str(EXAMPLE / "conf"), *quick, "trainer.max_steps=30",
            "trainer.log_every=5", *args]  # fmt: skip


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))


def test_a_run_records_where_its_first_nan_began(store_uri, on_path, capsys):
    with pytest.raises(api.TrainError, match="the model is not training"):  # not "finished"
        api.train(example("model=flaky_net", "precision=bf16", f"tracking.uri={store_uri}"))
    (run,) = all_runs(store_uri)
    assert run.info.status == "FAILED" and run.data.metrics["numerics/nonfinite_steps"] > 0
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
    assert "weight gradient of fc2 (FlakyLinear)" in capsys.readouterr().err  # the run's error


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
    with pytest.raises(api.TrainError) as err:  # its NaN losses still stop it
        api.train(example("model=flaky_net", "precision=bf16", "tracking=none",
                          "diagnostics.locate_nonfinite=false"))  # fmt: skip
    assert "fc2" not in str(err.value) and "lower optimizer.lr" in str(err.value)  # not located


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


def test_the_gradient_check_of_dense_steps_still_reads_a_sparse_gradient_that_comes_later():
    """Steps of plain tensors take one call; a sparse gradient after them (the single call
    refuses it) is read by its values, and the check stays right for every step after."""
    check = GradientCheck()
    dense, loss = torch.randn(3), torch.tensor(1.0)
    assert not check.nonfinite([dense, loss])
    assert check.nonfinite([torch.tensor([1.0, float("nan")]), loss])
    assert not check.nonfinite([dense, loss])

    def sparse(value):
        return torch.sparse_coo_tensor(
            [[0, 2]], torch.tensor([1.0, value]), (4,), check_invariants=True
        )

    assert check.nonfinite([dense, sparse(float("inf")), loss])
    assert not check.nonfinite([dense, sparse(2.0), loss])
    assert check.nonfinite([dense, torch.tensor(float("-inf"))])
    assert not check.nonfinite([dense, loss])


def test_watch_ignores_a_scaler_still_lowering_its_scale():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    watch = NonfiniteWatch(3, 1.0, scaler)
    nan, skipped = torch.tensor(float("nan")), torch.tensor(1.0)
    for scale in (4.0, 2.0, 1.0, 0.5, 0.25):  # backing off: only scales below 1.0 count
        scaler._scale.fill_(scale)
        watch.observe(nan, skipped, scaler)
    assert watch.count() == 2
    watch.check(5)  # 2 < 3: not yet
    scaler._scale.fill_(0.125)
    watch.observe(nan, skipped, scaler)
    with pytest.raises(Diverged, match="non-finite for 3 consecutive steps") as err:
        watch.check(6)
    assert "with the loss scale below 1" in str(err.value) and "stopped at step 6" in str(err.value)
    assert err.value.tags == {"diverged": "true"}
    static = NonfiniteWatch(2, 1.0, StaticGradScaler("cpu", init_scale=8.0))
    static.observe(torch.tensor(1.0), skipped, None)  # a static scale never recovers: counts
    static.observe(torch.tensor(1.0), torch.tensor(0.0), None)  # a clean step resets
    assert static.count() == 0


def test_without_a_scaler_only_the_loss_counts():
    off = torch.amp.GradScaler("cpu", enabled=False)
    watch = NonfiniteWatch(2, 1.0, off)
    watch.observe(torch.tensor(float("inf")), torch.tensor(0.0), off)
    watch.observe(torch.tensor(1.0), torch.tensor(0.0), off)  # a finite loss resets the run
    watch.observe(torch.tensor(float("nan")), torch.tensor(0.0), off)
    watch.check(3)
    watch.observe(torch.tensor(float("nan")), torch.tensor(0.0), off)
    with pytest.raises(Diverged, match="loss non-finite for 2 consecutive steps \\(stopped"):
        watch.check(4)


def test_a_limit_of_zero_never_stops():
    off = torch.amp.GradScaler("cpu", enabled=False)
    watch = NonfiniteWatch(0, 1.0, off)
    for _ in range(50):
        watch.observe(torch.tensor(float("nan")), torch.tensor(0.0), off)
    watch.check(50)
    assert watch.count() == 0


def test_a_resumed_run_continues_its_count():
    off = torch.amp.GradScaler("cpu", enabled=False)
    watch = NonfiniteWatch(3, 1.0, off, start=2)
    watch.observe(torch.tensor(float("nan")), torch.tensor(0.0), off)
    with pytest.raises(Diverged):
        watch.check(7)


def test_gradscaler_still_keeps_its_scale_as_a_tensor_on_the_device():
    # NonfiniteWatch reads GradScaler's private scale tensor, without a sync (torch 2.14.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))
    assert isinstance(scaler._scale, torch.Tensor)  # noqa: SLF001
    assert scaler._scale.item() == scaler.get_scale() == 8.0  # noqa: SLF001


# ------------------------------------------- a parameterless failure and a divergence, each mode


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16", "fp16_noscale"])
def test_a_parameterless_half_backward_failure_is_named_and_the_run_fails(mode, store_uri, on_path):
    args = example("model=fused_net", f"precision={mode}", f"tracking.uri={store_uri}")
    if mode == "fp32":  # its fp32 backward is sound: nothing to locate
        assert api.train(args).summary["numerics/nonfinite_steps"] == 0
        return
    with pytest.raises(api.TrainError, match="the model is not training") as err:
        api.train(args)  # never "finished" at chance accuracy
    assert "gradient act (FusedAct) (its _HalfBackwardFails) passed back" in str(err.value)
    assert "fix: precision.keep_fp32=[act]" in str(err.value)
    (run,) = all_runs(store_uri)
    tags = run.data.tags
    assert run.info.status == "FAILED"
    assert (tags["numerics.nonfinite_module"], tags["numerics.nonfinite_cause"]) == (
        "act", "precision")  # fmt: skip
    kept = example("model=fused_net", f"precision={mode}", "precision.keep_fp32=[act]",
                   "tracking=none")  # fmt: skip
    assert api.train(kept).summary["numerics/nonfinite_steps"] == 0


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16"])
def test_a_learning_rate_divergence_is_called_one_with_no_precision_fix(mode, store_uri):
    quick = [o for o in QUICK if not o.startswith("model.")]  # the default width diverges
    args = [*quick, "model=mlp", "optimizer=sgd", "optimizer.lr=50", f"precision={mode}",
            "trainer.max_steps=30", "trainer.log_every=5", "trainer.max_nonfinite_steps=5",
            f"tracking.uri={store_uri}"]  # fmt: skip
    with pytest.raises(api.TrainError) as err:
        api.train(args)
    text = str(err.value)
    assert "a divergence, not the format" in text and "grew from" in text
    assert "fix: lower optimizer.lr" in text and "keep_fp32" not in text
    (run,) = all_runs(store_uri)
    assert run.data.tags["numerics.nonfinite_cause"] == "divergence"


def test_most_steps_lost_stops_a_run_between_finite_ones():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    watch = NonfiniteWatch(20, 1.0, scaler)
    loss, skip, ok = torch.tensor(1.0), torch.tensor(1.0), torch.tensor(0.0)
    for i in range(16):  # every third step clean: never 20 in a row
        watch.observe(loss, ok if i % 3 == 0 else skip, scaler)
    with pytest.raises(Diverged, match=r"10 of the last 16 steps were skipped by the scaler"):
        watch.check(16)
    settling = NonfiniteWatch(20, 1.0, scaler)
    for i in range(16):  # a scaler backing off over its first steps, then clean: ordinary
        settling.observe(loss, skip if i < 5 else ok, scaler)
    settling.check(16)
