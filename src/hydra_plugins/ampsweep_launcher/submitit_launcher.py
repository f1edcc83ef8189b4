"""ampsweep's SLURM launcher for Hydra (``hydra/launcher=ampsweep_slurm``).

Hydra's submitit launcher with ampsweep's way of waiting for the jobs (see
``ampsweep.app.launcher``). It lives here because Hydra accepts launchers only from the
``hydra_plugins`` namespace; Hydra imports every module here at start-up, so this one stays
small and tolerates the cluster extra (hydra-submitit-launcher) not being installed.
"""

from __future__ import annotations

try:
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher as _submitit
except ImportError:  # pip install 'ampsweep[cluster]' brings it
    _submitit = None

if _submitit is not None:

    class SlurmLauncher(_submitit.SlurmLauncher):
        """Each job of a sweep is a SLURM job; every job is waited for, whatever happens."""

        def launch(self, job_overrides, initial_job_idx):
            from ampsweep.app.launcher import launch

            return launch(self, job_overrides, initial_job_idx)
