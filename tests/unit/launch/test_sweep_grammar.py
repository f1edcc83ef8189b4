"""Hydra's sweep grammar through ``ampsweep train -m``: every sweep it allows gives its jobs
(choice, range of ints or floats, glob, tag, sort, shuffle, a search's interval under optuna),
and every sweep that has no job or that a sweeper refuses is one line naming the override and
the fix, exit 2, before anything exists: no sweep dir, no run or experiment in the store."""

from __future__ import annotations

import pytest
from conftest import all_runs, sweep_jobs

OPTUNA = "hydra/sweeper=optuna"

REFUSED = [
    # (the command's sweep, what its one line says)
    (["precision=glob(zz*)"], "glob() matches no option of config group precision"),
    (["trainer.seed=glob(*)"], "trainer.seed is not one"),
    (["trainer.seed=range(0,3,0)"], "step 0 never reaches its end"),
    (["trainer.seed=range(3,0)"], "an empty range"),
    (["trainer.seed=range(2,2)"], "an empty range: it stops where it starts"),
    (["optimizer.lr=range(0.1,0.01,0.01)"], "an empty range"),
    (["optimizer.lr=interval(0.001,0.1)"], "interval sweeps are for a search"),
    (["precision=choice()"], "cannot parse this override"),
    (["trainer.nosuch=1,2"], "unknown key 'nosuch'"),
    (["precision=fp32,zz"], "no such option in config group 'precision'"),
    (["trainer.seed=range(0,1,0.5)"], "expected an integer"),
    (["hydra.sweeper.max_batch_size=-1", "precision=fp32,bf16"], "give 1 or more"),
    (["hydra/sweeper=basic", "optimizer.lr=interval(0.001,0.1)"], "interval() has no list"),
    (["hydra/sweeper=basic", "trainer.seed=range(3,0)"], "an empty range"),
    ([OPTUNA, "hydra.sweeper.n_trials=0"], "a search runs at least one trial"),
    ([OPTUNA, "hydra.sweeper.n_jobs=0"], "a search runs at least one at a time"),
    ([OPTUNA, "hydra.sweeper.max_failure_rate=2"], "from 0 to 1"),
    ([OPTUNA, "optimizer.lr=interval(0.1,0.001)"], "write interval(0.001,0.1)"),
    ([OPTUNA, "optimizer.lr=tag(log,interval(0,0.1))"], "a low end above 0"),
    ([OPTUNA, "trainer.seed=range(3,0,-1)"], "counts up: write range(0,3,1)"),
    ([OPTUNA, "precision=glob(fp16*)"], "not glob(): list the options"),
    ([OPTUNA, "trainer.seed=range(3,0)"], "an empty range"),
]


@pytest.mark.parametrize(("sweep", "said"), REFUSED, ids=[" ".join(s) for s, _ in REFUSED])
def test_a_refused_sweep_is_one_line_and_leaves_nothing(
    main, store_uri, monkeypatch, tmp_path, sweep, said
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    experiments = _experiments(store_uri)
    result = main("train", "-m", *sweep)
    assert result.code == 2, result.err
    assert result.err.count("\n") == 1 and said in result.err, result.err
    named = result.err.removeprefix("error: ").split(": ")[0]  # the override refused
    assert any(named.startswith(s.split("=")[0] + "=") for s in sweep), result.err
    assert not (tmp_path / "outputs").exists()
    assert all_runs(store_uri) == [] and _experiments(store_uri) == experiments


def _experiments(uri: str) -> list[str]:
    from ampsweep.tracking.store import client_for

    return sorted(e.name for e in client_for(uri).search_experiments())


def _values(key: str, *sweep: str) -> list:
    code, jobs = sweep_jobs(*sweep)
    assert code == 0
    section, name = key.split(".")
    return [getattr(getattr(job, section), name) for job in jobs]


def test_choice_range_tag_and_sort_give_their_values_in_order():
    assert _values("precision.name", "precision=choice(fp32,bf16)") == ["fp32", "bf16"]
    assert _values("trainer.seed", "trainer.seed=range(3)") == [0, 1, 2]
    assert _values("trainer.seed", "trainer.seed=range(4,0,-2)") == [4, 2]
    assert _values("trainer.seed", "trainer.seed=tag(repeat,range(0,2))") == [0, 1]
    assert _values("trainer.seed", "trainer.seed=sort(3,1,2)") == [1, 2, 3]
    assert _values("trainer.seed", "trainer.seed=sort(range(0,3),reverse=true)") == [2, 1, 0]
    assert _values("precision.name", "precision=sort(fp32,bf16)") == ["bf16", "fp32"]


def test_shuffle_runs_every_value_once():
    assert sorted(_values("trainer.seed", "trainer.seed=shuffle(0,1,2)")) == [0, 1, 2]
    assert sorted(_values("trainer.seed", "trainer.seed=shuffle(range(0,3))")) == [0, 1, 2]


def test_a_range_of_floats_is_the_decimals_typed_without_its_stop():
    lrs = _values("optimizer.lr", "optimizer.lr=range(0.1,0.7,0.1)")
    assert lrs == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    assert _values("optimizer.lr", "optimizer.lr=range(0.001,0.003,0.001)") == [0.001, 0.002]
    reverse = "optimizer.lr=sort(range(0.1,0.4,0.1),reverse=true)"
    assert _values("optimizer.lr", reverse) == [0.3, 0.2, 0.1]


def test_a_search_runs_its_interval_under_optuna():
    code, jobs = sweep_jobs(OPTUNA, "hydra.sweeper.n_trials=2", "optimizer.lr=interval(0.001,0.1)")
    assert code == 0 and jobs
    assert all(0.001 <= job.optimizer.lr <= 0.1 for job in jobs)
