"""Repeats run seed-major: every mode of one seed, then the next seed, both in the jobs the
command composes (config/compose.expand_sweep) and in the order ampsweep's sweeper runs them
(hydra_plugins/ampsweep_launcher/sweeper.py), an experiment's own sweep params included."""

from __future__ import annotations

from hydra.core.override_parser.overrides_parser import OverridesParser

from ampsweep.config.compose import expand_sweep

SEEDS_MAJOR = [("fp32", "0"), ("bf16", "0"), ("fp32", "1"), ("bf16", "1")]


def pairs(jobs):
    return [tuple(o.split("=", 1)[1] for o in job if o.split("=")[0] in ("precision",
            "trainer.seed")) for job in jobs]  # fmt: skip


def test_the_composed_jobs_run_every_mode_of_a_seed_before_the_next_seed():
    jobs = expand_sweep(["precision=fp32,bf16", "model=mlp", "trainer.seed=0,1"])
    assert pairs(jobs) == SEEDS_MAJOR
    # each job keeps its overrides in the order given
    assert jobs[1] == ["precision=bf16", "model=mlp", "trainer.seed=0"]


def test_the_sweeper_runs_them_in_that_order_with_the_experiment_params_first():
    # Hydra's sweeper puts hydra.sweeper.params (an experiment file's) before the command's
    # overrides, where the seeds that sweep.repeats made come last
    from hydra.core.plugins import Plugins

    # Hydra's first plugin scan runs its own plugin modules again: the sweeper subclasses the
    # basic sweeper after it (as app/launcher.register does), never at collection time
    Plugins.instance()
    from hydra_plugins.ampsweep_launcher.sweeper import AmpsweepSweeper

    parsed = OverridesParser.create().parse_overrides(
        ["precision=fp32,bf16", "model=mlp", "trainer.seed=0,1"]
    )
    (batch,) = AmpsweepSweeper.split_arguments(parsed, None)
    assert pairs(batch) == SEEDS_MAJOR
    assert batch[1] == ["precision=bf16", "model=mlp", "trainer.seed=0"]
