"""Submitting a sweep's jobs to SLURM and waiting for all of them, whatever happens to each.

Hydra's submitit launcher submits the jobs as one job array, then waits for each result in
turn with ``job.results()``. That wait needs ``sacct`` to notice a job that ended without a
result (cancelled, killed at its time limit, its node lost): without accounting it waits
forever, and with it the first such job raises, so the launcher stops waiting for the others
while they still run. Here every job is waited for: its result file when it returns, and
``squeue`` for a job that ends without one. Such a job's MLflow run, if it was left RUNNING,
is ended (KILLED when SLURM cancelled the job, else FAILED) with the reason, and the job comes
back to Hydra as a JobReturn whose value is a JobOutcome saying so (as one that raised outside
its task function does): the sweep goes on, and the command names the job. A job that returned
comes back as the JobReturn it wrote. The launcher runs any Hydra app: there, a job that ended
without a result or raised outside its task function comes back FAILED with its error, which
Hydra's sweeper raises, as with Hydra's own launcher. A requeued job (preempted, or signalled
before its time limit) is simply still running: the same job id starts again and resumes its
run from its checkpoint. A time limit within the requeue signal's warning is refused before
anything is submitted, for any app.

Ctrl-C (or SIGTERM) while waiting cancels the sweep's jobs that are still queued or running;
each ends its run KILLED at its next step boundary, after a checkpoint, so a relaunch resumes.
"""

from __future__ import annotations

import contextlib
import io
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ampsweep import console
from ampsweep.errors import ConfigError
from ampsweep.launch import slurm
from ampsweep.runner.context import EXIT_CONFIG, EXIT_FAILED, EXIT_KILLED, JobOutcome
from ampsweep.tracking import store
from ampsweep.tracking.sweep import SweepInfo, end_lost_job

POLL_S = 1.0  # result files: one stat per job
QUERY_FIRST_S, QUERY_MAX_S = 2.0, 30.0  # squeue: soon after submitting, then less often
# A job SLURM calls ended may still be writing its result where a shared file system shows
# it late (submitit itself allows 15 s); only after this long without one is it lost.
RESULT_GRACE_S = 10.0
CANCEL_WAIT_S = 60.0  # after Ctrl-C: how long to wait for cancelled jobs to end their runs
KILLED_STATES = {"CANCELLED", "PREEMPTED", "DEADLINE", "TIMEOUT"}
# submitit's executor for SLURM: AutoExecutor(cluster=...) and its parameters' prefix
CLUSTER = "slurm"


class JobLost(RuntimeError):
    """Another Hydra app's SLURM job ended without a result (its sweeper raises this)."""


@dataclass
class Tracked:
    """One submitted job of the sweep and what is known of it."""

    job_num: int
    overrides: list[str]
    job: Any  # a submitit Job (with one sub-job per task under DDP)
    # ampsweep's task function takes a JobOutcome for a job that ended without a result;
    # another app's gets the job's error back, as from Hydra's own launcher
    ampsweep_job: bool = True
    state: str = "PENDING"
    starts: int = 0  # times SLURM was seen running it (a requeued job runs again)
    ended_since: float | None = None
    outcome: JobOutcome | None = None  # how an ampsweep job ended (None: another app's job)
    returned: Any = None  # the JobReturn, once known: the job is done

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    @property
    def rank0(self):
        # Rank 0 records the run; the other ranks' results say nothing more.
        return self.job.task(0)

    @property
    def log(self) -> Path:
        return Path(self.rank0.paths.stderr)

    @property
    def label(self) -> str:
        return f"#{self.job_num} (SLURM job {self.job_id})"


def launch(launcher, job_overrides, initial_job_idx: int) -> list:
    """What Hydra's ``Launcher.launch`` returns: a JobReturn per job, in order."""
    from hydra.core.singleton import Singleton
    from hydra.core.utils import filter_overrides

    from ampsweep.runner.job import TaskFunction

    _check_time_limit(launcher.params)
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if "mode" in launcher.config.hydra.sweep:  # hydra.sweep.mode, as Hydra's launcher honours it
        sweep_dir.chmod(int(str(launcher.config.hydra.sweep.mode), 8))
    executor = _executor(launcher)
    params = []
    for idx, overrides in enumerate(job_overrides):
        num = initial_job_idx + idx
        params.append(
            (list(overrides), "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state())
        )
    jobs = _submit(executor, launcher, params)
    ours = isinstance(launcher.task_function, TaskFunction)
    tracked = [
        Tracked(num, list(overrides), job, ampsweep_job=ours)
        for (overrides, _, num, _, _), job in zip(params, jobs, strict=True)
    ]
    first = tracked[0].job_id.split("_")[0]
    console.console.print(
        f"submitted {len(tracked)} SLURM job(s) ({first}"
        + (f"_0..{len(tracked) - 1}" if len(tracked) > 1 else "")
        + f"); their logs: {sweep_dir / '.submitit'}/<job id>/"
    )
    for t in tracked:
        shown = " ".join(filter_overrides(t.overrides))
        console.console.print(f"  #{t.job_num} {t.job_id}: {shown}")
    sweep = SweepInfo.from_sweep_dir(sweep_dir.resolve())
    try:
        wait(tracked, sweep)
    except KeyboardInterrupt:
        cancel_and_settle(tracked, sweep)
        raise
    return [t.returned for t in tracked]


def _check_time_limit(params: dict) -> None:
    """Hydra's submitit launcher submits any time limit. One within the requeue signal's
    warning has each job requeued every time SLURM looks, until it fails: refused here for any
    Hydra app (ampsweep's own sweeps were refused earlier, with the cluster's other checks)."""
    keys = ("timeout_min", "signal_delay_s")
    try:
        slurm.check_timeout(slurm.LauncherSettings(**{k: params[k] for k in keys if k in params}))
    except ConfigError as err:
        console.error(str(err))
        raise SystemExit(EXIT_CONFIG) from None


def _executor(launcher):
    """The submitit executor of Hydra's launcher, made as its ``launch`` makes it."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    name = CLUSTER
    params = dict(launcher.params)
    init = {"folder": params.pop("submitit_folder")}
    if "max_num_timeout" in params:
        init[f"{name}_max_num_timeout"] = params.pop("max_num_timeout")
    executor = submitit.AutoExecutor(cluster=name, **init)
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"{name}_{k}": v for k, v in params.items()})
    return executor


def _submit(executor, launcher, params) -> list:
    from submitit.core.utils import FailedJobError

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):  # submitit prints sbatch's stderr itself
            return executor.map_array(launcher, *zip(*params, strict=True))
    except FailedJobError as failure:
        lines = [ln.strip() for ln in str(failure).splitlines() if ln.strip()]
        console.error(
            f"sbatch refused the sweep's jobs: {lines[-1] if lines else failure}: check "
            "hydra.launcher.partition, account, qos, constraint and additional_parameters"
        )
        raise SystemExit(EXIT_FAILED) from None


def wait(tracked: list[Tracked], sweep: SweepInfo | None, clock=time.monotonic, sleep=time.sleep):
    """Until every job returned or ended without a result."""
    started = clock()
    next_query = started + QUERY_FIRST_S
    while True:
        pending = [t for t in tracked if t.returned is None]
        for t in pending:
            if t.rank0.paths.result_pickle.exists():
                _returned(t)
        pending = [t for t in pending if t.returned is None]
        if not pending:
            return
        now = clock()
        if now >= next_query:
            try:
                states = slurm.job_states([t.job_id for t in pending])
            except slurm.SlurmError as err:  # ask again later; it says nothing about the jobs
                console.error(f"could not ask SLURM about the sweep's jobs ({err}); retrying")
                states = {}
            for t in pending:
                if t.job_id in states:
                    _observe(t, states[t.job_id], now, sweep)
            interval = min(QUERY_MAX_S, max(QUERY_FIRST_S, (now - started) / 10))
            soonest = [t.ended_since + RESULT_GRACE_S for t in pending if t.ended_since]
            next_query = min([now + interval, *soonest])
        sleep(POLL_S)


def _observe(t: Tracked, state: str, now: float, sweep: SweepInfo | None) -> None:
    if state != t.state:
        if state == "RUNNING":
            t.starts += 1
            console.console.print(f"  {t.label}: running" + (" again" if t.starts > 1 else ""))
        elif (
            state in ("PENDING", "REQUEUED") and t.starts and t.state not in ("PENDING", "REQUEUED")
        ):
            console.console.print(f"  {t.label}: requeued, to resume from its checkpoint")
        t.state = state
    ended = state in slurm.ENDED or state == slurm.GONE
    if not ended:
        t.ended_since = None
    elif t.ended_since is None:
        t.ended_since = now
    elif now - t.ended_since >= RESULT_GRACE_S and not t.rank0.paths.result_pickle.exists():
        _lost(t, sweep)


def _returned(t: Tracked) -> None:
    """The job wrote its result: the JobReturn from the job (an ampsweep job's value: its
    JobOutcome), or the error it raised outside its task function."""
    from hydra.core.utils import JobStatus

    try:
        ret = t.rank0.result()
    except Exception as err:  # e.g. its config would not compose on the node
        last = [ln for ln in str(err).splitlines() if ln.strip() and not ln.startswith("-")]
        why = f"SLURM job {t.job_id} failed: {last[-1].strip() if last else type(err).__name__}"
        _settle(t, store.FAILED, why, None, err)
        console.error(f"{t.label}: {why}")
        return
    t.returned = ret
    if ret.status != JobStatus.COMPLETED:  # Hydra's sweeper raises its error, as in-process
        console.console.print(f"  {t.label}: its task function raised")
        return
    value = ret.return_value
    if not isinstance(value, JobOutcome):  # another Hydra app's task function
        console.console.print(f"  {t.label}: returned")
        return
    t.outcome = value
    how = value.status
    if value.skipped:
        how = f"skipped, the identical config FINISHED as run {value.run_id}"
    console.console.print(f"  {t.label}: {value.name} {how}")


def _lost(t: Tracked, sweep: SweepInfo | None) -> None:
    """The job ended without a result: end its run if nothing else did, and say so."""
    if t.state == slurm.GONE:
        how = "is no longer in SLURM's queue and left no result"
    else:
        how = f"ended {t.state} without a result"
    why = f"SLURM job {t.job_id} {how} (log: {t.log})"
    status = store.KILLED if t.state in KILLED_STATES else store.FAILED
    run = None
    if sweep is not None:
        try:
            run = end_lost_job(sweep, t.job_id, status, why)
        except Exception as err:
            console.error(f"could not record how {t.label} ended: {store.one_line(err)}")
    _settle(t, status, why, run)
    console.error(
        f"{t.label} {how}: "
        + (f"its run {run.info.run_id} is {run.info.status}" if run else "it recorded no run")
    )


def _settle(t: Tracked, status: str, why: str, run, error: Exception | None = None) -> None:
    from hydra.core.utils import JobReturn, JobStatus

    if not t.ampsweep_job:  # Hydra's sweeper raises the error when it reads the value
        t.returned = JobReturn(overrides=t.overrides, status=JobStatus.FAILED)
        t.returned.return_value = error or JobLost(why)
        return
    if run is not None:
        status = run.info.status
        why = run.data.tags.get(store.ERROR, why)
    t.outcome = JobOutcome(
        name=run.info.run_name if run is not None else f"job {t.job_num}",
        status=status,
        run_id=run.info.run_id if run is not None else None,
        error=why,
        exit_code=EXIT_KILLED if status == store.KILLED else EXIT_FAILED,
        job_num=t.job_num,
        overrides=t.overrides,
    )
    ret = JobReturn(overrides=t.overrides, status=JobStatus.COMPLETED)
    ret.return_value = t.outcome
    t.returned = ret


def cancel_and_settle(
    tracked: list[Tracked], sweep: SweepInfo | None, timeout: float = CANCEL_WAIT_S
) -> None:
    """Cancel the jobs still queued or running, give them time to end their runs (each
    checkpoints and ends KILLED on SLURM's SIGTERM), and end the runs of those that could not."""
    pending = [t for t in tracked if t.returned is None]
    if not pending:
        return
    console.error(f"interrupted: cancelling SLURM job(s) {', '.join(t.job_id for t in pending)}")
    slurm.cancel([t.job_id for t in pending])
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        try:
            states = slurm.job_states([t.job_id for t in pending])
        except slurm.SlurmError:
            states = {}
        for t in pending:
            t.state = states.get(t.job_id, t.state)
        pending = [t for t in pending if t.state not in slurm.ENDED and t.state != slurm.GONE]
        time.sleep(POLL_S)
    for t in tracked:
        if t.returned is None and sweep is not None:
            with contextlib.suppress(Exception):
                end_lost_job(sweep, t.job_id, store.KILLED, "the sweep was interrupted")


def register() -> None:
    """Make ampsweep's sweeper known to Hydra. (Its launchers Hydra finds itself, by listing
    the folders of the ``hydra_plugins`` namespace, in an editable install as in a wheel's.)"""
    from hydra.core.plugins import Plugins

    # Hydra's first scan for plugins executes its own plugin modules again (BasicSweeper is
    # then a new class), so it must come before ours subclass them: else, where nothing has
    # scanned yet (`train --help` before a sweep in one process), the sweeper cannot start.
    plugins = Plugins.instance()
    from hydra_plugins.ampsweep_launcher import sweeper

    for cls in (sweeper.AmpsweepSweeper, sweeper.AmpsweepLauncher):
        plugins.register(cls)
