"""A sweep in the store: one MLflow parent run with a child run per job.

``begin`` creates the parent run when a multirun starts; ``SweepInfo`` (its id, the store, the
sweep dir, the expected run names) travels to every job: in the task function's context for
jobs in the launching process, and as a small JSON file in the sweep dir for launchers whose
jobs run elsewhere but see the same file system (SLURM, submitit_local). ``conclude`` ends the
parent from its children's statuses. Printing and logging the report is the app's business.
"""

from __future__ import annotations

import json
import os
import socket
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ampsweep.config.schema import TrackingConfig
from ampsweep.tracking import store
from ampsweep.tracking.secrets import mask_values

SWEEP_FILE = "ampsweep_sweep.json"


@dataclass
class SweepInfo:
    parent_run_id: str
    uri: str
    experiment: str
    sweep_dir: str
    name: str
    name_counts: dict[str, int] = field(default_factory=dict)  # how often each run name occurs
    expected_jobs: int | None = None

    def run_name(self, resolved: str, job_num: int | None) -> str:
        """``<precision>-<model>-<dataset>``, plus the job number when names repeat."""
        if job_num is not None and self.name_counts.get(resolved, 1) > 1:
            return f"{resolved}-{job_num}"
        return resolved

    def dump(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def load(cls, text: str) -> SweepInfo:
        return cls(**json.loads(text))

    @classmethod
    def from_sweep_dir(cls, sweep_dir: Path) -> SweepInfo | None:
        path = sweep_dir / SWEEP_FILE
        return cls.load(path.read_text()) if path.is_file() else None


def begin(
    uri: str,
    tracking: TrackingConfig,
    sweep_dir: Path,
    name: str,
    command: str,
    expected_jobs: int,
    run_names: list[str],
) -> SweepInfo:
    """Create the sweep's parent run and write its SweepInfo into the sweep dir.
    ``run_names``: the default names the jobs will get (to number the ones that repeat)."""
    client = store.client_for(uri)
    exp_id = store.experiment_for(client, uri, tracking)
    end_orphaned_sweeps(client, exp_id)
    tags = {
        store.SWEEP: "true",
        store.SWEEP_DIR: str(sweep_dir),
        store.COMMAND: command,
        store.JOBS_EXPECTED: str(expected_jobs),
        # who launched it: a later launch can tell a sweep whose process is gone
        store.LAUNCHER_HOST: socket.gethostname(),
        store.LAUNCHER_PID: str(os.getpid()),
    }
    run = client.create_run(exp_id, run_name=name, tags=mask_values(tags))
    info = SweepInfo(
        parent_run_id=run.info.run_id,
        uri=uri,
        experiment=tracking.experiment,
        sweep_dir=str(sweep_dir),
        name=name,
        name_counts=dict(Counter(run_names)),
        expected_jobs=expected_jobs,
    )
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / SWEEP_FILE).write_text(info.dump())
    return info


def grow(info: SweepInfo, run_names: list[str], jobs: int) -> None:
    """More jobs than the first batch (a search's later trials): expected, and their names
    counted (a repeated name gets its job number), on the parent and in the sweep dir."""
    info.expected_jobs = (info.expected_jobs or 0) + jobs
    for name, n in Counter(run_names).items():
        info.name_counts[name] = info.name_counts.get(name, 0) + n
    client = store.client_for(info.uri)
    client.set_tag(info.parent_run_id, store.JOBS_EXPECTED, str(info.expected_jobs))
    (Path(info.sweep_dir) / SWEEP_FILE).write_text(info.dump())


def end_orphaned_sweeps(client, experiment_id: str) -> list[str]:
    """End the RUNNING sweep parents whose launching process is gone (SIGKILL, a lost node),
    and their RUNNING children whose training process is gone too: nothing else will ever end
    them. Only runs of this host are judged, by their recorded pid; a child still training
    (a cluster job that outlived its launcher) is left alone. A relaunch resumes an ended
    child from its checkpoint (the run becomes RUNNING again)."""
    ended = []
    for parent in store.sweeps(client, [experiment_id], status=store.RUNNING):
        if not _gone(parent.data.tags, store.LAUNCHER_HOST, store.LAUNCHER_PID):
            continue
        why = "a later launch: its launching process was gone"
        for child in store.running_children(client, parent):
            if _gone(child.data.tags, store.HOST, store.PID):
                _end_killed(client, child.info.run_id, why)
                ended.append(child.info.run_id)
        _end_killed(client, parent.info.run_id, why)
        ended.append(parent.info.run_id)
    return ended


def _gone(tags: dict[str, str], host_tag: str, pid_tag: str) -> bool:
    """Whether the process a run records (host and pid) ran here and no longer exists."""
    pid = tags.get(pid_tag, "")
    return tags.get(host_tag) == socket.gethostname() and pid.isdigit() and not alive(int(pid))


def _end_killed(client, run_id: str, why: str) -> None:
    client.set_tag(run_id, store.ENDED_BY, why)
    client.set_terminated(run_id, status=store.KILLED)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def end_lost_job(info: SweepInfo, job_id: str, status: str, why: str):
    """A cluster job of the sweep ended without a result (cancelled, killed, its node lost):
    end its run with ``status`` if it is still RUNNING (a job killed before it could end the
    run itself), tagging why and who ended it. Returns the run (None: the job recorded none)."""
    client = store.client_for(info.uri)
    run = store.run_of_cluster_job(client, client.get_run(info.parent_run_id), job_id)
    if run is None or run.info.status != store.RUNNING:
        return run
    tags = {store.ERROR: why, store.ENDED_BY: "the sweep's launcher"}
    store.set_tags(client, run.info.run_id, tags.items())
    client.set_terminated(run.info.run_id, status=status)
    return client.get_run(run.info.run_id)


def record_skip(info: SweepInfo, job_num: int | None, run_id: str) -> None:
    """A job skipped because its identical config already FINISHED: the parent of this launch
    names the run that stands in for it (the run itself stays under the sweep that made it)."""
    client = store.client_for(info.uri)
    client.set_tag(info.parent_run_id, f"{store.SKIPPED_PREFIX}{job_num}", run_id)


@dataclass
class SweepResult:
    """How a sweep ended, read back from its child runs in the store."""

    status: str
    runs: list  # the child runs (mlflow Run objects), oldest first
    missing: int = 0  # jobs expected but never recorded (e.g. a worker process died)
    skipped: int = 0  # jobs a relaunch skipped: an identical config had FINISHED before
    report_missing: str | None = None  # why the report is not on the parent (a signal)

    @property
    def failed(self) -> list:
        return [r for r in self.runs if r.info.status != store.FINISHED]

    def describe_failures(self) -> list[str]:
        """``#<job> <run name> (<status>)`` per child that did not finish (its error was
        printed when it failed, and the report names it again)."""
        return [
            f"#{r.data.tags.get(store.JOB_NUM, '?')} {r.info.run_name} ({r.info.status})"
            for r in self.failed
        ]


def conclude(info: SweepInfo, interrupted: bool) -> SweepResult:
    """Tag the parent with its jobs' counts and decide its status (FINISHED only when every
    expected job finished). The parent stays RUNNING until ``end``: the report is logged to
    it in between."""
    client = store.client_for(info.uri)
    parent = client.get_run(info.parent_run_id)
    runs = store.children(client, parent)
    counts = Counter(r.info.status for r in runs)
    n_skipped = len(store.skipped_jobs(parent))  # a relaunch skips jobs that FINISHED
    missing = max(0, (info.expected_jobs or len(runs) + n_skipped) - len(runs) - n_skipped)
    if interrupted:
        status = store.KILLED
    elif missing or any(r.info.status != store.FINISHED for r in runs):
        status = store.FAILED
    else:
        status = store.FINISHED
    tags = {
        "jobs_total": len(runs) + n_skipped,
        "jobs_skipped": n_skipped,
        "jobs_finished": counts.get(store.FINISHED, 0),
        "jobs_failed": counts.get(store.FAILED, 0),
        "jobs_killed": counts.get(store.KILLED, 0),
    }
    if missing:
        tags["jobs_missing"] = missing
    store.set_tags(client, info.parent_run_id, tags.items())
    return SweepResult(status, runs, missing, n_skipped)


def end(info: SweepInfo, result: SweepResult) -> None:
    """End the parent: KILLED with the reason when its report is missing, else as decided."""
    client = store.client_for(info.uri)
    status = result.status
    if result.report_missing:
        client.set_tag(info.parent_run_id, store.REPORT_MISSING, result.report_missing)
        status = store.KILLED
    client.set_terminated(info.parent_run_id, status=status)


def report_written(client, parent) -> bool:
    """The report of a sweep whose report was missing is now on its parent: the tag goes and
    the parent ends as its jobs decided (their counts are its tags). False: none was missing."""
    tags = parent.data.tags
    if store.REPORT_MISSING not in tags:
        return False
    client.delete_tag(parent.info.run_id, store.REPORT_MISSING)
    unfinished = ("jobs_failed", "jobs_killed", "jobs_missing")
    failed = any(tags.get(k, "0") != "0" for k in unfinished)
    client.set_terminated(parent.info.run_id, status=store.FAILED if failed else store.FINISHED)
    return True
