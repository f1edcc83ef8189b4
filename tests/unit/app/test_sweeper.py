"""app/sweeper.py: ampsweep's Hydra sweeper runs the jobs seed-major (every mode of one seed,
then the next), an experiment's own sweep params included; Hydra's whole sweep grammar works
(glob() against the config groups, with exclude); a key given twice counts once, as in
Hydra's own sweeper; a search's interval() is for a sweeper that searches."""

from __future__ import annotations

from conftest import sweep_jobs
from hydra.core.override_parser.overrides_parser import OverridesParser

from ampsweep.app.sweeper import seed_major_jobs
from ampsweep.precision.modes import MODES

SEEDS_MAJOR = [("fp32", 0), ("bf16", 0), ("fp32", 1), ("bf16", 1)]


def pairs(jobs) -> list[tuple[str, int]]:
    return [(c.precision.name, c.trainer.seed) for c in jobs]


def test_the_jobs_run_every_mode_of_a_seed_before_the_next_seed():
    parsed = OverridesParser.create().parse_overrides(
        ["precision=fp32,bf16", "model=mlp", "trainer.seed=0,1"]
    )
    jobs = seed_major_jobs(parsed)
    # each job keeps its overrides in the order given (what its run records)
    assert jobs[1] == ["precision=bf16", "model=mlp", "trainer.seed=0"]
    code, found = sweep_jobs("precision=fp32,bf16", "model=mlp", "trainer.seed=0,1")
    assert code == 0 and pairs(found) == SEEDS_MAJOR


def test_the_experiments_params_come_first_and_repeats_still_run_seed_major():
    code, found = sweep_jobs("experiment=precision_sweep", "sweep.repeats=2")
    modes = ["fp32", "fp16", "fp16_static", "fp16_noscale", "bf16", "bf16_pure"]
    assert code == 0 and pairs(found) == [(m, s) for s in (0, 1) for m in modes]


def test_glob_picks_the_config_groups_options():
    code, found = sweep_jobs("precision=glob(fp16*)")
    fp16 = sorted(m for m in MODES if m.startswith("fp16"))
    assert code == 0 and sorted(c.precision.name for c in found) == fp16
    code, found = sweep_jobs("precision=glob(*,exclude=[tf32,fp8*,auto,fp16*])")
    assert code == 0
    assert sorted(c.precision.name for c in found) == ["bf16", "bf16_pure", "fp32"]


def test_range_choice_and_a_key_given_twice():
    code, found = sweep_jobs("trainer.seed=range(0,3)", "precision=choice(fp32,bf16)")
    assert code == 0 and len(found) == 6
    code, found = sweep_jobs("precision=fp32,bf16", "precision=fp32,bf16")
    assert code == 0 and [c.precision.name for c in found] == ["fp32", "bf16"]


def test_an_interval_needs_a_sweeper_that_searches(main):
    result = main("train", "-m", "optimizer.lr=interval(0.0001,0.01)")
    assert result.code == 2 and result.err.count("\n") == 1, result.err
    assert "optimizer.lr=interval(0.0001,0.01): hydra/sweeper=ampsweep takes lists" in result.err
    assert "use hydra/sweeper=optuna" in result.err
