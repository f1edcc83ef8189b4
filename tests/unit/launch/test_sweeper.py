"""launch/sweeper.py: ampsweep's Hydra sweeper runs the jobs seed-major (every mode of one seed,
then the next), an experiment's own sweep params included; Hydra's whole sweep grammar works
(glob() against the config groups, with exclude); a key given twice counts once, as in
Hydra's own sweeper; a search's interval() is for a sweeper that searches. Hydra's plugin scan
finds ampsweep's plugins without importing torch."""

from __future__ import annotations

import subprocess
import sys

from conftest import cli_env, sweep_jobs
from hydra.core.override_parser.overrides_parser import OverridesParser

from ampsweep.launch.sweeper import seed_major_jobs
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


def test_hydras_plugin_scan_finds_ampsweeps_plugins_without_importing_torch():
    """Hydra imports every plugin module at the start of any Hydra app in the environment
    (ampsweep's, a user's own, each job of Hydra's test suites): ampsweep's plugins must not
    cost it torch (2-3 s), nor MLflow."""
    scan = (
        "import sys\n"
        "from hydra.core.plugins import Plugins\n"
        "from hydra.plugins.launcher import Launcher\n"
        "from hydra.plugins.sweeper import Sweeper\n"
        "found = [p.__name__ for kind in (Sweeper, Launcher) for p in Plugins.instance()"
        ".discover(kind)]\n"
        "print(sorted(n for n in found if n.startswith('Ampsweep')))\n"
        "print(sorted(m for m in ('torch', 'mlflow') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", scan], env=cli_env(), capture_output=True,
                         text=True, check=True).stdout.splitlines()  # fmt: skip
    assert out == ["['AmpsweepLauncher', 'AmpsweepSweeper']", "[]"], out
