"""ampsweep's Hydra plugins against Hydra's own test suites for them (the ones Hydra's
plugins run): the sweeper (``hydra/sweeper=ampsweep``, launch/sweeper.py) in batches with its
in-process launcher (``hydra/launcher=ampsweep``), and the submitit launchers
``hydra/launcher=ampsweep_local`` and ``ampsweep_slurm``, the latter on the one-node SLURM
cluster of tests/slurm_fixture.py. Their task functions are the suites', not ampsweep's: the
plugins run any Hydra app.

Left out as near-duplicates (each case costs a launch: seconds, and an app's process for
the integration suite; on SLURM a cluster job): ``test_sweep_1_job_strict`` runs the very code
of ``test_sweep_1_job``; of the integration suite's ``test_custom_task_name`` (4 cases) and
``test_custom_sweeper_run_workdir`` (5) one case each, the one that combines the most: the
job name and the sweep's folders are Hydra's own, composed in the job's process from the
config the launcher hands it, the same way in every case. On SLURM also the config
composition variants of the launcher suite (``test_sweep_2_optimizers``,
``test_sweep_over_unspecified_mandatory_default``, ``test_sweep_and_override``): the job
composes its config on the node as in ``test_sweep_2_jobs``; and those two of the
integration suite, which ampsweep_local runs.
"""

from __future__ import annotations

import inspect

import pytest
from hydra.test_utils.launcher_common_tests import (
    BatchedSweeperTestSuite,
    IntegrationTestSuite,
    LauncherTestSuite,
)
from hydra.version import VersionBase
from packaging.version import Version
from pytest import mark
from slurm_fixture import slurm_cluster  # noqa: F401

from ampsweep.config.compose import config_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# ampsweep's conf/ on Hydra's search path (where hydra/launcher/ampsweep_*.yaml live); the
# launcher configs take their processes per job from ampsweep's trainer.nproc, absent here.
SEARCH = f"hydra.searchpath=[file://{config_dir()}]"
LOCAL = [SEARCH, "hydra.launcher.tasks_per_node=1", "hydra.launcher.timeout_min=2"]
# What the cluster's one node has: 2 CPUs, no GPU, little memory. The requeue signal 30 s
# before the 2-minute limit: at the default 120 s SLURM would signal the jobs from their start
# (the launcher refuses that).
SLURM = [*LOCAL, "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1",
         "hydra.launcher.mem_gb=1", "hydra.launcher.signal_delay_s=30"]  # fmt: skip
QUIET = ["-m", "hydra/hydra_logging=disabled", "hydra/job_logging=disabled"]


def cases(test, *ids):
    """The suite's parametrized ``test`` with only its cases ``ids``."""
    (marker,) = [m for m in test.pytestmark if m.name == "parametrize"]
    names, values = marker.args
    kept = [v for v in values if v.id in ids]
    assert len(kept) == len(ids), f"{test.__name__}: no case {set(ids) - {v.id for v in kept}}"

    def only(self, **kwargs):
        return test(self, **kwargs)

    only.__signature__ = inspect.signature(test)  # what pytest reads for the fixtures
    return mark.parametrize(names, kept)(only)


@pytest.fixture(autouse=True)
def hydras_default_version_base(hydra_restore_singletons):
    """The suites expect Hydra's version base unset, which Hydra takes for 1.1 (each job runs
    in its own folder), as in a new process; an earlier test's compose (version_base="1.3")
    set it. Put back after the test with the other singletons."""
    VersionBase.instance().setbase(Version("1.1"))


@pytest.fixture
def on_the_cluster(slurm_cluster, monkeypatch):  # noqa: F811
    """SLURM's commands talk to the test cluster (its env), here and in the suite's apps."""
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)


# ampsweep's sweeper, which composes each job once and hands the in-process launcher the
# composed configs (``launch_composed``); in batches of 2, as Hydra tests its basic sweeper.
SWEEPER = [SEARCH, "hydra/sweeper=ampsweep"]
# The suites' version base (1.1) changes each job's working directory, which Hydra warns about
# in the process that runs the job: here, the test's own.
IN_PROCESS = mark.filterwarnings("ignore:Future Hydra versions will no longer change working")


@IN_PROCESS
@mark.parametrize(
    "launcher_name, overrides", [("ampsweep", [*SWEEPER, "hydra.sweeper.max_batch_size=2"])]
)
class TestSweeperInBatches(BatchedSweeperTestSuite):
    pass


@IN_PROCESS
@mark.parametrize("launcher_name, overrides", [("ampsweep", SWEEPER)])
class TestSweeperAndInProcessLauncher(LauncherTestSuite):
    test_sweep_1_job_strict = None


@mark.parametrize("launcher_name, overrides", [("ampsweep_local", LOCAL)])
class TestLocalLauncher(LauncherTestSuite):
    test_sweep_1_job_strict = None


@mark.parametrize(
    "task_launcher_cfg, extra_flags", [({}, [*QUIET, "hydra/launcher=ampsweep_local", *LOCAL])]
)
class TestLocalLauncherIntegration(IntegrationTestSuite):
    test_custom_task_name = cases(
        IntegrationTestSuite.test_custom_task_name,
        "different_filename_and_config_file_name_override_and_command_line_override",
    )
    test_custom_sweeper_run_workdir = cases(
        IntegrationTestSuite.test_custom_sweeper_run_workdir, "subdir:custom_override_dirname"
    )


@mark.usefixtures("on_the_cluster")
@mark.parametrize("launcher_name, overrides", [("ampsweep_slurm", SLURM)])
class TestSlurmLauncher(LauncherTestSuite):
    test_sweep_1_job_strict = None
    test_sweep_2_optimizers = None
    test_sweep_over_unspecified_mandatory_default = None
    test_sweep_and_override = None


@mark.usefixtures("on_the_cluster")
@mark.parametrize(
    "task_launcher_cfg, extra_flags", [({}, [*QUIET, "hydra/launcher=ampsweep_slurm", *SLURM])]
)
class TestSlurmLauncherIntegration(IntegrationTestSuite):
    # the job's name and folders are Hydra's, the same on any launcher (ampsweep_local runs
    # them); kept here: the job's own working dir on the node, and the original one
    test_custom_task_name = None
    test_custom_sweeper_run_workdir = None
