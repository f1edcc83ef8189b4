"""sweep.repeats: a sweep's configurations each run N times with seeds trainer.seed + i, exactly
the jobs of an explicit trainer.seed sweep; bad values refused with one line."""

from __future__ import annotations

import pytest

from ampsweep.config.compose import repeat_overrides, validate_command
from ampsweep.config.schema import ConfigError


def jobs(overrides: list[str]) -> list[tuple[str, int]]:
    """(precision, seed) of every job the command would run."""
    drop, add, _ = repeat_overrides(overrides)
    kept = [o for o in overrides if o not in drop] + add
    return sorted((c.precision.name, c.trainer.seed) for c in validate_command(kept, True))


def test_repeats_become_a_seed_sweep_from_the_configured_seed():
    drop, add, n = repeat_overrides(["precision=fp32,bf16", "sweep.repeats=3"])
    assert (drop, add, n) == (["sweep.repeats=3"], ["trainer.seed=0,1,2"], 3)
    drop, add, _ = repeat_overrides(["trainer.seed=5", "sweep.repeats=3"])
    assert set(drop) == {"trainer.seed=5", "sweep.repeats=3"} and add == ["trainer.seed=5,6,7"]


def test_repeats_give_the_same_jobs_as_explicit_seeds():
    repeated = jobs(["precision=fp32,bf16", "sweep.repeats=3", "model=mlp"])
    explicit = jobs(["precision=fp32,bf16", "trainer.seed=0,1,2", "model=mlp"])
    assert repeated == explicit == [(m, s) for m in ("bf16", "fp32") for s in (0, 1, 2)]


def test_repeats_cross_the_sweep_an_experiment_file_adds():
    # experiment=precision_sweep sweeps six modes through hydra.sweeper.params
    found = jobs(["experiment=precision_sweep", "sweep.repeats=2"])
    assert len(found) == 12 and {s for _, s in found} == {0, 1}


def test_one_repeat_changes_nothing():
    assert repeat_overrides(["precision=fp32,bf16"]) == ([], [], 1)
    assert repeat_overrides(["precision=fp32,bf16", "sweep.repeats=1"]) == ([], [], 1)


@pytest.mark.parametrize(
    ("overrides", "multirun", "message"),
    [
        (["sweep.repeats=0"], True, "sweep.repeats=0 must be >= 1"),
        (["sweep.repeats=-2"], True, "sweep.repeats=-2 must be >= 1"),
        (["sweep.repeats=2,3"], True, "sweep.repeats cannot itself be swept"),
        (["sweep.repeats=3", "trainer.seed=0,1"], True, "give sweep.repeats=3"),
        (["sweep.repeats=three"], True, "sweep.repeats=three: expected an integer"),
        (["sweep.repeat=3"], True, "did you mean sweep.repeats?"),
    ],
)
def test_bad_repeats_are_one_line(overrides, multirun, message):
    with pytest.raises(ConfigError) as err:
        repeat_overrides(overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_repeats_without_a_sweep_are_refused():
    with pytest.raises(ConfigError, match=r"sweep.repeats=3 repeats .* add -m"):
        validate_command(["sweep.repeats=3"], multirun=False)


def test_a_run_records_no_repeats_key():
    # The job's Config has no sweep section: its params and config hash are those of a plain
    # run with its seed, so a relaunch or reproduce of one repeat is an ordinary run.
    from ampsweep.config.compose import flatten, load

    cfg = load(["sweep.repeats=1", "trainer.seed=2"])
    assert not any(k.startswith("sweep.") for k in flatten(cfg))
