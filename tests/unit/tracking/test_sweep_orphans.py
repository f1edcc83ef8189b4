"""tracking/sweep.py: a sweep whose launcher was SIGKILLed is ended by the next launch, with
its children whose training process is gone; a child still training is left alone."""

from __future__ import annotations

import socket
import subprocess
import sys

from ampsweep.tracking import store as mlflow_store
from ampsweep.tracking import sweep


def _dead_pid() -> str:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return str(proc.pid)


def test_orphaned_parent_and_its_dead_children_end_killed(store):
    client = mlflow_store.client_for(store)
    exp = client.create_experiment("orphans")
    host, dead = socket.gethostname(), _dead_pid()
    parent = client.create_run(
        exp,
        run_name="sweep",
        tags={mlflow_store.SWEEP: "true", mlflow_store.LAUNCHER_HOST: host,
              mlflow_store.LAUNCHER_PID: dead},
    )  # fmt: skip
    pid = parent.info.run_id

    def child(name: str, job_pid: str):
        tags = {mlflow_store.PARENT: pid, mlflow_store.HOST: host, mlflow_store.PID: job_pid}
        return client.create_run(exp, run_name=name, tags=tags).info.run_id

    gone, alive = child("gone", dead), child("alive", str(__import__("os").getpid()))
    finished = child("done", dead)
    client.set_terminated(finished, status=mlflow_store.FINISHED)

    ended = sweep.end_orphaned_sweeps(client, exp)
    assert set(ended) == {pid, gone}
    for run_id, status in ((pid, "KILLED"), (gone, "KILLED"), (alive, "RUNNING"),
                           (finished, "FINISHED")):  # fmt: skip
        run = client.get_run(run_id)
        assert run.info.status == status, run.info.run_name
    assert "launching process was gone" in client.get_run(gone).data.tags[mlflow_store.ENDED_BY]
    assert sweep.end_orphaned_sweeps(client, exp) == []  # once ended, left alone
