"""The throwaway SLURM cluster (scripts/slurm_cluster.py) schedules, launches, cancels and
requeues real jobs. There is no slurmdbd (so no sacct): jobs are followed with
``scontrol show job``, which keeps finished jobs for MinJobAge (300 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_fixture import slurm_cluster, wait_for, wait_state  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def _sbatch(cluster, cwd: Path, *args: str) -> str:
    out = cluster.run("sbatch", "--parsable", f"--chdir={cwd}", "-o", "slurm-%j.out", *args)
    return out.strip().split(";")[0]


def _alive(pid: int) -> bool:
    # The daemons fork away from us and are reaped by init, perhaps a little later: a zombie
    # holds no port, file or lock, so it counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_sinfo_shows_one_idle_node_in_the_debug_partition(slurm_cluster):  # noqa: F811
    def node():
        lines = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N|%t|%c|%P").split()
        return lines if len(lines) == 1 and lines[0].split("|")[1] == "idle" else None

    name, state, cpus, partition = wait_for("one idle node", node)[0].split("|")
    assert int(cpus) == slurm_cluster.cpus == os.cpu_count()
    assert partition == f"{slurm_cluster.partition}*"  # '*': the default partition


def test_batch_job_writes_a_file_and_completes(slurm_cluster, tmp_path):  # noqa: F811
    job = _sbatch(slurm_cluster, tmp_path, "--wrap", "echo done-$SLURM_JOB_ID > out.txt")
    info = wait_state(slurm_cluster, job, "COMPLETED")
    assert info["ExitCode"] == "0:0"
    assert (tmp_path / "out.txt").read_text().strip() == f"done-{job}"
    # No slurmdbd: only the job-completion log answers sacct, and only with --completion.
    sacct = ["sacct", "--completion", "-n", "--parsable2", "-o", "JobID,State", "-j", job]
    wait_for("sacct --completion", lambda: f"{job}|COMPLETED" in slurm_cluster.run(*sacct))


def test_srun_launches_two_tasks_with_ranks_0_and_1(slurm_cluster, tmp_path):  # noqa: F811
    job = _sbatch(
        slurm_cluster,
        tmp_path,
        "--ntasks=2",
        "--wrap",
        "srun bash -c 'echo $SLURM_NTASKS > rank-$SLURM_PROCID.txt'",
    )
    wait_state(slurm_cluster, job, "COMPLETED")
    ranks = sorted(p.name for p in tmp_path.glob("rank-*.txt"))
    assert ranks == ["rank-0.txt", "rank-1.txt"]
    assert all(p.read_text().strip() == "2" for p in tmp_path.glob("rank-*.txt"))


def test_scancel_ends_a_running_job_as_cancelled(slurm_cluster, tmp_path):  # noqa: F811
    job = _sbatch(slurm_cluster, tmp_path, "--wrap", "touch started; sleep 300")
    wait_state(slurm_cluster, job, "RUNNING")
    wait_for("the batch script to start", lambda: (tmp_path / "started").exists())
    slurm_cluster.run("scancel", job)
    wait_state(slurm_cluster, job, "CANCELLED")


REQUEUE_SCRIPT = """#!/bin/bash
echo "${SLURM_RESTART_COUNT:-0}" >> runs.txt
if [ "${SLURM_RESTART_COUNT:-0}" -ge 1 ]; then exit 0; fi
# What a preemptible trainer does: on the warning signal, save and ask to run again.
trap 'echo requeue >> runs.txt; kill $sleeper; scontrol requeue $SLURM_JOB_ID; exit 0' USR1
sleep 300 & sleeper=$!
wait $sleeper
"""


def test_usr1_trap_requeues_the_job_and_it_runs_again(slurm_cluster, tmp_path):  # noqa: F811
    script = tmp_path / "job.sh"
    script.write_text(REQUEUE_SCRIPT)
    job = _sbatch(slurm_cluster, tmp_path, str(script))
    runs = tmp_path / "runs.txt"
    wait_for("the first run to start", lambda: runs.exists())
    # --batch: signal only the batch shell (like --signal=B:USR1@N does before a time limit).
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job)
    # A requeued job is held for cred_expire (5 s in this cluster's config) before restarting.
    info = wait_state(slurm_cluster, job, "COMPLETED", timeout=45)
    assert runs.read_text().split() == ["0", "requeue", "1"]
    assert info["Restarts"] == "1"


def test_cli_runs_a_second_cluster_beside_the_first_and_stops_it_cleanly(
    slurm_cluster,  # noqa: F811
    tmp_path,
):
    """Separate folders and free ports let clusters coexist; stop leaves no daemon behind."""
    cli = [sys.executable, str(Path(__file__).parents[2] / "scripts" / "slurm_cluster.py")]
    folder = tmp_path / "second"
    started = subprocess.run(
        [*cli, "start", str(folder)], capture_output=True, text=True, timeout=90
    )
    try:
        assert started.returncode == 0, started.stderr
        assert started.stdout.strip() == f"export SLURM_CONF={folder / 'slurm.conf'}"
        status = subprocess.run(
            [*cli, "status", str(folder)], capture_output=True, text=True, timeout=30
        ).stdout
        assert "slurmd: running" in status and "idle" in status
        pids = [int(p.read_text()) for p in (folder / "run").glob("*.pid")]
        assert len(pids) == 3  # munged, slurmctld, slurmd
    finally:
        subprocess.run([*cli, "stop", str(folder)], capture_output=True, timeout=60)
    assert not [p for p in pids if _alive(p)]
    assert slurm_cluster.run("sinfo", "-h", "-o", "%t").strip() == "idle"  # first one unhurt
