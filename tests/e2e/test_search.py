"""A search through Hydra's optuna sweeper (``hydra/sweeper=optuna``, ampsweep[optuna]): each
batch of trials is checked as it comes (the first before the sweep's parent run exists); one
parent run with a child per trial; the report names each mode's best trial by the objective
the search minimised (the final val/loss)."""

from __future__ import annotations

import pytest
from conftest import all_runs

from ampsweep.tracking import store

pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
pytestmark = pytest.mark.slow

SEARCH = [
    "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=0",
    "precision=choice(fp32,bf16)", "optimizer.lr=interval(0.0001,0.01)",
]  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def optuna_without_its_log_handler():
    """optuna's log handler writes to the stderr it was first made with: in tests that run
    in this process, an earlier test's capture, closed since."""
    import optuna

    optuna.logging.disable_default_handler()
    yield
    optuna.logging.enable_default_handler()


def test_an_optuna_search_is_one_parent_with_a_child_per_trial(store_uri, quick, main):
    result = main("train", "-m", *SEARCH, f"tracking.uri={store_uri}", *quick, "model=mlp")
    assert result.code == 0, result.err
    assert "Traceback" not in result.out + result.err
    runs = all_runs(store_uri)
    (parent,) = [r for r in runs if r.data.tags.get(store.SWEEP) == "true"]
    kids = [r for r in runs if r.data.tags.get(store.PARENT) == parent.info.run_id]
    assert len(kids) == 3 and parent.info.status == "FINISHED"
    assert parent.data.tags[store.JOBS_EXPECTED] == "3"  # the later batch was added
    assert len({k.data.params["optimizer.lr"] for k in kids}) == 3  # the search tried each
    # the report: each mode that ran names its best trial, the lowest val/loss of its trials
    for mode in {k.data.tags[store.PRECISION] for k in kids}:
        mine = [k for k in kids if k.data.tags[store.PRECISION] == mode]
        best = min(mine, key=lambda k: k.data.metrics["val/loss"])
        line = next(ln for ln in result.out.splitlines() if ln.startswith(f"{mode}: best of"))
        assert f"best of {len(mine)} trial(s) is {best.info.run_name} ({best.info.run_id})" in line
    artifacts = store.client_for(store_uri).download_artifacts(parent.info.run_id, "report.md")
    assert "## Best of each mode" in open(artifacts).read()


def test_a_trial_the_checks_refuse_stops_the_search_before_its_parent(store_uri, main):
    args = [*SEARCH, "trainer.batch_size=0", f"tracking.uri={store_uri}"]
    result = main("train", "-m", *args)
    assert result.code == 2 and "trainer.batch_size=0 must be > 0" in result.err
    assert "Traceback" not in result.out + result.err
    assert all_runs(store_uri) == []
