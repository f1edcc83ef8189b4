"""ampsweep's Hydra launchers: ``hydra/launcher=ampsweep_local`` and ``ampsweep_slurm``
(conf/hydra/launcher/*.yaml name these classes as their ``_target_``).

Hydra's submitit launchers (the cluster extra: ``pip install 'ampsweep[cluster]'``), which
run each job of a sweep in a process of its own and hand the jobs' outcomes back to the
command: a job's ``JobOutcome`` travels in the ``JobReturn`` the launcher returns to Hydra
(its ``return_value``), and the launcher passes those returns to the task function Hydra set
it up with, when that is ampsweep's (``TaskFunction.collect``). The SLURM one waits for every
job in its own way (``ampsweep.launch.launcher``).

They live here because Hydra accepts a launcher only from the ``hydra_plugins`` namespace.
Hydra imports every module here at start-up, in any Hydra app, so this one imports nothing
heavy (the waiting, the job and MLflow are imported when a sweep is launched), and without
the cluster extra (hydra-submitit-launcher) it defines nothing and imports cleanly.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from hydra.core.utils import JobReturn


def hand_back(task_function, returns: Sequence[JobReturn]) -> None:
    """The jobs' returns to the command, when the task function is ampsweep's (the launchers
    run any Hydra app's task function too)."""
    from ampsweep.runner.job import TaskFunction

    if isinstance(task_function, TaskFunction):
        task_function.collect(returns)


if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None:
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher as submitit

    class LocalLauncher(submitit.LocalLauncher):
        """Each job of a sweep in a local process of its own (submitit's local executor), the
        way the SLURM launcher runs them on a cluster."""

        def launch(self, job_overrides, initial_job_idx: int) -> Sequence[JobReturn]:
            returns = super().launch(job_overrides, initial_job_idx)
            hand_back(self.task_function, returns)
            return returns

    class SlurmLauncher(submitit.SlurmLauncher):
        """Each job of a sweep is a SLURM job; every job is waited for, whatever happens to
        it."""

        def launch(self, job_overrides, initial_job_idx: int) -> Sequence[JobReturn]:
            from ampsweep.launch import launcher  # deferred: see the module's docstring

            returns = launcher.launch(self, job_overrides, initial_job_idx)
            hand_back(self.task_function, returns)
            return returns
