"""tracking/sweep.py: a sweep's parent run, its bookkeeping from the children's statuses
(missing jobs fail it), skipped jobs of a relaunch, and parents whose launcher died."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from ampsweep.config.schema import TrackingConfig
from ampsweep.tracking import store, sweep


@pytest.fixture
def begun(tmp_path, store_uri):
    """A sweep of three expected jobs, begun (its parent RUNNING); returns (info, client)."""
    info = sweep.begin(
        store_uri,
        TrackingConfig(uri=store_uri),
        tmp_path / "multirun",
        name="sweep-test",
        command="ampsweep train -m precision=fp32,fp16,bf16",
        expected_jobs=3,
        run_names=["fp32-cnn-digits", "fp16-cnn-digits", "fp16-cnn-digits"],
    )
    return info, store.client_for(store_uri)


def child(info, client, job_num: int, status: str, error: str | None = None) -> str:
    parent = client.get_run(info.parent_run_id)
    tags = {store.PARENT: info.parent_run_id, store.JOB_NUM: str(job_num)}
    if error:
        tags[store.ERROR] = error
    run = client.create_run(parent.info.experiment_id, run_name=f"job-{job_num}", tags=tags)
    client.set_terminated(run.info.run_id, status)
    return run.info.run_id


def test_begin_creates_the_parent_and_the_sweep_file(begun, tmp_path):
    info, client = begun
    parent = client.get_run(info.parent_run_id)
    assert parent.info.status == store.RUNNING and parent.info.run_name == "sweep-test"
    tags = parent.data.tags
    assert tags[store.SWEEP] == "true" and tags[store.JOBS_EXPECTED] == "3"
    assert tags[store.SWEEP_DIR] == str(tmp_path / "multirun")
    assert tags[store.LAUNCHER_PID] == str(os.getpid())
    # Jobs in other processes find the sweep through the file in the sweep dir.
    assert sweep.SweepInfo.from_sweep_dir(tmp_path / "multirun") == info
    assert sweep.SweepInfo.from_sweep_dir(tmp_path) is None
    # Names that repeat get the job number; the others keep theirs.
    assert info.run_name("fp16-cnn-digits", 2) == "fp16-cnn-digits-2"
    assert info.run_name("fp32-cnn-digits", 0) == "fp32-cnn-digits"


def test_every_job_finished_finishes_the_sweep(begun):
    info, client = begun
    for num in range(3):
        child(info, client, num, store.FINISHED)
    result = sweep.conclude(info, interrupted=False)
    assert result.status == store.FINISHED and result.missing == 0
    assert client.get_run(info.parent_run_id).info.status == store.RUNNING  # until end()
    sweep.end(info, result)
    parent = client.get_run(info.parent_run_id)
    assert parent.info.status == store.FINISHED
    tags = parent.data.tags
    assert (tags["jobs_total"], tags["jobs_finished"], tags["jobs_failed"]) == ("3", "3", "0")
    assert "jobs_missing" not in tags


def test_missing_jobs_fail_the_sweep_and_are_counted(begun):
    info, client = begun
    child(info, client, 0, store.FINISHED)
    child(info, client, 1, store.FINISHED)  # job 2 never recorded a run (its process died)
    result = sweep.conclude(info, interrupted=False)
    sweep.end(info, result)
    assert result.status == store.FAILED and result.missing == 1
    parent = client.get_run(info.parent_run_id)
    assert parent.info.status == store.FAILED
    assert parent.data.tags["jobs_missing"] == "1" and parent.data.tags["jobs_total"] == "2"
    assert result.describe_failures() == []  # no recorded run failed: it is the missing one


def test_a_failed_job_fails_the_sweep_and_is_described(begun):
    info, client = begun
    child(info, client, 0, store.FINISHED)
    child(info, client, 1, store.FAILED, error="precision=tf32 needs a CUDA GPU")
    child(info, client, 2, store.KILLED)
    result = sweep.conclude(info, interrupted=False)
    assert result.status == store.FAILED
    assert result.describe_failures() == [
        "#1 job-1 (FAILED)",  # its error was printed when it failed
        "#2 job-2 (KILLED)",
    ]
    tags = client.get_run(info.parent_run_id).data.tags
    assert (tags["jobs_failed"], tags["jobs_killed"]) == ("1", "1")


def test_an_interrupted_sweep_is_killed_whatever_its_jobs_did(begun):
    info, client = begun
    for num in range(3):
        child(info, client, num, store.FINISHED)
    result = sweep.conclude(info, interrupted=True)
    sweep.end(info, result)
    assert client.get_run(info.parent_run_id).info.status == store.KILLED


def test_a_relaunch_counts_the_jobs_it_skipped(begun):
    info, client = begun
    twin = child(info, client, 0, store.FINISHED)  # stands for job 0 of this launch
    sweep.record_skip(info, 0, twin)
    child(info, client, 1, store.FINISHED)
    child(info, client, 2, store.FINISHED)
    result = sweep.conclude(info, interrupted=False)
    assert result.missing == 0 and result.status == store.FINISHED
    parent = client.get_run(info.parent_run_id)
    assert store.skipped_jobs(parent) == {"0": twin}
    assert parent.data.tags["jobs_skipped"] == "1"


def test_a_sweep_whose_launcher_died_is_ended_by_the_next_launch(store_uri):
    client = store.client_for(store_uri)
    exp = client.create_experiment("orphans")
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = gone.stdout.strip()  # that process has exited

    def parent(host: str, pid: str) -> str:
        tags = {store.SWEEP: "true", store.LAUNCHER_HOST: host, store.LAUNCHER_PID: pid}
        return client.create_run(exp, tags=tags).info.run_id

    orphan = parent(socket.gethostname(), dead_pid)
    alive = parent(socket.gethostname(), str(os.getpid()))
    elsewhere = parent("another-host", dead_pid)
    assert sweep.end_orphaned_sweeps(client, exp) == [orphan]
    assert client.get_run(orphan).info.status == "KILLED"
    assert "ended_by" in client.get_run(orphan).data.tags
    assert client.get_run(alive).info.status == "RUNNING"  # its launcher is still running
    assert client.get_run(elsewhere).info.status == "RUNNING"  # not ours to judge
