"""How a job's run ends: FINISHED with its model (``_finish``), FAILED with a one-line error,
KILLED by a signal or for SLURM's requeue; and, while the MLflow store is down, where the
run's records wait (its journal) and whether training stops for it.

And what a run records of where its first non-finite value began (``record_origin``,
``say_origin``: measuring it is ``measure.numerics``; comparing runs is ``report.numerics``).

A ``Job`` (``runner.job``) asks its ``RunEnd``, which reads the job's ``JobState``
(``runner.context``).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from ampsweep import console
from ampsweep.config.schema import Config, ConfigError, OnStoreFailure
from ampsweep.measure import names
from ampsweep.runner.context import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_KILLED,
    JobContext,
    JobOutcome,
    JobState,
)
from ampsweep.tracking import store


class RunEnd:
    """Ends a job's run, whichever way it ends, and says what the console must know."""

    def __init__(self, job: JobState):
        self.job = job

    def stopped(self, err: KeyboardInterrupt) -> JobOutcome:
        """The run ends KILLED: interrupted, or (when SLURM is about to stop the job) until
        the requeued job resumes it from the checkpoint it just wrote."""
        job = self.job
        why = f"interrupted ({err or 'KeyboardInterrupt'})"
        code = EXIT_KILLED
        if job.store_failed:
            why = (
                f"stopped, the MLflow store failed ({job.store_failed}): {err}; resume "
                "with trainer.resume=auto"
            )
            code = EXIT_FAILED
        if job.stop.requeue:
            why = f"stopped for SLURM's requeue signal ({err}): requeued, resumes from there"
        with job.stop.deferred():  # one more signal must not leave the run RUNNING
            job.recorder.end(store.KILLED, error=why)
        outcome = JobOutcome(job.name, store.KILLED, job.recorder.run_id, error=why, exit_code=code)
        outcome.training_began = job.checkpoints is not None  # what the console says next
        last = getattr(job.checkpoints, "last", None)
        outcome.checkpoint = str(last) if last else None
        return self.say_unsent(outcome)

    def requeue(self, outcome: JobOutcome) -> JobOutcome:
        """Give the job back to submitit, which requeues it and exits this process. If it
        will not requeue, the run stays KILLED and says why (a relaunch resumes it)."""
        job = self.job
        refusal = job.stop.hand_over()
        outcome.error = f"not requeued: {refusal}"
        console.error(f"{job.name}: {outcome.error}")
        if job.recorder.run_id is not None:
            job.recorder.client.set_tag(job.recorder.run_id, store.ERROR, outcome.error)
        return outcome

    def finish(self, recorder, model, step: int, cfg: Config, outcome: JobOutcome) -> None:
        """Log the model (linked to the final metrics; registered if asked) and end the run
        FINISHED; if any of it fails, the run ends FAILED and the outcome says so."""
        register = cfg.tracking.register_model
        try:
            if model is not None:
                tags = {
                    store.PRECISION: cfg.precision.name,
                    store.MODEL: cfg.model.name,
                    store.DATASET: cfg.dataset.name,
                }
                model_id = recorder.log_model(model, step, tags=tags)
                if register:
                    version = recorder.register_model(model_id, register)
                    console.console.print(
                        f"{outcome.name}: model registered as {register} version {version} "
                        f"(models:/{register}/{version})"
                    )
            recorder.end(store.FINISHED)
            self.say_unsent(outcome)
        except Exception as err:
            message = f"could not record the trained model: {store.one_line(err)}"
            console.error(f"{outcome.name}: {message}")
            with contextlib.suppress(Exception):
                recorder.end(store.FAILED, error=message)
            outcome.status, outcome.error, outcome.exit_code = store.FAILED, message, EXIT_FAILED

    def failed(self, err: Exception) -> JobOutcome:
        job = self.job
        err = (store.fault(err, job.uri) if job.uri else None) or err  # a store's one line
        message = store.one_line(err)
        # Under DDP every rank refuses a config alike: rank 0 says it once. Other failures
        # (a crash on one rank) are said by the rank that had them.
        if job.rank.is_main or not isinstance(err, ConfigError):
            console.error(f"{job.name}: {message}" if job.ctx.job_num is not None else message)
        if job.recorder.run_id is not None:
            # Deferred: when one DDP rank dies, the elastic agent sends SIGTERM to the others
            # just as their collective fails; it must not cut short the run's FAILED end.
            try:
                with job.stop.deferred():
                    job.recorder.set_tags(getattr(err, "tags", {}))  # e.g. diverged=true
                    if job.setup is not None:  # where the failure's first NaN began
                        record_origin(job.recorder, job.setup, failed=True)
                    job.recorder.end(store.FAILED, error=message)
                self.say_unsent(JobOutcome(job.name, store.FAILED))
            except Exception as end_err:  # the store itself failed: say so, once
                console.error(f"could not record the failure in MLflow: {store.one_line(end_err)}")
        code = EXIT_CONFIG if isinstance(err, ConfigError) else EXIT_FAILED
        if job.recorder.run_id is None and job.ctx.job_num is None:
            _drop_unused_run_dir(job.ctx)  # a refused command leaves nothing behind
        return JobOutcome(
            job.name, store.FAILED, job.recorder.run_id, error=message, exit_code=code
        )

    def store_down(self, policy: OnStoreFailure, why: str) -> None:
        job = self.job
        kept = f"its records wait in {job.recorder.journal.path}"
        if policy == OnStoreFailure.stop:
            job.store_failed = why
            job.stop.requested = True  # the loop checkpoints at the next step and stops
            console.error(
                f"{job.name}: {why}; {kept}; stopping after this step, with a "
                "checkpoint (tracking.on_store_failure=stop)"
            )
            return
        console.error(
            f"{job.name}: {why}; training goes on, {kept} until it answers "
            "(tracking.on_store_failure=stop stops instead)"
        )

    def say_unsent(self, outcome: JobOutcome) -> JobOutcome:
        """After the run's end: if the store is still down, say where its records wait."""
        job = self.job
        if job.recorder.unsent:
            console.error(
                f"{job.name}: the MLflow store {store.describe(job.uri)} is still down: "
                f"{job.recorder.unsent} records of run {job.recorder.run_id} (its end "
                f"included) wait in {job.recorder.journal.path}; `ampsweep repair` writes them "
                "once it answers"
            )
            outcome.status, outcome.exit_code = store.FAILED, outcome.exit_code or EXIT_FAILED
            outcome.error = outcome.error or "the MLflow store is down: its records wait"
        return outcome


def _drop_unused_run_dir(ctx: JobContext) -> None:
    """Remove the run folder Hydra made for a job that was refused before it ran (it holds
    only Hydra's .hydra/ record of the refused command)."""
    folder = ctx.output_dir
    if folder and folder.is_dir() and {p.name for p in folder.iterdir()} <= {".hydra"}:
        shutil.rmtree(folder, ignore_errors=True)
        if not any(folder.parent.iterdir()):  # the day's folder, if this was its only run
            folder.parent.rmdir()


def record_origin(recorder, setup, failed: bool = False) -> None:
    """Where the run's first non-finite value began: tags, an artifact (and the count of
    non-finite steps for a failed run, whose summary is never logged)."""
    lost = next((c.shares for c in setup.callbacks if getattr(c, "shares", None)), None)
    if lost and recorder.run_id is not None:  # a pure run's own rounding losses
        worst = sorted(((k, v) for k, v in lost.items() if k != "(all)"), key=lambda x: -x[1])
        recorder.set_tags({names.UPDATE_LOST_LAYERS: names.pairs(worst[:8], ".2f")})
    origin = setup.locator.origin
    if origin is None or recorder.run_id is None:
        return
    recorder.set_tags(origin.tags())
    if failed:
        count = float(setup.locator.nonfinite_steps)
        recorder.log_metrics({names.NONFINITE_STEPS: count}, origin.step)
    with tempfile.TemporaryDirectory() as tmp:
        recorder.log_artifact(origin.write(Path(tmp)), "numerics")


def say_origin(name: str, setup) -> None:
    """Say where the run's first non-finite value began, and the fix if there is one."""
    origin = setup.locator.origin
    if origin is None:
        return
    fix = origin.fix()
    console.note(
        f"{name}: {setup.locator.nonfinite_steps} non-finite step(s); "
        f"{origin.sentence()}" + (f"; fix: {fix}" if fix else "")
    )
