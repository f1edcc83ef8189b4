"""sweep.repeats: a sweep's configurations each run N times with seeds trainer.seed + i, exactly
the jobs of an explicit trainer.seed sweep (Hydra's sweeper makes them: launch/sweeper.py); bad
values refused with one line."""

from __future__ import annotations

import pytest
from conftest import sweep_jobs


def jobs(*overrides: str) -> list[tuple[str, int]]:
    """(precision, seed) of every job the command would run."""
    code, found = sweep_jobs(*overrides)
    assert code == 0
    return sorted((c.precision.name, c.trainer.seed) for c in found)


def test_repeats_become_a_seed_sweep_from_the_configured_seed():
    assert jobs("precision=fp32,bf16", "sweep.repeats=3") == [
        (m, s) for m in ("bf16", "fp32") for s in (0, 1, 2)
    ]
    assert {s for _, s in jobs("trainer.seed=5", "sweep.repeats=3")} == {5, 6, 7}


def test_repeats_give_the_same_jobs_as_explicit_seeds():
    repeated = jobs("precision=fp32,bf16", "sweep.repeats=3", "model=mlp")
    explicit = jobs("precision=fp32,bf16", "trainer.seed=0,1,2", "model=mlp")
    assert repeated == explicit


def test_repeats_cross_the_sweep_an_experiment_file_adds():
    # experiment=precision_sweep sweeps six modes through hydra.sweeper.params
    found = jobs("experiment=precision_sweep", "sweep.repeats=2")
    assert len(found) == 12 and {s for _, s in found} == {0, 1}


def test_one_repeat_changes_nothing():
    assert jobs("precision=fp32,bf16") == jobs("precision=fp32,bf16", "sweep.repeats=1")
    assert len(jobs("precision=fp32,bf16")) == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sweep.repeats=0"], "sweep.repeats=0 must be >= 1"),
        (["sweep.repeats=-2"], "sweep.repeats=-2 must be >= 1"),
        (["sweep.repeats=2,3"], "sweep.repeats cannot itself be swept"),
        (["sweep.repeats=3", "trainer.seed=0,1"], "give sweep.repeats=3"),
        (["sweep.repeats=three"], "sweep.repeats=three: expected an integer"),
        (["sweep.repeat=3"], "did you mean sweep.repeats?"),
    ],
)
def test_bad_repeats_are_one_line(overrides, message, main, store_uri):
    result = main("train", "-m", *overrides, f"tracking.uri={store_uri}")
    assert result.code == 2
    assert result.err.startswith("error: ") and result.err.count("\n") == 1, result.err
    assert message in result.err and "Traceback" not in result.out + result.err


def test_repeats_without_a_sweep_are_refused(main):
    result = main("train", "sweep.repeats=3")
    assert result.code == 2 and result.err.count("\n") == 1
    assert "sweep.repeats=3 repeats the configurations of a sweep: add -m" in result.err


def test_a_run_records_no_repeats_key():
    # The job's Config has no sweep section: its params and config hash are those of a plain
    # run with its seed, so a relaunch or reproduce of one repeat is an ordinary run.
    from ampsweep.config.compose import flatten, load

    cfg = load(["sweep.repeats=1", "trainer.seed=2"])
    assert not any(k.startswith("sweep.") for k in flatten(cfg))
