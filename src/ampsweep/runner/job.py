"""One job: config in, a trained model and a finished MLflow run out.

A ``Job`` runs in explicit phases: ``plan`` (the config as it will run here, the run's name,
skip it if an identical config already FINISHED, the checkpoint to resume), ``open`` (the
recorder: a new MLflow run, or the resumed one), ``train`` (``engine.loop.fit``) and ``close``
(final metrics, artifacts, the trained model, the run's end). Failures never escape as
tracebacks: the run is ended FAILED with a one-line ``error`` tag (KILLED on Ctrl-C), the
message is printed, and the outcome says how the job ended so the command can exit non-zero.

What the command needs from its jobs (their outcomes) and gives them (extra tags, the sweep it
launched) travels in a ``CommandContext`` that the task function carries (``runner.context``).
The job holds its parts as collaborators that share its ``JobState`` (``runner.context``):
how it is stopped (``StopRequest``, ``runner.signals``), where it resumes from (``Resumer``,
``runner.resume``) and how its run ends (``RunEnd``, ``runner.ending``).

This module imports the engine (and torch): what must start without torch (Hydra's plugin scan
in any Hydra app, ``ampsweep report``) imports it only where it runs a job.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import tempfile
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import ampsweep
from ampsweep import console
from ampsweep.config.compose import as_dict, flatten, to_config, to_yaml
from ampsweep.config.schema import Config, ConfigError, Tracker
from ampsweep.engine import checkpoint, components, distributed, loop, sharded
from ampsweep.engine.build import build_planned, select_device
from ampsweep.engine.checkpoint import snapshot
from ampsweep.engine.run_folder import config_hash, folder_for
from ampsweep.measure import contention, memory
from ampsweep.measure.probe import probe
from ampsweep.runner import environment, estimate
from ampsweep.runner.context import (
    CommandContext,
    JobContext,
    JobOutcome,
    JobState,
    PlannedJob,
    default_run_name,
)
from ampsweep.runner.ending import RunEnd, record_origin, say_origin
from ampsweep.runner.plan import plan_job
from ampsweep.runner.resume import Resumer, cluster_job_tag, replay_left
from ampsweep.runner.signals import StopRequest, requeue_signal
from ampsweep.tracking import journal, store
from ampsweep.tracking.recorder import MlflowRecorder
from ampsweep.tracking.secrets import mask_text
from ampsweep.tracking.sweep import SweepInfo


class TaskFunction:
    """What Hydra calls for each job: ``run_job`` with this command's context. (A class, not
    a closure, so launchers that pickle the task to run it elsewhere can.)"""

    def __init__(self, command: CommandContext):
        self.command = command
        self.__module__ = __name__  # hydra.main reads it to find the calling module

    def check_batch(self, nodes: list) -> None:
        """ampsweep's sweeper (and launcher) hand each batch of composed jobs here before
        launching it: the command checks and plans them, or refuses the sweep."""
        if self.command.check_batch is not None:
            self.command.check_batch(nodes)

    def __call__(self, node) -> JobOutcome:
        ctx = JobContext.from_hydra()
        planned = self.command.planned.pop(ctx.job_num, None)  # None: planned elsewhere
        return run_job(planned or node, ctx, self.command)

    def collect(self, returns) -> None:
        """The outcomes of jobs that ran in other processes, from the JobReturns their
        launcher got back (a job run in this process hands its outcome over as it ends)."""
        from hydra.core.utils import JobStatus

        done = [r.return_value for r in returns if r.status == JobStatus.COMPLETED]
        self.command.outcomes.extend(o for o in done if isinstance(o, JobOutcome))


def run_job(node, ctx: JobContext | None = None, command: CommandContext | None = None):
    """Run one job from its plan (a PlannedJob), or from a composed config node or a Config,
    which it plans itself; under DDP, this rank's part."""
    ctx, command = ctx or JobContext(), command or CommandContext()
    distributed.export_submitit_env()  # a submitit task array: one task per rank
    rank = distributed.from_env()
    outcome = None
    with console.quiet_unless_main(rank.is_main):
        try:
            outcome = Job(node, ctx, command, rank).run()
            return outcome
        finally:
            distributed.shutdown(wait_for_all=outcome is not None and outcome.exit_code == 0)


def end_stray_mlflow_run() -> None:
    """End a run left active in MLflow's fluent API (by user code or a job that did not clean
    up): ampsweep itself records through explicit run ids, but a job must not start inside
    another job's active run."""
    if "mlflow" not in sys.modules:
        return
    import mlflow

    while mlflow.active_run() is not None:
        mlflow.end_run()


class Job:
    """One job's life in phases (``run``), with its parts as collaborators over one
    ``JobState``: ``resume`` (where it continues from) and ``end`` (how its run ends)."""

    def __init__(self, node, ctx: JobContext, command: CommandContext, rank):
        sweep = None
        if ctx.sweep_dir is not None:  # a multirun job: from the command, else the sweep dir
            own = command.sweep
            in_dir = own if own and Path(own.sweep_dir) == ctx.sweep_dir else None
            sweep = in_dir or SweepInfo.from_sweep_dir(ctx.sweep_dir)
        requeue = requeue_signal() if rank.is_main else None
        self.node = node
        self.state = JobState(ctx, command, rank, StopRequest(requeue), sweep)
        self.resume = Resumer(self.state)
        self.end = RunEnd(self.state)
        self.history: dict[str, list[tuple[int, float]]] = {}  # what training logged

    # ---------------------------------------------------------------- the phases

    def run(self) -> JobOutcome:
        job = self.state
        end_stray_mlflow_run()
        job.stop.install()
        try:
            outcome = self._phases()
        except KeyboardInterrupt as err:
            outcome = self.end.stopped(err)
            # (SIGTERM first and the requeue signal just after is how some clusters preempt.)
            if not job.stop.requeue and not job.store_failed:
                self._done(outcome)
                raise
        except Exception as err:  # every failure becomes one line and a FAILED run
            outcome = self.end.failed(err)
        finally:
            job.stop.uninstall()
            job.lease.release()
        if outcome.status == store.KILLED and job.stop.requeue:
            outcome = self.end.requeue(outcome)  # exits here when submitit requeues the job
        self._done(outcome)
        if job.stop.requested and not job.stop.requeue and not job.store_failed:
            # the signal came after the last step (it finished) or while the run's end was
            # recorded: stop here
            raise KeyboardInterrupt("a signal as the job ended")
        return outcome

    def _phases(self) -> JobOutcome:
        job = self.state
        cfg, refusal = self.plan()
        if job.tracked:
            twin = self.resume.finished_twin(cfg) if job.sweep and not refusal else None
            if twin is not None:
                return self.resume.skip(twin)
        setup = None
        if not refusal:
            if job.rank.enabled:
                distributed.init(job.rank, select_device(cfg.trainer.device).type)
            try:
                setup = job.setup = build_planned(cfg)
            except ConfigError as err:
                refusal = err
        if refusal and not (job.tracked and job.sweep):
            raise refusal  # a bad single command leaves nothing in the store
        ckpt = self.resume.resume_point(cfg) if setup else None
        self.open(cfg, ckpt)
        if refusal:  # in a sweep, a refused job is recorded as a FAILED child run
            raise refusal
        summary = self.train(setup, ckpt)
        return self.close(setup, summary)

    def plan(self) -> tuple[Config, ConfigError | None]:
        """The config as it will run here, the run's name, and whether it is recorded. A
        config this hardware refuses is returned with the refusal."""
        job = self.state
        planned = self.node if isinstance(self.node, PlannedJob) else None
        if planned is None:  # planned here, once: a job in its own process, a test
            cfg = self.node if isinstance(self.node, Config) else to_config(self.node)
            planned = plan_job(cfg)
        cfg = planned.cfg
        job.name = mask_text(cfg.tracking.run_name or default_run_name(cfg))
        # Only rank 0 records: one training across N processes is one MLflow run.
        job.tracked = cfg.tracking.backend == Tracker.mlflow and job.rank.is_main
        job.uri = store.resolve_uri(cfg.tracking.uri)
        if job.tracked:
            store.check(job.uri)
        if job.rank.enabled:  # record the processes that actually ran
            cfg = replace(cfg, trainer=replace(cfg.trainer, nproc=job.rank.world_size))
        refusal = planned.refusal
        name = cfg.tracking.run_name or default_run_name(cfg)
        if job.sweep and not cfg.tracking.run_name:
            name = job.sweep.run_name(name, job.ctx.job_num)
        job.name = mask_text(name)  # a run name may interpolate a secret: never show it
        return cfg, refusal

    def open(self, cfg: Config, ckpt: dict | None) -> None:
        """The recorder: the checkpoint's run continued, a new run, or nothing recorded."""
        job = self.state
        if not job.tracked:
            return
        if ckpt and ckpt["run_id"]:
            replay_left(Path(ckpt["path"]).parent, job.uri)  # an earlier outage's records
            job.recorder = self.resume.reattach(ckpt, cfg)
            self._keep_journal(cfg)
        else:
            tags = self._tags(cfg)
            tags[store.CONFIG_HASH] = config_hash(cfg)
            parent = job.sweep.parent_run_id if job.sweep else None
            job.recorder = MlflowRecorder.start(
                cfg.tracking, job.name, tags=tags, parent_run_id=parent, uri=job.uri
            )
            self._keep_journal(cfg)
            job.recorder.log_params({**flatten(cfg), "world_size": job.rank.world_size})
            job.recorder.log_text(to_yaml(cfg), "config.yaml")
        if cfg.tracking.system_metrics:  # only rank 0 records: its sampler sees every GPU
            job.recorder.start_system_metrics(cfg.tracking.system_metrics_interval)

    def _keep_journal(self, cfg: Config) -> None:
        """The run's records go to a journal in its checkpoint folder (held by this job's
        lease) before the store; a store outage is said once, and stops training if asked."""
        recorder = self.state.recorder
        folder = folder_for(cfg, recorder.run_id)
        self.resume.own(folder)
        recorder.keep_journal(folder / journal.NAME)
        recorder.on_down = partial(self.end.store_down, cfg.tracking.on_store_failure)

    def train(self, setup, ckpt: dict | None) -> dict:
        job = self.state
        cfg, recorder = setup.cfg, job.recorder
        tags = environment.run_tags(setup.device)
        tags.update({f"{store.DATA_PREFIX}{k}": str(v) for k, v in setup.dataset_info.items()})
        tags["model.num_params"] = str(setup.num_params)
        tags.update(setup.objective.task.score.tags())  # what the report judges quality by
        tags.update(store.fp8_tags(setup.fp8.converted, setup.fp8.kept, setup.fp8.emulated))
        recorder.set_tags(tags)
        recorder.log_inputs(setup.data_inputs)  # the train and validation sets, by digest
        if cfg.diagnostics.numerics and job.rank.is_main:
            record_probe(job.recorder, setup)
        state = checkpoint.restore(setup, ckpt) if ckpt else None
        folder = folder_for(cfg, recorder.run_id)
        checkpoints: Any = loop.NoCheckpoints()  # a Checkpointer on rank 0; sharded: every rank
        main_checkpoints = None
        if sharded.wanted(cfg):  # every rank writes its shards: one folder for all
            folder = sharded.agreed_folder(folder)
        weights = sharded.in_file if sharded.wanted(cfg) else None
        if job.rank.is_main:
            self.resume.own(folder)
            checkpoints = checkpoint.Checkpointer(
                folder, cfg, recorder.run_id, recorder.flush, mask=mask_text, weights=weights
            )
            recorder.set_tags({store.CHECKPOINT_DIR: str(folder)})
            main_checkpoints = checkpoints
        if sharded.wanted(cfg):
            main = checkpoints if job.rank.is_main else None
            checkpoints = sharded.ShardedCheckpoints(folder, cfg.trainer.checkpoint_every, main)
        console.console.print(
            f"[bold]{job.name}[/]: {setup.policy.mode.name} on {setup.device}, "
            f"{setup.num_params:,} parameters, {setup.dataset_info['train_samples']} train / "
            f"{setup.dataset_info['val_samples']} val samples, {setup.total_steps} steps"
        )
        if sharded.wanted(cfg) and not job.rank.enabled:
            console.console.print(
                f"{job.name}: trainer.strategy=fsdp in one process: the model runs unsharded "
                "(FSDP shards over trainer.nproc > 1 ranks); checkpoints are sharded ones"
            )
        if job.rank.is_main:
            console.console.print(f"checkpoints: {folder}")
        progress = console.progress_bar(cfg.trainer.progress and job.rank.is_main)
        hooks = components.instantiate_callbacks(cfg.trainer.callbacks)  # checked by plan
        # how much of the machine the timed steps had (other processes competing for it)
        self.share = contention.MachineShare(
            cfg.trainer.timing_warmup_steps, setup.total_steps, cfg.trainer.log_every
        )
        hooks = [*hooks, self.share, self._estimate(setup)]
        stop = sharded.GroupStop(job.stop) if sharded.is_sharded(setup.model) else job.stop
        job.checkpoints = main_checkpoints or loop.NoCheckpoints()  # training begins
        with job.stop.deferred():  # a signal during training stops at a step boundary
            return loop.fit(setup, self._log, progress, state, checkpoints, stop, hooks)

    def _estimate(self, setup) -> estimate.DurationEstimate:
        """Says once, after the first timed steps, how long this job and the sweep will take."""
        job = self.state
        cfg, num, plan = setup.cfg, job.ctx.job_num, job.command.plan
        later = plan[num + 1 :] if num is not None and num < len(plan) else []
        done = [o for o in job.command.outcomes if o.config and "perf/wall_s" in o.summary]
        known = {o.config["precision"]["name"]: o.summary["perf/wall_s"] for o in done}
        say = console.console.print if job.rank.is_main else (lambda text: None)
        return estimate.DurationEstimate(
            job.name,
            cfg.precision.name,
            setup.total_steps,
            cfg.trainer.timing_warmup_steps,
            later,
            known,
            estimate.cpu_flags(),
            setup.device.type == "cpu",
            say,
        )

    def _log(self, metrics: dict[str, float], step: int) -> None:
        """Record metrics, and keep them for the job's outcome (the Python API returns them)."""
        for key, value in metrics.items():
            self.history.setdefault(key, []).append((step, float(value)))
        self.state.recorder.log_metrics(metrics, step)

    def close(self, setup, summary: dict) -> JobOutcome:
        job = self.state
        final_step = int(summary["train/steps"])
        summary.update(self.share.metrics())
        recorder = job.recorder
        recorder.log_metrics(
            {k: v for k, v in summary.items() if not k.startswith(("val/", "train/"))},
            final_step,
        )
        recorder.stop_system_metrics()  # the machine's load from here on is not this training's
        model = None
        module = setup.model
        tracked = setup.cfg.tracking.backend == Tracker.mlflow and setup.cfg.tracking.log_model
        if tracked and sharded.is_sharded(module):
            # the whole model gathered to rank 0 for logging (a collective: every rank)
            module = sharded.full_module(module, setup.skeleton, job.rank.is_main)
        record_origin(job.recorder, setup)
        blanks = why_blank(setup.cfg, summary, self.history)  # the report says it too
        if recorder.run_id is not None:
            if blanks:
                recorder.set_tags({store.BLANKS: "; ".join(blanks)})
            recorder.log_json(summary, "summary.json")
            setup.diagnostics.log_artifacts(recorder)  # per-layer underflow tables, if measured
            if setup.fp8.recipe:  # every Linear layer, converted or why not
                recorder.log_json(setup.fp8.table(), store.FP8_LAYERS_ARTIFACT)
            if setup.activations_by_module:  # where a step's saved bytes are
                memory.log_activations_by_module(recorder, setup.activations_by_module)
            hydra_dir = job.ctx.output_dir / ".hydra" if job.ctx.output_dir else None
            if hydra_dir and hydra_dir.is_dir():
                recorder.log_artifact(hydra_dir, ".hydra")
            if setup.cfg.tracking.log_model:
                model = snapshot(module, setup.val_batches)  # fp32, on the CPU, at once
        outcome = JobOutcome(
            job.name,
            store.FINISHED,
            recorder.run_id,
            summary=summary,
            history=self.history,
            config=as_dict(setup.cfg),
        )
        where = None
        if recorder.run_id is not None:
            where = f"MLflow run {recorder.run_id} in {store.describe(recorder.uri)}"
            if model is not None:
                where += f"; model runs:/{recorder.run_id}/{store.MODEL_NAME}"
        console.print_summary(f"{job.name} finished", summary, where)
        say_origin(job.name, setup)
        # Before the next job of a sweep starts: its timed steps get the machine to themselves.
        self.end.finish(recorder, model, final_step, setup.cfg, outcome)
        return outcome

    def _done(self, outcome: JobOutcome) -> None:
        job = self.state
        outcome.job_num, outcome.overrides = job.ctx.job_num, job.ctx.overrides
        job.command.outcomes.append(outcome)

    def _tags(self, cfg: Config) -> dict[str, str]:
        job = self.state
        tags = {
            store.PRECISION: cfg.precision.name,
            store.MODEL: cfg.model.name,
            store.DATASET: cfg.dataset.name,
            store.AMPSWEEP_VERSION: ampsweep.__version__,
            **environment.git_state(),
            **job.command.extra_tags,
        }
        if job.ctx.overrides:
            tags[store.OVERRIDES] = " ".join(job.ctx.overrides)
        if job.ctx.output_dir:
            tags["run_dir"] = str(job.ctx.output_dir.resolve())
        if job.ctx.job_num is not None:
            tags[store.JOB_NUM] = str(job.ctx.job_num)
        tags[store.HOST], tags[store.PID] = socket.gethostname(), str(os.getpid())
        return {**tags, **environment.target_tags(cfg), **cluster_job_tag()}


def record_probe(recorder, setup) -> None:
    """diagnostics.numerics: the probe's ranges before training, as metrics at step 0,
    tags and the numerics/probe.json and .md artifacts."""
    n = setup.cfg.diagnostics.numerics_batches
    batches = list(itertools.islice(setup.train_batches.epoch(0), n))
    found = probe(
        distributed.unwrap(setup.model),
        batches,
        setup.objective,
        setup.diagnostics.loss_weight,
        setup.optimizer,
    )
    recorder.log_metrics(found.metrics(), 0)
    recorder.set_tags(found.tags())
    with tempfile.TemporaryDirectory() as tmp:
        for path in found.write(Path(tmp)):
            recorder.log_artifact(path, "numerics")


def why_blank(cfg: Config, summary: dict, history: dict) -> list[str]:
    """What a finished run could not measure, why, and what to set: a run too short to time
    (every step was a timing warm-up step) or to log a training loss (fewer steps than
    ``trainer.log_every``)."""
    t, steps = cfg.trainer, int(summary["train/steps"])
    out = []
    if "perf/samples_per_s" not in summary:
        out.append(
            f"no samples/s: too few steps to time ({steps} trained, the first "
            f"{t.timing_warmup_steps} untimed as warm-up); set trainer.max_steps above "
            f"{t.timing_warmup_steps} or trainer.timing_warmup_steps below {steps}"
        )
    if "train/loss" not in history:
        out.append(
            f"no train/loss curve: no point logged ({steps} steps, one logged every "
            f"{t.log_every}); set trainer.log_every={max(1, steps)} or lower"
        )
    return out
