"""How a job's run ends: FINISHED with its model (``_finish``), FAILED with a one-line error,
KILLED by a signal or for SLURM's requeue; and, while the MLflow store is down, where the
run's records wait (its journal) and whether training stops for it.

``Ending`` is a part of ``Job`` (``runner.job``): its methods use the job's ``name``, ``ctx``,
``rank``, ``stop``, ``recorder``, ``uri``, ``setup`` and ``store_failed``.
"""

from __future__ import annotations

import contextlib
import shutil
from functools import partial

from ampsweep import console
from ampsweep.config.schema import Config, ConfigError, OnStoreFailure
from ampsweep.engine.confighash import folder_for
from ampsweep.runner import numerics
from ampsweep.runner.context import EXIT_CONFIG, EXIT_FAILED, EXIT_KILLED, JobContext, JobOutcome
from ampsweep.tracking import journal, store


class Ending:
    """The methods of a ``Job`` that end its run (mixed into ``runner.job.Job``)."""

    def _stopped(self, err: KeyboardInterrupt) -> JobOutcome:
        """The run ends KILLED: interrupted, or (when SLURM is about to stop the job) until
        the requeued job resumes it from the checkpoint it just wrote."""
        why = f"interrupted ({err or 'KeyboardInterrupt'})"
        code = EXIT_KILLED
        if self.store_failed:
            why = (f"stopped, the MLflow store failed ({self.store_failed}): {err}; resume "
                   "with trainer.resume=auto")  # fmt: skip
            code = EXIT_FAILED
        if self.stop.requeue:
            why = f"stopped for SLURM's requeue signal ({err}): requeued, resumes from there"
        with self.stop.deferred():  # one more signal must not leave the run RUNNING
            self.recorder.end(store.KILLED, error=why)
        outcome = JobOutcome(self.name, store.KILLED, self.recorder.run_id, error=why,
                             exit_code=code)  # fmt: skip
        return self._say_unsent(outcome)

    def _requeue(self, outcome: JobOutcome) -> JobOutcome:
        """Give the job back to submitit, which requeues it and exits this process. If it
        will not requeue, the run stays KILLED and says why (a relaunch resumes it)."""
        refusal = self.stop.hand_over()
        outcome.error = f"not requeued: {refusal}"
        console.error(f"{self.name}: {outcome.error}")
        if self.recorder.run_id is not None:
            self.recorder.client.set_tag(self.recorder.run_id, store.ERROR, outcome.error)
        return outcome

    def _finish(self, recorder, model, step: int, cfg: Config, outcome: JobOutcome) -> None:
        """Log the model (linked to the final metrics; registered if asked) and end the run
        FINISHED; if any of it fails, the run ends FAILED and the outcome says so."""
        register = cfg.tracking.register_model
        try:
            if model is not None:
                tags = {store.PRECISION: cfg.precision.name, store.MODEL: cfg.model.name,
                        store.DATASET: cfg.dataset.name}  # fmt: skip
                model_id = recorder.log_model(model, step, tags=tags)
                if register:
                    version = recorder.register_model(model_id, register)
                    console.console.print(
                        f"{outcome.name}: model registered as {register} version {version} "
                        f"(models:/{register}/{version})"
                    )
            recorder.end(store.FINISHED)
            self._say_unsent(outcome)
        except Exception as err:
            message = f"could not record the trained model: {store.one_line(err)}"
            console.error(f"{outcome.name}: {message}")
            with contextlib.suppress(Exception):
                recorder.end(store.FAILED, error=message)
            outcome.status, outcome.error, outcome.exit_code = store.FAILED, message, EXIT_FAILED

    def _failed(self, err: Exception) -> JobOutcome:
        err = (store.fault(err, self.uri) if self.uri else None) or err  # a store's one line
        message = store.one_line(err)
        # Under DDP every rank refuses a config alike: rank 0 says it once. Other failures
        # (a crash on one rank) are said by the rank that had them.
        if self.rank.is_main or not isinstance(err, ConfigError):
            console.error(f"{self.name}: {message}" if self.ctx.job_num is not None else message)
        if self.recorder.run_id is not None:
            # Deferred: when one DDP rank dies, the elastic agent sends SIGTERM to the others
            # just as their collective fails; it must not cut short the run's FAILED end.
            try:
                with self.stop.deferred():
                    self.recorder.set_tags(getattr(err, "tags", {}))  # e.g. diverged=true
                    if self.setup is not None:  # where the failure's first NaN began
                        numerics.record_origin(self.recorder, self.setup, failed=True)
                    self.recorder.end(store.FAILED, error=message)
                self._say_unsent(JobOutcome(self.name, store.FAILED))
            except Exception as end_err:  # the store itself failed: say so, once
                console.error(f"could not record the failure in MLflow: {store.one_line(end_err)}")
        code = EXIT_CONFIG if isinstance(err, ConfigError) else EXIT_FAILED
        if self.recorder.run_id is None and self.ctx.job_num is None:
            _drop_unused_run_dir(self.ctx)  # a refused command leaves nothing behind
        return JobOutcome(
            self.name, store.FAILED, self.recorder.run_id, error=message, exit_code=code
        )

    def _keep_journal(self, cfg: Config) -> None:
        """The run's records go to a journal in its checkpoint folder (held by this job's
        lease) before the store; a store outage is said once, and stops training if asked."""
        folder = folder_for(cfg, self.recorder.run_id)
        self._own(folder)
        self.recorder.keep_journal(folder / journal.NAME)
        self.recorder.on_down = partial(self._store_down, cfg.tracking.on_store_failure)

    def _store_down(self, policy: OnStoreFailure, why: str) -> None:
        kept = f"its records wait in {self.recorder.journal.path}"
        if policy == OnStoreFailure.stop:
            self.store_failed = why
            self.stop.requested = True  # the loop checkpoints at the next step and stops
            console.error(f"{self.name}: {why}; {kept}; stopping after this step, with a "
                          "checkpoint (tracking.on_store_failure=stop)")  # fmt: skip
            return
        console.error(f"{self.name}: {why}; training goes on, {kept} until it answers "
                      "(tracking.on_store_failure=stop stops instead)")  # fmt: skip

    def _say_unsent(self, outcome: JobOutcome) -> JobOutcome:
        """After the run's end: if the store is still down, say where its records wait."""
        if self.recorder.unsent:
            console.error(
                f"{self.name}: the MLflow store {store.describe(self.uri)} is still down: "
                f"{self.recorder.unsent} records of run {self.recorder.run_id} (its end "
                f"included) wait in {self.recorder.journal.path}; `ampsweep repair` writes them "
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
