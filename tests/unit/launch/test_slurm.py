"""app/slurm.py: the checks a SLURM sweep must pass before it is submitted, and the requeue
signal inside a job (runner/signals.py's StopRequest). The same checks run against a
real cluster in tests/e2e/test_slurm.py; here the cases a one-node cluster cannot show (other
machines, partition limits, several partitions) use sinfo's text as SLURM prints it."""

from __future__ import annotations

import os
import signal

import pytest

from ampsweep.config.schema import ConfigError
from ampsweep.launch import slurm
from ampsweep.launch.cluster import parse_sinfo
from ampsweep.runner import job, signals
from ampsweep.runner.signals import StopRequest

# sinfo -h -N -o '%P|%N|%n|%o|%c|%G|%m|%l' on a small GPU cluster
SINFO = """\
cpu*|c1|c1.cluster|10.0.0.11|64|(null)|257000|2-00:00:00
cpu*|c2|c2.cluster|10.0.0.12|64|(null)|257000|2-00:00:00
gpu|g1|g1.cluster|10.0.1.1|32|gpu:a100:4(S:0-1)|515000|12:00:00
gpu|g2|g2.cluster|10.0.1.2|48|gpu:h100:8,gpu:a100:2|1030000|12:00:00
debug|c1|c1.cluster|10.0.0.11|64|(null)|257000|30:00
"""


@pytest.fixture
def cluster(monkeypatch):
    """The cluster of SINFO, with SLURM's commands present."""
    monkeypatch.setattr(slurm, "missing_commands", lambda: [])
    monkeypatch.setattr(slurm, "partitions", lambda: parse_sinfo(SINFO))


NPROC = frozenset({"tasks_per_node", "gpus_per_node"})


def _check(nprocs=(1,), shared=None, **settings):
    defaults = {"timeout_min": 60, "cpus_per_task": 8, "gpus_per_node": 0, "from_nproc": NPROC}
    s = slurm.LauncherSettings(**{**defaults, **settings})
    return slurm.check(s, list(nprocs), shared or {}, "hydra/launcher=ampsweep_slurm")


def test_a_sweep_that_fits_passes(cluster):
    assert _check(partition="gpu", tasks_per_node=4, gpus_per_node=4, mem_gb=256) == []
    assert _check(partition=None, tasks_per_node=8, cpus_per_task=8) == []  # cpu, the default


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"timeout_min": 2}, "hydra.launcher.timeout_min=2: the job is signalled to checkpoint "
         "and requeue hydra.launcher.signal_delay_s=120 seconds before its time limit, so it "
         "would be requeued as soon as it starts: raise timeout_min above 2 minutes"),
        ({"timeout_min": "1h"}, "hydra.launcher.timeout_min=1h: a SLURM job needs a time limit"),
        ({"partition": "debug", "timeout_min": 60}, "hydra.launcher.timeout_min=60: partition "
         "debug allows at most 30 minutes"),
        ({"partition": "gpu", "nodes": 3}, "hydra.launcher.nodes=3: partition gpu has 2 node(s)"),
        ({"partition": "gpu", "tasks_per_node": 8, "gpus_per_node": 8}, "trainer.nproc=8 x "
         "hydra.launcher.cpus_per_task=8 needs 64 CPUs on one node, but the nodes of partition "
         "gpu have at most 48"),
        ({"partition": "gpu", "tasks_per_node": 12, "gpus_per_node": 12, "cpus_per_task": 1},
         "hydra.launcher.gpus_per_node=12 (trainer.nproc=12: a GPU per process): the nodes of "
         "partition gpu have at most 10 GPU(s): lower trainer.nproc"),
        ({"tasks_per_node": 2, "gpus_per_node": 2}, "hydra.launcher.gpus_per_node=2 "
         "(trainer.nproc=2: a GPU per process): the nodes of partition cpu have at most 0 "
         "GPU(s): set hydra.launcher.gpus_per_node=0 to train on CPUs (Gloo)"),
        ({"mem_gb": 300}, "hydra.launcher.mem_gb=300: the nodes of partition cpu have at most "
         "250 GB"),
        ({"partition": "cpu2"}, "hydra.launcher.partition=cpu2: no such partition on this "
         "cluster (sinfo lists cpu, debug, gpu)"),
    ],
    ids=["signal-delay", "not-an-int", "partition-limit", "nodes", "cpus", "gpus", "cpu-only",
         "memory", "partition"],
)  # fmt: skip
def test_what_the_cluster_cannot_run_is_refused_naming_the_key(cluster, settings, message):
    with pytest.raises(ConfigError) as err:
        _check(**settings)
    assert str(err.value).startswith(message), str(err.value)


def test_tasks_per_node_set_by_hand_is_named_as_such(cluster):
    with pytest.raises(ConfigError, match=r"^hydra.launcher.tasks_per_node=100 x .*lower "):
        _check(tasks_per_node=100, from_nproc=frozenset())


def test_a_sweep_over_process_counts_is_refused(cluster):
    with pytest.raises(ConfigError, match=r"^trainer.nproc=1,2: the jobs of one sweep share"):
        _check(nprocs=(1, 2, 2))


def test_no_default_partition_and_a_silent_controller(monkeypatch):
    monkeypatch.setattr(slurm, "missing_commands", lambda: [])
    monkeypatch.setattr(slurm, "partitions", lambda: parse_sinfo(SINFO.replace("*", "")))
    with pytest.raises(ConfigError, match=r"partition=null: this cluster has no default"):
        _check()

    def silent():
        raise slurm.SlurmError("sinfo: error: Unable to contact slurm controller")

    monkeypatch.setattr(slurm, "partitions", silent)
    with pytest.raises(ConfigError, match=r"SLURM does not answer \(sinfo: error: Unable to"):
        _check()


def test_without_slurm_commands_it_names_the_local_launcher(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        _check()
    assert str(err.value) == (
        "hydra/launcher=ampsweep_slurm: SLURM's commands are not found (sbatch, sinfo, squeue, "
        "scancel not on PATH): launch the sweep where SLURM jobs are submitted (a login node), "
        "or use hydra/launcher=ampsweep_local to run each job in a process of this machine"
    )


# ---------------------------------------------------------------- inside a SLURM job


def test_job_id_and_requeue_signal_come_from_the_job_environment():
    assert signals.job_id_from_env({}) is None
    assert signals.job_id_from_env({"SLURM_JOB_ID": "41"}) == "41"
    array = {"SLURM_JOB_ID": "45", "SLURM_ARRAY_JOB_ID": "41", "SLURM_ARRAY_TASK_ID": "3"}
    assert signals.job_id_from_env(array) == "41_3"
    assert signals.requeue_signal({}) is None
    assert signals.requeue_signal({"SUBMITIT_EXECUTOR": "local"}) is None
    assert signals.requeue_signal({"SUBMITIT_EXECUTOR": "slurm"}) == signal.SIGUSR2
    custom = {"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_PREEMPT_SIGNAL": "USR1"}
    assert signals.requeue_signal(custom) == signal.SIGUSR1


@pytest.fixture
def submitit_handler():
    """What submitit installs for USR2 in a job: here it records the calls; ``refuse`` makes
    it refuse to requeue as submitit does after max_num_timeout time limits."""
    from submitit.core.utils import UncompletedJobError

    calls = []

    def handler(signum, frame):
        calls.append(signum)
        if handler.refuse:
            raise UncompletedJobError("Job not requeued because: timed-out too many times.")
        raise SystemExit(-1)  # submitit: requeued, exit

    handler.refuse, handler.calls = False, calls
    previous = signal.signal(signal.SIGUSR2, handler)
    yield handler
    signal.signal(signal.SIGUSR2, previous)


def test_the_requeue_signal_is_deferred_to_a_step_boundary_even_before_training(
    submitit_handler,
):
    stop = StopRequest(signal.SIGUSR2).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)  # before training: no exception, just noted
        assert stop.requested and stop.requeue
        assert submitit_handler.calls == []  # submitit's handler did not run in the middle
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGUSR2) is submitit_handler
    with pytest.raises(SystemExit):
        stop.hand_over()
    assert submitit_handler.calls == [signal.SIGUSR2]
    submitit_handler.refuse = True
    assert stop.hand_over() == "Job not requeued because: timed-out too many times."


def test_sigterm_then_the_requeue_signal_is_a_preemption(submitit_handler):
    stop = StopRequest(signal.SIGUSR2).install()
    try:
        with stop.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested and not stop.requeue  # so far: stop, as for scancel
            os.kill(os.getpid(), signal.SIGUSR2)
            assert stop.requeue
    finally:
        stop.uninstall()


def test_without_a_requeue_signal_usr2_is_left_alone(submitit_handler):
    stop = StopRequest(None).install()
    try:
        assert signal.getsignal(signal.SIGUSR2) is submitit_handler
    finally:
        stop.uninstall()


def test_a_job_told_to_requeue_checkpoints_ends_killed_hands_over_and_resumes_into_its_run(
    store, tmp_path, monkeypatch, submitit_handler, quick
):
    """In-process, as in a SLURM job: SLURM's requeue signal arrives before the first step;
    the job stops after it with a checkpoint, ends its run KILLED and hands over to submitit
    (which requeues and exits); when submitit refuses (time limits used up) the run says so;
    the next start resumes the run to FINISHED."""
    from mlflow import MlflowClient

    from ampsweep.config.compose import load
    from ampsweep.runner import environment
    from ampsweep.runner.job import run_job

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(job, "requeue_signal", lambda environ=None: signal.SIGUSR2)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    tags_of = environment.run_tags

    def signalled(device):  # called as training starts: SLURM's warning comes now
        os.kill(os.getpid(), signal.SIGUSR2)
        return tags_of(device)

    monkeypatch.setattr(environment, "run_tags", signalled)
    cfg = load([*quick, "trainer.resume=auto", f"trainer.checkpoint_dir={tmp_path / 'c'}",
                f"tracking.uri={store}"])  # fmt: skip
    with pytest.raises(SystemExit):  # submitit requeued the job and exits
        run_job(cfg)
    client = MlflowClient(store)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "KILLED" and run.data.tags["slurm_job_id"] == "77"
    assert run.data.tags["error"].startswith(
        "stopped for SLURM's requeue signal (stopped at step 1, checkpoint "
    )
    assert submitit_handler.calls == [signal.SIGUSR2]

    submitit_handler.refuse = True  # the requeued job is signalled again, at its time limit
    outcome = run_job(cfg)
    assert outcome.status == "KILLED" and outcome.run_id == run.info.run_id
    refusal = "not requeued: Job not requeued because: timed-out too many times."
    assert outcome.error == refusal
    assert client.get_run(run.info.run_id).data.tags["error"] == refusal

    monkeypatch.setattr(environment, "run_tags", tags_of)  # a relaunch, left alone
    outcome = run_job(cfg)
    run = client.get_run(run.info.run_id)
    assert outcome.status == run.info.status == "FINISHED"
    assert run.data.tags["resumed_at_step"] == "2"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == [2, 4, 6]  # each log step once, across three starts
