"""measure/numerics.py: a run records where its first non-finite value began (tags, artifact,
console) and a divergence names it with its fix instead of the generic advice; finite steps
locate nothing; the gradient check the locator reads each step. (The replay that names the
place: test_replay.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import QUICK, REPO, all_runs

from ampsweep.app import api
from ampsweep.measure.numerics import GradientCheck

EXAMPLE = REPO / "examples" / "doctor"


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
