"""hydra_plugins/ampsweep_launcher/submitit_launcher.py: ampsweep's launchers hand the jobs'
outcomes back to the command through the JobReturns they return, and the plugin module
imports cleanly whether or not the cluster extra is installed."""

from __future__ import annotations

import runpy
import sys

from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher

import hydra_plugins.ampsweep_launcher.submitit_launcher as plugin
from ampsweep.runner.job import CommandContext, JobOutcome, TaskFunction


def _ret(value, status=JobStatus.COMPLETED) -> JobReturn:
    ret = JobReturn(overrides=[], status=status)
    ret.return_value = value
    return ret


def test_the_outcomes_in_the_launchers_returns_reach_the_command():
    command = CommandContext()
    done = JobOutcome("fp32-mlp-digits", "FINISHED", "id0", job_num=0)
    lost = JobOutcome("job 1", "KILLED", error="SLURM job 7_1 ended CANCELLED", job_num=1)
    raised = _ret(ValueError("boom"), JobStatus.FAILED)  # Hydra's sweeper raises it itself
    plugin.hand_back(TaskFunction(command), [_ret(done), _ret(lost), raised])
    assert command.outcomes == [done, lost]


def test_another_apps_task_function_gets_nothing_handed_back():
    calls = []

    def task(cfg):
        calls.append(cfg)
        return 100

    plugin.hand_back(task, [_ret(100)])
    assert not calls and not hasattr(task, "outcomes")


def test_hydra_finds_both_launchers_under_the_plugin_modules_names():
    found = {f"{c.__module__}.{c.__name__}": c for c in Plugins.instance().discover(Launcher)}
    for name in ("LocalLauncher", "SlurmLauncher"):
        cls = found[f"hydra_plugins.ampsweep_launcher.submitit_launcher.{name}"]
        assert cls is getattr(plugin, name)


def test_the_plugin_module_names_nothing_without_the_cluster_extra(monkeypatch):
    # Hydra imports every module under hydra_plugins at start-up: it must not fail there.
    monkeypatch.setitem(sys.modules, "hydra_plugins.hydra_submitit_launcher", None)
    names = runpy.run_path(plugin.__file__)
    assert "SlurmLauncher" not in names and "LocalLauncher" not in names
