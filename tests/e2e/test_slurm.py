"""Sweeps through a real SLURM (the one-node cluster of scripts/slurm_cluster.py): each job a
SLURM job, tracked through an ``mlflow server`` on loopback as on a real cluster, DDP inside a
job, a job preempted (SLURM's requeue signal), requeued and resumed into the same run, a job
cancelled with scancel, a relaunch, and the refusals of sweeps that cannot run.

The cluster has no accounting (slurmdbd): the sweep follows its jobs with squeue, as it does
on any cluster. Every test reads the MLflow store back: statuses, run counts, loss histories.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import EXACT, REPO, mlflow_server
from slurm_fixture import job_state, slurm_cluster, wait_for, wait_state  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

# What this node has: 2 CPUs, no GPU, a few GB of memory (the launcher's defaults ask for 8
# CPUs per task, a GPU per process and 32 GB).
ON_THIS_CLUSTER = [
    "hydra/launcher=ampsweep_slurm",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.gpus_per_node=0",
    "hydra.launcher.mem_gb=1",
]
TINY = [
    "model=mlp",
    "model.width=8",
    "trainer.epochs=1",
    "trainer.max_steps=6",
    "trainer.log_every=2",
    "trainer.timing_warmup_steps=1",
    "trainer.progress=false",
]
# Long enough (about 2-4 s on one thread) to be signalled mid-training after its first
# checkpoint; deterministic so a resumed run can be compared with an uninterrupted one.
LONG = [
    "model=cnn",
    "model.width=16",
    "precision=fp32",
    "trainer.device=cpu",
    "trainer.deterministic=true",
    "trainer.epochs=50",
    "trainer.log_every=20",
    "trainer.checkpoint_every=50",
    "trainer.timing_warmup_steps=1",
    "trainer.progress=false",
]
SWEEP, PARENT, JOB = "ampsweep.sweep", "mlflow.parentRunId", "slurm_job_id"


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory):
    """``mlflow server`` on loopback with served artifacts: the jobs report to it over HTTP,
    as jobs on other nodes of a real cluster would. Each test uses an experiment of its own."""
    folder = tmp_path_factory.mktemp("mlflow_server")
    with mlflow_server(f"sqlite:///{folder / 'mlflow.db'}", folder) as url:
        yield url


def _env(cluster) -> dict[str, str]:
    """The command's environment, which SLURM passes on to the jobs. No OMP_NUM_THREADS: a
    job's processes take their thread count from hydra.launcher.cpus_per_task."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MLFLOW_TRACKING_URI")
    }
    return {**env, "PYTHONPATH": str(REPO / "src"), **cluster.env}


def _start(cluster, tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ampsweep", "train", "-m", *ON_THIS_CLUSTER, *args], cwd=tmp_path,
        env=_env(cluster), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_ctrl_c_as_in_a_terminal,
    )  # fmt: skip


def _ctrl_c_as_in_a_terminal() -> None:
    """The sweep takes Ctrl-C as a command in a terminal does. A suite started in the
    background (``.ci/run &``) has SIGINT ignored, as the shell does for background jobs; its
    processes inherit that, and Python leaves an ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _train(cluster, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The sweep command, run to its end; its jobs start as SLURM starts them."""
    return subprocess.run(
        [sys.executable, "-m", "ampsweep", "train", "-m", *ON_THIS_CLUSTER, *args], cwd=tmp_path,
        env=_env(cluster), capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _logs(tmp_path: Path) -> str:
    """The jobs' own output (submitit's log files), for a failing assertion's message."""
    out = []
    for path in sorted(tmp_path.glob("outputs/multirun/*/*/.submitit/*/*_log.*")):
        text = path.read_text(errors="replace").strip().splitlines()[-15:]
        out.append(f"--- {path.name}\n" + "\n".join(text))
    return "\n".join(out)


def _runs(url: str, experiment: str):
    from mlflow import MlflowClient

    client = MlflowClient(url)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    parents = [r for r in runs if r.data.tags.get(SWEEP) == "true"]
    return client, parents, [r for r in runs if r not in parents]


def _history(client, run, key: str = "train/loss") -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


# ---------------------------------------------------------------- a sweep


def test_sweep_is_one_parent_run_with_a_child_per_slurm_job_and_the_report(
    slurm_cluster,  # noqa: F811
    tracking_server,
    tmp_path,
):
    args = [*TINY, "precision=fp32,bf16", f"tracking.uri={tracking_server}",
            "tracking.experiment=slurm-sweep"]  # fmt: skip
    started = time.monotonic()
    proc = _train(slurm_cluster, tmp_path, *args)
    print(f"2-job SLURM sweep: {time.monotonic() - started:.1f} s")
    assert proc.returncode == 0, proc.stderr[-3000:] + _logs(tmp_path)
    client, parents, kids = _runs(tracking_server, "slurm-sweep")
    assert len(parents) == 1 and len(kids) == 2
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["jobs_finished"] == "2"
    assert {k.data.tags[PARENT] for k in kids} == {parent.info.run_id}
    assert sorted(k.data.tags["precision"] for k in kids) == ["bf16", "fp32"]
    job_ids = sorted(k.data.tags[JOB] for k in kids)
    array = job_ids[0].split("_")[0]
    assert job_ids == [f"{array}_0", f"{array}_1"]  # one SLURM array, a task per job
    for kid in kids:
        assert kid.info.status == "FINISHED"
        assert [s for s, _ in _history(client, kid)] == [2, 4, 6]  # each log step once
        assert kid.info.artifact_uri.startswith("mlflow-artifacts:")  # through the server
        assert kid.data.tags["cpu_threads"] == "1"  # hydra.launcher.cpus_per_task=1
        # SLURM itself ran it to completion
        wait_state(slurm_cluster, kid.data.tags[JOB], "COMPLETED")
    # the report, printed at the end and logged to the parent
    assert "fp32" in proc.stdout and "bf16" in proc.stdout and "Findings" in proc.stdout
    assert "report.md" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    # submitit's files live in the sweep dir, one folder per job
    assert len(list(tmp_path.glob(f"outputs/multirun/*/*/.submitit/{array}_*/*_result.pkl"))) == 2


# ---------------------------------------------------------------- DDP inside a job


def test_ddp_job_is_two_slurm_tasks_one_run_with_the_weights_of_the_global_batch(
    slurm_cluster,  # noqa: F811
    tracking_server,
    tmp_path,
):
    ckpt = tmp_path / "ckpt"
    args = [*EXACT, "trainer.batch_size=16", "trainer.nproc=2", f"trainer.checkpoint_dir={ckpt}",
            f"tracking.uri={tracking_server}", "tracking.experiment=slurm-ddp"]  # fmt: skip
    proc = _train(slurm_cluster, tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:] + _logs(tmp_path)
    client, parents, kids = _runs(tracking_server, "slurm-ddp")
    assert len(parents) == 1 and len(kids) == 1  # two processes, one run
    run = kids[0]
    assert run.info.status == parents[0].info.status == "FINISHED"
    assert run.data.params["world_size"] == run.data.params["trainer.nproc"] == "2"
    # both tasks of the one SLURM job ran (rank 1 records nothing, but returns)
    job_id = run.data.tags[JOB]
    results = sorted(
        p.name for p in tmp_path.glob(f"outputs/multirun/*/*/.submitit/{job_id}/*.pkl")
    )
    assert f"{job_id}_0_result.pkl" in results and f"{job_id}_1_result.pkl" in results
    assert job_state(slurm_cluster, job_id)["NumTasks"] == "2"

    # One process with the global batch (2 x 16) trains the same weights (only the order of
    # float additions differs between two means averaged by all_reduce and one mean of 32).
    from ampsweep.config import compose
    from ampsweep.engine import build, loop

    (end,) = ckpt.glob("*/*/step-*-end.pt")
    ddp = torch.load(end, weights_only=True)["model"]
    setup = build.build(compose.load([*EXACT, "trainer.batch_size=32", "tracking=none"]))
    single = loop.fit(setup, lambda m, s: None)
    for key, value in setup.model.state_dict().items():
        torch.testing.assert_close(ddp[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert run.data.metrics["val/acc"] == pytest.approx(single["val/acc"])


# ---------------------------------------------------------------- preemption, scancel, relaunch


def _reference_history(overrides: list[str]) -> list[tuple[int, float]]:
    """train/loss of the same config trained uninterrupted, in this process, on one thread as
    the SLURM jobs (cpus_per_task=1)."""
    from ampsweep.config import compose
    from ampsweep.engine import build, loop

    history = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        setup = build.build(compose.load([*overrides, "tracking=none"]))
        loop.fit(
            setup,
            lambda m, step: history.append((step, m["train/loss"])) if "train/loss" in m else None,
        )
    finally:
        torch.set_num_threads(threads)
    return history


def test_preempted_job_requeues_into_its_run_a_cancelled_one_ends_killed_and_a_relaunch_resumes_it(
    slurm_cluster,  # noqa: F811
    tracking_server,
    tmp_path,
):
    ckpt = tmp_path / "ckpt"
    exp = "slurm-preempt"
    args = [*LONG, "tracking.run_name=preempted,cancelled",
            f"trainer.checkpoint_dir={ckpt}", f"tracking.uri={tracking_server}",
            f"tracking.experiment={exp}"]  # fmt: skip
    sweep = _start(slurm_cluster, tmp_path, *args)
    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_server)

        # What SLURM sends signal_delay_s before a job's time limit (and, where configured,
        # before preempting it): the job checkpoints and submitit requeues it. And scancel.
        signals = {"preempted": ["--signal=USR2"], "cancelled": []}
        job_of = {}

        def signal_each_once_training():  # after its first checkpoint, mid-training
            e = client.get_experiment_by_name(exp)
            for run in client.search_runs([e.experiment_id]) if e else []:
                name, folder = run.info.run_name, run.data.tags.get("checkpoint_dir")
                if name in signals and folder and list(Path(folder).glob("step-*.pt")):
                    job_of[name] = run.data.tags[JOB]
                    slurm_cluster.run("scancel", *signals.pop(name), job_of[name])
            return not signals

        wait_for("both jobs to write a checkpoint", signal_each_once_training, 180, poll=0.1)
        preempted, cancelled = job_of["preempted"], job_of["cancelled"]
        out, err = sweep.communicate(timeout=300)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 1, err[-3000:] + _logs(tmp_path)  # a job did not finish
    assert "#1 cancelled" in err and "KILLED" in err
    assert "requeued" in out

    client, parents, kids = _runs(tracking_server, exp)
    reference = _reference_history(LONG)
    steps = [s for s, _ in reference]
    by_name = {k.info.run_name: k for k in kids}
    assert len(parents) == 1 and len(kids) == 2
    parent = parents[0]
    assert parent.info.status == "FAILED"
    assert (parent.data.tags["jobs_finished"], parent.data.tags["jobs_killed"]) == ("1", "1")

    # The preempted job: stopped at a step boundary with a checkpoint, requeued by SLURM (the
    # same job id ran twice), resumed into the same run, which FINISHED with every step
    # logged once and the losses of an uninterrupted run.
    run = by_name["preempted"]
    assert run.info.status == "FINISHED"
    assert "requeue signal" in run.data.tags["previous_error"]
    resumed_at = int(run.data.tags["resumed_at_step"])
    assert 50 <= resumed_at < steps[-1]
    # from the checkpoint it wrote at the step it stopped
    assert run.data.tags["resumed_from"].endswith(f"step-{resumed_at:08d}.pt")
    assert job_state(slurm_cluster, preempted)["Restarts"] == "1"
    assert _history(client, run) == reference

    # The cancelled job: SLURM's SIGTERM stopped it at a step boundary with a checkpoint;
    # its run is KILLED and the sweep's parent counts it.
    run = by_name["cancelled"]
    assert run.info.status == "KILLED"
    assert "interrupted (stopped at step" in run.data.tags["error"]
    stopped_at = int(re.search(r"stopped at step (\d+)", run.data.tags["error"]).group(1))
    wait_state(slurm_cluster, cancelled, "CANCELLED")
    assert [s for s, _ in _history(client, run)] == [s for s in steps if s <= stopped_at]

    # Relaunching the sweep skips the job that finished and resumes the cancelled one.
    proc = _train(slurm_cluster, tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:] + _logs(tmp_path)
    assert "preempted skipped" in proc.stdout.replace("\n", " ")
    client, parents, kids = _runs(tracking_server, exp)
    assert len(parents) == 2 and len(kids) == 2  # no new child run: the old one continued
    relaunch = parents[1]
    assert relaunch.info.status == "FINISHED"
    assert relaunch.data.tags["skipped.0"] == by_name["preempted"].info.run_id
    run = next(k for k in kids if k.info.run_name == "cancelled")
    assert run.info.run_id == by_name["cancelled"].info.run_id
    assert run.info.status == "FINISHED"
    assert run.data.tags[PARENT] == relaunch.info.run_id
    assert int(run.data.tags["resumed_at_step"]) == stopped_at
    assert _history(client, run) == reference


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["hydra.launcher.partition=nope"],
            "hydra.launcher.partition=nope: no such partition on this cluster (sinfo lists debug)",
        ),
        (
            ["hydra.launcher.timeout_min=0"],
            "hydra.launcher.timeout_min=0: a SLURM job needs a time limit of at least 1 minute",
        ),
        (
            ["trainer.nproc=3"],
            "trainer.nproc=3 x hydra.launcher.cpus_per_task=1 needs 3 CPUs on one node, but the "
            "nodes of partition debug have at most 2",
        ),
        (
            ["hydra.launcher.gpus_per_node=1"],
            "hydra.launcher.gpus_per_node=1: the nodes of partition debug have at most 0 GPU(s): "
            "set hydra.launcher.gpus_per_node=0",
        ),
        (["hydra.launcher.mem_gb=100000"], "hydra.launcher.mem_gb=100000: the nodes of partition"),
        (
            [None],
            "hydra/launcher=ampsweep_slurm: SLURM's commands are not found (sbatch, sinfo, "
            "squeue, scancel not on PATH)",
        ),
    ],
    ids=["partition", "timeout", "nproc", "gpus", "memory", "no-slurm"],
)
def test_a_sweep_slurm_cannot_run_is_refused_in_one_line_before_anything_is_recorded(
    slurm_cluster,  # noqa: F811
    store,
    tmp_path,
    monkeypatch,
    capsys,
    extra,
    expected,
):
    from mlflow import MlflowClient

    from ampsweep.cli.train import cmd_train

    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    # A job of an earlier test may still be ending (its process exits after its run has ended).
    queued_before = set(slurm_cluster.run("squeue", "-h", "-o", "%i").split())
    path = os.environ["PATH"]
    if extra == [None]:  # a machine without SLURM: none of its commands on PATH
        monkeypatch.setenv("PATH", str(tmp_path))
        extra = []
    monkeypatch.chdir(tmp_path)
    code = cmd_train(["-m", *ON_THIS_CLUSTER, *TINY, "precision=fp32,bf16", *extra,
                      f"tracking.uri={store}"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith(f"error: {expected}"), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    if "not found" in expected:
        assert "use hydra/launcher=ampsweep_local" in err
    client = MlflowClient(store)
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []
    assert not (tmp_path / "outputs" / "multirun").exists()  # nothing submitted
    monkeypatch.setenv("PATH", path)
    assert set(slurm_cluster.run("squeue", "-h", "-o", "%i").split()) <= queued_before


def test_ctrl_c_on_the_sweep_cancels_its_jobs_which_end_their_runs_killed(
    slurm_cluster,  # noqa: F811
    tracking_server,
    tmp_path,
):
    exp = "slurm-interrupt"
    # Ten times LONG's epochs: the job is cancelled after its first checkpoint, so this costs
    # nothing, and on a fast CPU (1,100 steps in 2.7 s) the job cannot end before the cancel.
    longer = [a if not a.startswith("trainer.epochs=") else "trainer.epochs=500" for a in LONG]
    args = [*longer, f"trainer.checkpoint_dir={tmp_path / 'ckpt'}",
            f"tracking.uri={tracking_server}", f"tracking.experiment={exp}"]  # fmt: skip
    sweep = _start(slurm_cluster, tmp_path, *args)
    try:
        wait_for(
            "the job's first checkpoint",
            lambda: list(tmp_path.glob("ckpt/*/*/step-*.pt")),
            180,
            poll=0.1,
        )
        assert sweep.poll() is None, "the sweep ended before its job's first checkpoint was seen"
        sweep.send_signal(signal.SIGINT)  # Ctrl-C
        out, err = sweep.communicate(timeout=120)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 130, err[-3000:] + _logs(tmp_path)
    assert "interrupted: cancelling SLURM job(s)" in err
    client, parents, kids = _runs(tracking_server, exp)
    assert len(parents) == len(kids) == 1
    assert parents[0].info.status == "KILLED" and parents[0].data.tags["jobs_killed"] == "1"
    run = kids[0]
    assert run.info.status == "KILLED"
    assert "interrupted (stopped at step" in run.data.tags["error"]  # with a checkpoint
    wait_state(slurm_cluster, run.data.tags[JOB], "CANCELLED")
