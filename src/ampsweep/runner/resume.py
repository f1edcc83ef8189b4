"""Where a job continues from: the checkpoint ``trainer.resume`` names (a path, a run id,
``auto``) and the MLflow run it continues; a sweep's relaunch skips a job whose identical
config FINISHED already; the lease on the run's checkpoint folder keeps a second process off it.

A ``Job`` (``runner.job``) asks its ``Resumer``, which reads and updates the job's
``JobState`` (``runner.context``): the lease it takes is the job's.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from ampsweep import console
from ampsweep.config.schema import Config, ConfigError, Tracker
from ampsweep.engine import run_folder
from ampsweep.engine.run_folder import config_hash
from ampsweep.runner.context import JobOutcome, JobState
from ampsweep.runner.signals import job_id_from_env
from ampsweep.tracking import journal, store
from ampsweep.tracking.recorder import MlflowRecorder
from ampsweep.tracking.secrets import mask_text
from ampsweep.tracking.sweep import record_skip


class Resumer:
    """Finds where a job continues from, and holds the lease on its run's checkpoint folder."""

    def __init__(self, job: JobState):
        self.job = job

    def finished_twin(self, cfg: Config):
        """A FINISHED run of the same config in this experiment (tracking.skip_finished)."""
        job = self.job
        from ampsweep.runner.environment import code_changes  # torch: see runner.job's note

        if not cfg.tracking.skip_finished:
            return None
        client = store.client_for(job.uri)
        twin = store.finished_twin(client, cfg.tracking.experiment, config_hash(cfg))
        changed = code_changes(cfg, twin.data.tags) if twin is not None else []
        if changed:  # the same config, other code: its results are no longer this job's
            console.console.print(
                f"[bold]#{job.ctx.job_num} {job.name}[/]: runs again: the identical config "
                f"FINISHED as run {twin.info.run_name} ({twin.info.run_id}) with other code "
                f"({'; '.join(changed)})",
                soft_wrap=True,
            )
            return None
        return twin

    def skip(self, twin) -> JobOutcome:
        """Report a skipped job and name the run standing in for it on this launch's parent."""
        job = self.job
        run_id = twin.info.run_id
        console.console.print(
            f"[bold]#{job.ctx.job_num} {job.name}[/]: skipped, the identical config FINISHED "
            f"as run {twin.info.run_name} ({run_id}); tracking.skip_finished=false reruns it"
        )
        assert job.sweep is not None  # only a sweep's relaunch skips a job
        record_skip(job.sweep, job.ctx.job_num, run_id)
        return JobOutcome(job.name, store.FINISHED, run_id, skipped=True)

    def resume_point(self, cfg: Config) -> dict | None:
        """Load the checkpoint trainer.resume names. In a sweep with tracking.skip_finished
        (the default), ``auto`` is implied: relaunching a sweep continues interrupted jobs."""
        job = self.job
        from ampsweep.engine import resume_from  # torch: see runner.job's note

        choice = cfg.trainer.resume
        implied = choice is None and job.sweep is not None and cfg.tracking.skip_finished
        if implied:
            choice = "auto"
        if not choice:  # no trainer.resume, and none implied: a new run
            return None
        run_id = None
        if choice and choice != "auto" and not resume_from.is_path(choice):
            run_id = choice  # an MLflow run id: its checkpoint folder is one of its tags
            folder = self.checkpoint_dir_of(run_id, cfg)
            paths, line = resume_from.candidates_of_run(run_id, folder), ""
        else:
            paths, line = resume_from.candidates(cfg, choice)
        # rank 0 takes the lease on the run: no other process trains it meanwhile
        picked = resume_from.choose(paths, choice, console.note, claim=job.rank.is_main)
        line = picked.line or line
        if picked.ckpt is None:
            if line and not (implied and not picked.line):  # a fresh sweep job: no word
                console.console.print(line)
            return None
        job.lease = picked.lease
        ckpt = picked.ckpt
        assert picked.path is not None  # a loaded checkpoint's
        # A refused checkpoint is refused before "resuming" is said.
        resume_from.check(ckpt, cfg, picked.path, choice, run_id, mask=mask_text)
        if run_id is not None:
            line = f"resuming run {run_id} from {picked.path}"
        console.console.print(line)
        ckpt["path"] = str(picked.path)
        return ckpt

    def own(self, folder: Path) -> None:
        """Hold the lease on the folder this run's checkpoints go to (a resumed run holds
        it already, unless its checkpoint came from elsewhere)."""
        job = self.job
        if job.lease.folder == folder:
            return
        try:
            held = run_folder.take(folder)
        except run_folder.Owned as owned:
            raise ConfigError(
                f"trainer.checkpoint_dir: {owned}: another process trains this run; start a "
                "new run (drop trainer.resume)"
            ) from None
        job.lease.release()
        job.lease = held

    def checkpoint_dir_of(self, run_id: str, cfg: Config) -> Path | None:
        job = self.job
        if cfg.tracking.backend != Tracker.mlflow:
            raise ConfigError(
                f"trainer.resume={run_id}: resuming by run id needs tracking=mlflow: give the "
                "checkpoint path instead"
            )
        run = store.find_run(store.client_for(job.uri), run_id)
        if run is None:
            raise ConfigError(
                f"trainer.resume={run_id}: no such checkpoint path and no run {run_id} in the "
                f"configured store {store.describe(job.uri)}: check the id, tracking.uri or "
                "MLFLOW_TRACKING_URI"
            )
        folder = run.data.tags.get(store.CHECKPOINT_DIR)
        return Path(folder).resolve() if folder else None

    def reattach(self, ckpt: dict, cfg: Config) -> MlflowRecorder:
        """Continue the checkpoint's MLflow run: same run id, metrics from the next step on."""
        job = self.job
        run_id, step = ckpt["run_id"], ckpt["state"]["step"]
        run = store.find_run(store.client_for(job.uri), run_id)
        if run is None:
            raise ConfigError(
                f"trainer.resume: {ckpt['path']} belongs to run {run_id}, which is not in the "
                f"configured store {store.describe(job.uri)}: resume with the tracking.uri "
                "it was recorded in"
            )
        if run.info.status == store.FINISHED:
            raise ConfigError(
                f"trainer.resume: run {run_id} of {ckpt['path']} already FINISHED: nothing to "
                "resume; drop trainer.resume to start a new run"
            )
        recorder = MlflowRecorder.attach(
            job.uri,
            run_id,
            cfg.tracking.metrics_flush_every,
            after_step=step,
            flush_seconds=cfg.tracking.metrics_flush_seconds,
        )
        tags = {
            "resumed_from": ckpt["path"],
            "resumed_at_step": str(step),
            **job.command.extra_tags,
        }
        if job.ctx.output_dir:
            tags["resumed_run_dir"] = str(job.ctx.output_dir.resolve())
        if job.sweep:  # a relaunched sweep: the run now belongs to this launch's parent
            tags[store.PARENT] = job.sweep.parent_run_id
        tags.update(cluster_job_tag())  # a requeued or relaunched SLURM job continues it
        old_error = run.data.tags.get(store.ERROR)
        gone = job.lease.previous  # the owner before us died holding the run
        if gone is not None and not old_error:
            old_error = (
                f"its process ({gone.describe()}) ended without ending the run "
                "(killed, or its machine lost)"
            )
            tags[store.ENDED_BY] = f"pid {os.getpid()} on {socket.gethostname()}, resuming it"
        if old_error:  # the run is alive again: keep why it stopped, under another name
            tags[store.PREVIOUS_ERROR] = old_error
            with contextlib.suppress(Exception):  # (no error tag: nothing to delete)
                recorder.client.delete_tag(run_id, store.ERROR)
        tags[store.HOST], tags[store.PID] = socket.gethostname(), str(os.getpid())
        recorder.set_tags(tags)
        return recorder


def cluster_job_tag() -> dict[str, str]:
    """The SLURM job training the run: what the sweep's launcher follows (and ends the run
    of, if the job dies without ending it), and what ``sacct -j`` or ``scontrol`` take."""
    job_id = job_id_from_env()
    return {store.CLUSTER_JOB: job_id} if job_id else {}


def replay_left(folder: Path, uri: str) -> None:
    """Write the journal an earlier owner of the run left in ``folder`` (the store was down
    when it ended or died) into the store, before the run is continued."""
    path = folder / journal.NAME
    if path.is_file():
        run_id, n = journal.replay(path, store.client_for(uri))
        if n:
            console.note(f"wrote {n} records of run {run_id} that waited in {path}")
