"""A Hydra multirun as one MLflow parent run with a child run per job.

The parent run is created by a Hydra callback when the multirun starts, in the launching
process. Its id reaches the jobs two ways: an environment variable (jobs in this process, and
launchers that start processes with this environment) and a small JSON file in the sweep dir
(launchers whose jobs run elsewhere but see the same file system, such as SLURM). The
parent is ended by ``finish`` (from the callback's end hook, and again from the launching
``ampsweep train -m`` whatever happened to the jobs, so it is never left RUNNING), which first
prints the comparison report and logs it to the parent (``report.publish``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from hydra.experimental.callback import Callback

from ampsweep import tracking

SWEEP_FILE = "ampsweep_sweep.json"
ENV_SWEEP = "AMPSWEEP_SWEEP"  # the JSON of SweepInfo
ENV_NAME_COUNTS = "AMPSWEEP_NAME_COUNTS"  # set by the CLI: how often each run name occurs


@dataclass
class SweepInfo:
    parent_run_id: str
    uri: str
    experiment: str
    sweep_dir: str
    name: str
    name_counts: dict[str, int] = field(default_factory=dict)
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


# The sweep this process launched (set by the callback, ended by the CLI).
ACTIVE: SweepInfo | None = None


def command_line() -> str:
    """The command that launched the sweep, quoted so it can be pasted back."""
    import shlex

    # `ampsweep train` hands Hydra its arguments under this program name (cli.run_hydra).
    head = ["ampsweep", "train"] if sys.argv[0] == "ampsweep-train" else [sys.argv[0]]
    return shlex.join([*head, *sys.argv[1:]])


def name_counts(names: list[str]) -> None:
    os.environ[ENV_NAME_COUNTS] = json.dumps(Counter(names))


class SweepCallback(Callback):
    """Creates the sweep's parent run when a multirun starts and ends it when it ends.

    Hydra skips ``on_multirun_end`` when a launcher raises; ``ampsweep train`` therefore also
    calls ``finish`` in a ``finally`` clause (``finish`` acts once).
    """

    def on_multirun_end(self, config, **kwargs) -> None:
        if ACTIVE is not None:
            finish(ACTIVE)

    def on_multirun_start(self, config, **kwargs) -> None:
        global ACTIVE
        from omegaconf import OmegaConf

        # A structured config hands back the Enum member, not its spelling.
        backend = config.tracking.backend
        if getattr(backend, "name", backend) != "mlflow":
            return
        uri = tracking.resolve_uri(config.tracking.uri)
        tracking.check_store(uri)
        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        choices = OmegaConf.select(config, "hydra.runtime.choices", default={}) or {}
        label = choices.get("experiment") or "sweep"
        name = f"{label}-{datetime.now():%Y%m%d-%H%M%S}"
        client = tracking.client_for(uri)
        exp_id = tracking.experiment_for(client, uri, config.tracking)
        end_orphaned_sweeps(client, exp_id)
        counts = json.loads(os.environ.get(ENV_NAME_COUNTS, "{}"))
        run = client.create_run(
            exp_id,
            run_name=name,
            tags=tracking.mask_secrets(
                {
                    "ampsweep.sweep": "true",
                    "sweep_dir": str(sweep_dir),
                    "command": command_line(),
                    "jobs_expected": str(sum(counts.values()) or ""),
                    # who launched it: a later launch can tell a sweep whose process is gone
                    LAUNCHER_HOST: socket.gethostname(),
                    LAUNCHER_PID: str(os.getpid()),
                }
            ),
        )
        info = SweepInfo(
            parent_run_id=run.info.run_id,
            uri=uri,
            experiment=config.tracking.experiment,
            sweep_dir=str(sweep_dir),
            name=name,
            name_counts=counts,
            expected_jobs=sum(counts.values()) or None,
        )
        (sweep_dir / SWEEP_FILE).write_text(info.dump())
        os.environ[ENV_SWEEP] = info.dump()
        ACTIVE = info


LAUNCHER_HOST, LAUNCHER_PID = "launcher_host", "launcher_pid"


def end_orphaned_sweeps(client, experiment_id: str) -> list[str]:
    """End the RUNNING sweep parents whose launching process is gone (SIGKILL, a lost node):
    nothing else will ever end them. Only parents launched on this host are judged, by their
    recorded pid; their interrupted children stay as they are, for a relaunch to resume."""
    host = socket.gethostname()
    runs = client.search_runs(
        [experiment_id],
        filter_string="tags.`ampsweep.sweep` = 'true' and attributes.status = 'RUNNING'",
        max_results=1000,
    )
    ended = []
    for run in runs:
        tags = run.data.tags
        if tags.get(LAUNCHER_HOST) != host or not tags.get(LAUNCHER_PID, "").isdigit():
            continue
        if _alive(int(tags[LAUNCHER_PID])):
            continue
        client.set_tag(
            run.info.run_id, "ended_by", "a later launch: its launching process was gone"
        )
        client.set_terminated(run.info.run_id, status=tracking.KILLED)
        ended.append(run.info.run_id)
    return ended


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def job_sweep_info(ctx) -> SweepInfo | None:
    """The sweep a job belongs to: from the environment, else the sweep dir's file."""
    if ctx.sweep_dir is None:
        return None
    text = os.environ.get(ENV_SWEEP)
    if text:
        info = SweepInfo.load(text)
        if Path(info.sweep_dir) == ctx.sweep_dir:
            return info
    path = ctx.sweep_dir / SWEEP_FILE
    return SweepInfo.load(path.read_text()) if path.is_file() else None


SKIPPED_PREFIX = "skipped."  # parent tag skipped.<job num> = the FINISHED run standing in


def record_skip(info: SweepInfo, job_num: int | None, run_id: str) -> None:
    """A job skipped because its identical config already FINISHED: the parent of this launch
    names the run that stands in for it (the run itself stays under the sweep that made it)."""
    client = tracking.client_for(info.uri)
    client.set_tag(info.parent_run_id, f"{SKIPPED_PREFIX}{job_num}", run_id)


def skipped(info: SweepInfo) -> dict[str, str]:
    client = tracking.client_for(info.uri)
    tags = client.get_run(info.parent_run_id).data.tags
    return {k[len(SKIPPED_PREFIX) :]: v for k, v in tags.items() if k.startswith(SKIPPED_PREFIX)}


def children(info: SweepInfo) -> list:
    client = tracking.client_for(info.uri)
    exp = client.get_experiment_by_name(info.experiment)
    if exp is None:
        return []
    return client.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.`{tracking.PARENT_TAG}` = '{info.parent_run_id}'",
        max_results=10000,
        order_by=["attributes.start_time ASC"],
    )


@dataclass
class SweepResult:
    """How a sweep ended, read back from its child runs in the store."""

    status: str
    runs: list  # the child runs (mlflow Run objects), oldest first
    missing: int = 0  # jobs expected but never recorded (e.g. a worker process died)

    @property
    def failed(self) -> list:
        return [r for r in self.runs if r.info.status != tracking.FINISHED]

    def describe_failures(self) -> list[str]:
        """``#<job> <run name> (<error>)`` per child that did not finish."""
        out = []
        for r in self.failed:
            job = r.data.tags.get("job_num", "?")
            why = r.data.tags.get("error") or r.info.status
            out.append(f"#{job} {r.info.run_name} ({why})")
        return out


# Sweeps already ended in this process: the callback's end-of-multirun hook and the CLI's
# finally clause may both call finish, and only the first one acts.
_ENDED: dict[str, SweepResult] = {}


def finish(info: SweepInfo, interrupted: bool = False, report: bool = True) -> SweepResult:
    """End the parent run from its children's statuses (FINISHED only when every expected job
    finished), after printing the sweep report and logging it to the parent. Idempotent."""
    if info.parent_run_id in _ENDED:
        return _ENDED[info.parent_run_id]
    client = tracking.client_for(info.uri)
    runs = children(info)
    counts = Counter(r.info.status for r in runs)
    n_skipped = len(skipped(info))  # a relaunch skips jobs whose identical config FINISHED
    missing = max(0, (info.expected_jobs or len(runs) + n_skipped) - len(runs) - n_skipped)
    if interrupted:
        status = tracking.KILLED
    elif missing or any(r.info.status != tracking.FINISHED for r in runs):
        status = tracking.FAILED
    else:
        status = tracking.FINISHED
    result = SweepResult(status, runs, missing)
    _ENDED[info.parent_run_id] = result
    tags = {
        "jobs_total": len(runs) + n_skipped,
        "jobs_skipped": n_skipped,
        "jobs_finished": counts.get(tracking.FINISHED, 0),
        "jobs_failed": counts.get(tracking.FAILED, 0),
        "jobs_killed": counts.get(tracking.KILLED, 0),
    }
    if missing:
        tags["jobs_missing"] = missing
    try:
        from mlflow.entities import RunTag

        client.log_batch(info.parent_run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        if report and not interrupted and runs:
            _publish_report(client, info)
    finally:  # whatever the report did, the parent is never left RUNNING
        client.set_terminated(info.parent_run_id, status=status)
    return result


def _publish_report(client, info: SweepInfo) -> None:
    """Print the comparison report and log it (files, charts, headline metrics) to the parent.
    A report problem is reported, never allowed to change how the sweep ended."""
    from ampsweep import console, report

    try:
        rep = report.build_report(client, info.parent_run_id)
        console.console.print()
        report.print_table(rep)
        report.publish(client, rep)
        console.console.print(
            f"report logged to the sweep's parent run {info.parent_run_id} "
            f"({info.name}) in {tracking.describe_store(info.uri)}"
        )
    except Exception as err:
        console.error(f"could not write the sweep report: {tracking.one_line(err)}")
