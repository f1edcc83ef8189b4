"""One job: config in, a trained model and a finished MLflow run out.

A ``Job`` runs in explicit phases: ``plan`` (the config as it will run here, the run's name,
skip it if an identical config already FINISHED, the checkpoint to resume), ``open`` (the
recorder: a new MLflow run, or the resumed one), ``train`` (``engine.loop.fit``) and ``close``
(final metrics, artifacts, the trained model, the run's end: the model and the end on a
background thread in an in-process sweep, see ``RunCloser``). Failures never escape as
tracebacks: the run is ended FAILED with a one-line ``error`` tag (KILLED on Ctrl-C), the
message is printed, and the outcome says how the job ended so the command can exit non-zero.

What the command needs from its jobs (their outcomes) and gives them (extra tags, the sweep it
launched) travels in a ``CommandContext`` that the task function carries.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from ampsweep.app import console, estimate, slurm
from ampsweep.app.plan import PlannedJob, plan_job
from ampsweep.config.compose import as_dict, flatten, to_config, to_yaml
from ampsweep.config.schema import Config, ConfigError, OnStoreFailure, Tracker
from ampsweep.engine import distributed
from ampsweep.engine.lease import NoLease
from ampsweep.measure import contention, names
from ampsweep.tracking import journal, store
from ampsweep.tracking.recorder import MlflowRecorder, NullRecorder, RunCloser
from ampsweep.tracking.secrets import mask_text
from ampsweep.tracking.sweep import SweepInfo, record_skip

EXIT_CONFIG, EXIT_FAILED, EXIT_KILLED = 2, 1, 130


@dataclass
class JobOutcome:
    name: str
    status: str  # FINISHED / FAILED / KILLED
    run_id: str | None = None
    error: str | None = None
    exit_code: int = 0
    summary: dict = field(default_factory=dict)
    job_num: int | None = None
    overrides: list[str] = field(default_factory=list)
    skipped: bool = False  # a sweep relaunch found this config FINISHED already (run_id: that run)
    # What training logged, as (step, value) per metric, and the config as it ran (plain data)
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    config: dict = field(default_factory=dict)

    def __float__(self) -> float:
        """The objective a searching sweeper (hydra/sweeper=optuna, direction minimize)
        takes from a job: its final validation loss. A job without one failed the trial."""
        loss = self.summary.get("val/loss") if self.status == store.FINISHED else None
        if loss is None:
            raise ValueError(f"{self.name} ended {self.status}: {self.error or 'no val/loss'}")
        return float(loss)


@dataclass
class CommandContext:
    """What one command shares with the jobs it runs, and gets back from them."""

    extra_tags: dict[str, str] = field(default_factory=dict)  # e.g. reproduces=<run id>
    sweep: SweepInfo | None = None  # the sweep this command launched (None: single run)
    outcomes: list[JobOutcome] = field(default_factory=list)  # jobs run in this process
    closer: RunCloser = field(default_factory=RunCloser)  # logs models and ends runs
    plan: list[str] = field(default_factory=list)  # a sweep's modes by job number (estimates)
    # Each job as the command planned it, by job number (None: a single run), and the check
    # of each batch of a sweep's composed jobs (``app.plan.SweepChecks``)
    planned: dict[int | None, PlannedJob] = field(default_factory=dict)
    check_batch: Callable[[list], None] | None = None

    def __getstate__(self) -> dict:
        """The copy a launcher sends to jobs in other processes: without this process's plan
        and checks (such a job plans itself from the config it is given: precision=auto
        depends on the machine it runs on)."""
        return {**self.__dict__, "planned": {}, "check_batch": None}


@dataclass
class JobContext:
    """What Hydra tells a job about itself (empty outside Hydra, e.g. in tests)."""

    output_dir: Path | None = None
    overrides: list[str] = field(default_factory=list)
    job_num: int | None = None
    sweep_dir: Path | None = None  # set in multirun mode

    @classmethod
    def from_hydra(cls) -> JobContext:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return cls()
        hc = HydraConfig.get()
        multirun = hc.mode == RunMode.MULTIRUN
        return cls(
            output_dir=Path(hc.runtime.output_dir),
            overrides=list(hc.overrides.task),
            job_num=hc.job.num if multirun else None,
            sweep_dir=Path(hc.sweep.dir).resolve() if multirun else None,
        )


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


class StopRequest:
    """SIGTERM / Ctrl-C while a job runs, and the scheduler's warning before it preempts a
    job or the job reaches its time limit.

    While the training loop runs (``deferred``), the first signal only sets ``requested``: the
    loop sees it at the next step boundary, writes a checkpoint and raises Interrupted, so a
    signal never lands in the middle of an optimizer update. So is one that arrives while a
    run's end (FAILED, KILLED) is being recorded, which must not be cut short. Elsewhere, or on
    a second signal, SIGTERM / Ctrl-C raise KeyboardInterrupt at once. The job then ends KILLED
    and the command exits non-zero.

    ``requeue_signal`` (in a submitit SLURM job: USR2, which SLURM sends ``signal_delay_s``
    before the time limit or a preemption) is always deferred: the job stops at its next step
    boundary with a checkpoint (the first one, if it comes before training), its run ends
    KILLED, and ``hand_over`` gives the job back to submitit, which requeues it; the requeued
    job resumes the run from the checkpoint. Only rank 0 takes it, as only rank 0 requeues.
    """

    def __init__(self, requeue_signal: signal.Signals | None = None) -> None:
        self.requested = False
        self.requeue = False  # the scheduler will stop the job: checkpoint and requeue
        self.deferring = False
        self.requeue_signal = requeue_signal
        self._previous: dict = {}
        self._submitit_handler = None

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signal.signal's rule
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
            if self.requeue_signal is not None:
                previous = signal.signal(self.requeue_signal, self._handle_requeue)
                self._previous[self.requeue_signal] = self._submitit_handler = previous
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.deferring and not self.requested:
            self.requested = True
            console.error(f"{name}: stopping after this step, with a checkpoint")
            return
        raise KeyboardInterrupt(name)

    def _handle_requeue(self, signum, frame) -> None:
        if not self.requeue:
            console.error(
                f"{signal.Signals(signum).name}: SLURM will stop this job (preemption or its "
                "time limit): stopping after this step with a checkpoint, to be requeued"
            )
        self.requeue = self.requested = True

    def hand_over(self) -> str | None:
        """After the job stopped for the requeue signal: submitit's own handler pickles the
        task again, requeues the job (``scontrol requeue``) and exits (SystemExit). When it
        will not requeue (``max_num_timeout`` time limits reached) it says why: returned."""
        from submitit.core.utils import UncompletedJobError

        handler = self._submitit_handler
        if not callable(handler):
            return "no submitit handler to requeue the job"
        try:
            handler(self.requeue_signal, None)
        except UncompletedJobError as err:
            return str(err)
        return None

    @contextlib.contextmanager
    def deferred(self):
        """The first SIGTERM / Ctrl-C inside only sets ``requested``; a second one stops."""
        before, self.deferring = self.deferring, True
        try:
            yield
        finally:
            self.deferring = before


def default_run_name(cfg: Config) -> str:
    return f"{cfg.precision.name}-{cfg.model.name}-{cfg.dataset.name}"


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
    import sys

    if "mlflow" not in sys.modules:
        return
    import mlflow

    while mlflow.active_run() is not None:
        mlflow.end_run()


class Job:
    def __init__(self, node, ctx: JobContext, command: CommandContext, rank):
        self.node, self.ctx, self.command, self.rank = node, ctx, command, rank
        self.sweep = None
        if ctx.sweep_dir is not None:  # a multirun job: from the command, else the sweep dir
            own = command.sweep
            in_dir = own if own and Path(own.sweep_dir) == ctx.sweep_dir else None
            self.sweep = in_dir or SweepInfo.from_sweep_dir(ctx.sweep_dir)
        self.name = "job"
        self.recorder = NullRecorder()
        requeue = slurm.requeue_signal() if rank.is_main else None
        self.stop = StopRequest(requeue)
        self.setup = None  # once built: what the run's end records of its numerics
        self.history: dict[str, list[tuple[int, float]]] = {}  # what training logged
        self.lease = NoLease()  # on the run's checkpoint folder while this job trains it
        self.uri = ""  # the MLflow store, once planned
        self.store_failed: str | None = None  # why training stopped for the store

    # ---------------------------------------------------------------- the phases

    def run(self) -> JobOutcome:
        end_stray_mlflow_run()
        self.stop.install()
        try:
            outcome = self._phases()
        except KeyboardInterrupt as err:
            outcome = self._stopped(err)
            # (SIGTERM first and the requeue signal just after is how some clusters preempt.)
            if not self.stop.requeue and not self.store_failed:
                self._done(outcome)
                raise
        except Exception as err:  # every failure becomes one line and a FAILED run
            outcome = self._failed(err)
        finally:
            self.stop.uninstall()
            self.lease.release()
        if outcome.status == store.KILLED and self.stop.requeue:
            outcome = self._requeue(outcome)  # exits here when submitit requeues the job
        self._done(outcome)
        if self.stop.requested and not self.stop.requeue and not self.store_failed:
            # the signal came after the last step (it finished) or while the run's end was
            # recorded: stop here
            raise KeyboardInterrupt("a signal as the job ended")
        return outcome

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

    def _phases(self) -> JobOutcome:
        cfg, refusal = self.plan()
        if self.tracked:
            twin = self._finished_twin(cfg) if self.sweep and not refusal else None
            if twin is not None:
                return self._skip(twin)
        setup = None
        if not refusal:
            from ampsweep.engine.build import build_planned, select_device

            if self.rank.enabled:
                distributed.init(self.rank, select_device(cfg.trainer.device).type)
            try:
                setup = self.setup = build_planned(cfg)
            except ConfigError as err:
                refusal = err
        if refusal and not (self.tracked and self.sweep):
            raise refusal  # a bad single command leaves nothing in the store
        ckpt = self._resume_point(cfg) if setup else None
        self.open(cfg, ckpt)
        if refusal:  # in a sweep, a refused job is recorded as a FAILED child run
            raise refusal
        summary = self.train(setup, ckpt)
        return self.close(setup, summary)

    def plan(self) -> tuple[Config, ConfigError | None]:
        """The config as it will run here, the run's name, and whether it is recorded. A
        config this hardware refuses is returned with the refusal."""
        planned = self.node if isinstance(self.node, PlannedJob) else None
        if planned is None:  # planned here, once: a job in its own process, a test
            cfg = self.node if isinstance(self.node, Config) else to_config(self.node)
            planned = plan_job(cfg)
        cfg = planned.cfg
        self.name = mask_text(cfg.tracking.run_name or default_run_name(cfg))
        # Only rank 0 records: one training across N processes is one MLflow run.
        self.tracked = cfg.tracking.backend == Tracker.mlflow and self.rank.is_main
        self.uri = store.resolve_uri(cfg.tracking.uri)
        if self.tracked:
            store.check(self.uri)
        if self.rank.enabled:  # record the processes that actually ran
            cfg = replace(cfg, trainer=replace(cfg.trainer, nproc=self.rank.world_size))
        refusal = planned.refusal
        name = cfg.tracking.run_name or default_run_name(cfg)
        if self.sweep and not cfg.tracking.run_name:
            name = self.sweep.run_name(name, self.ctx.job_num)
        self.name = mask_text(name)  # a run name may interpolate a secret: never show it
        self.cfg = cfg
        return cfg, refusal

    def open(self, cfg: Config, ckpt: dict | None) -> None:
        """The recorder: the checkpoint's run continued, a new run, or nothing recorded."""
        if not self.tracked:
            return
        if ckpt and ckpt["run_id"]:
            replay_left(Path(ckpt["path"]).parent, self.uri)  # an earlier outage's records
            self.recorder = self._reattach(ckpt, cfg)
            self._keep_journal(cfg)
        else:
            from ampsweep.engine.checkpoint import config_hash

            tags = self._tags(cfg)
            tags[store.CONFIG_HASH] = config_hash(cfg)
            parent = self.sweep.parent_run_id if self.sweep else None
            self.recorder = MlflowRecorder.start(
                cfg.tracking, self.name, tags=tags, parent_run_id=parent, uri=self.uri
            )
            self._keep_journal(cfg)
            self.recorder.log_params({**flatten(cfg), "world_size": self.rank.world_size})
            self.recorder.log_text(to_yaml(cfg), "config.yaml")
        if cfg.tracking.system_metrics:  # only rank 0 records: its sampler sees every GPU
            self.recorder.start_system_metrics(cfg.tracking.system_metrics_interval)

    def train(self, setup, ckpt: dict | None) -> dict:
        from ampsweep.app.environment import run_tags
        from ampsweep.engine import callbacks, checkpoint, sharded
        from ampsweep.engine.loop import NoCheckpoints, fit

        cfg, recorder = setup.cfg, self.recorder
        tags = run_tags(setup.device)
        tags.update({f"{store.DATA_PREFIX}{k}": str(v) for k, v in setup.dataset_info.items()})
        tags["model.num_params"] = str(setup.num_params)
        tags.update(store.fp8_tags(setup.fp8.converted, setup.fp8.kept, setup.fp8.emulated))
        recorder.set_tags(tags)
        recorder.log_inputs(setup.data_inputs)  # the train and validation sets, by digest
        if cfg.diagnostics.numerics and self.rank.is_main:
            self._probe(setup)
        state = checkpoint.restore(setup, ckpt) if ckpt else None
        folder = checkpoint.folder_for(cfg, recorder.run_id)
        checkpoints = NoCheckpoints()
        if sharded.wanted(cfg):  # every rank writes its shards: one folder for all
            folder = sharded.agreed_folder(folder)
        weights = sharded.in_file if sharded.wanted(cfg) else None
        if self.rank.is_main:
            self._own(folder)
            checkpoints = checkpoint.Checkpointer(
                folder, cfg, recorder.run_id, recorder.flush, mask=mask_text, weights=weights
            )
            recorder.set_tags({store.CHECKPOINT_DIR: str(folder)})
        if sharded.wanted(cfg):
            main = checkpoints if self.rank.is_main else None
            checkpoints = sharded.ShardedCheckpoints(folder, cfg.trainer.checkpoint_every, main)
        console.console.print(
            f"[bold]{self.name}[/]: {setup.policy.mode.name} on {setup.device}, "
            f"{setup.num_params:,} parameters, {setup.dataset_info['train_samples']} train / "
            f"{setup.dataset_info['val_samples']} val samples, {setup.total_steps} steps"
        )
        if sharded.wanted(cfg) and not self.rank.enabled:
            console.console.print(
                f"{self.name}: trainer.strategy=fsdp in one process: the model runs unsharded "
                "(FSDP shards over trainer.nproc > 1 ranks); checkpoints are sharded ones"
            )
        if self.rank.is_main:
            console.console.print(f"checkpoints: {folder}")
        progress = console.progress_bar(cfg.trainer.progress and self.rank.is_main)
        hooks = callbacks.instantiate(cfg.trainer.callbacks)  # the user's, checked by plan
        # how much of the machine the timed steps had (other processes competing for it)
        self.share = contention.MachineShare(
            cfg.trainer.timing_warmup_steps, setup.total_steps, cfg.trainer.log_every
        )
        hooks = [*hooks, self.share, self._estimate(setup)]
        stop = sharded.GroupStop(self.stop) if sharded.is_sharded(setup.model) else self.stop
        with self.stop.deferred():  # a signal during training stops at a step boundary
            return fit(setup, self._log, progress, state, checkpoints, stop, hooks)

    def _estimate(self, setup) -> estimate.DurationEstimate:
        """Says once, after the first timed steps, how long this job and the sweep will take."""
        cfg, num, plan = setup.cfg, self.ctx.job_num, self.command.plan
        later = plan[num + 1 :] if num is not None and num < len(plan) else []
        done = [o for o in self.command.outcomes if o.config and "perf/wall_s" in o.summary]
        known = {o.config["precision"]["name"]: o.summary["perf/wall_s"] for o in done}
        say = console.console.print if self.rank.is_main else (lambda text: None)
        return estimate.DurationEstimate(
            self.name, cfg.precision.name, setup.total_steps, cfg.trainer.timing_warmup_steps,
            later, known, estimate.cpu_flags(), setup.device.type == "cpu", say,
        )  # fmt: skip

    def _log(self, metrics: dict[str, float], step: int) -> None:
        """Record metrics, and keep them for the job's outcome (the Python API returns them)."""
        for key, value in metrics.items():
            self.history.setdefault(key, []).append((step, float(value)))
        self.recorder.log_metrics(metrics, step)

    def close(self, setup, summary: dict) -> JobOutcome:
        from ampsweep.engine import sharded

        final_step = int(summary["train/steps"])
        summary.update(self.share.metrics())
        recorder = self.recorder
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
            module = sharded.full_module(module, setup.skeleton, self.rank.is_main)
        self._record_numerics(setup)
        if recorder.run_id is not None:
            recorder.log_json(summary, "summary.json")
            setup.diagnostics.log_artifacts(recorder)  # per-layer underflow tables, if measured
            if setup.fp8.recipe:  # every Linear layer, converted or why not
                recorder.log_json(setup.fp8.table(), store.FP8_LAYERS_ARTIFACT)
            hydra_dir = self.ctx.output_dir / ".hydra" if self.ctx.output_dir else None
            if hydra_dir and hydra_dir.is_dir():
                recorder.log_artifact(hydra_dir, ".hydra")
            if setup.cfg.tracking.log_model:
                from ampsweep.engine.export import snapshot

                model = snapshot(module, setup.val_batches)  # fp32, on the CPU, at once
        outcome = JobOutcome(self.name, store.FINISHED, recorder.run_id, summary=summary,
                             history=self.history, config=as_dict(setup.cfg))  # fmt: skip
        where = None
        if recorder.run_id is not None:
            where = f"MLflow run {recorder.run_id} in {store.describe(recorder.uri)}"
            if model is not None:
                where += f"; model runs:/{recorder.run_id}/{store.MODEL_NAME}"
        console.print_summary(f"{self.name} finished", summary, where)
        self._say_numerics(setup)
        finish = partial(self._finish, recorder, model, final_step, setup.cfg, outcome)
        self.command.closer.submit(finish)  # now, or while the next job of a sweep trains
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

    # ---------------------------------------------------------------- helpers

    def _record_numerics(self, setup, failed: bool = False) -> None:
        """Where the run's first non-finite value began: tags, an artifact (and the count of
        non-finite steps for a failed run, whose summary is never logged)."""
        lost = next((c.shares for c in setup.callbacks if getattr(c, "shares", None)), None)
        if lost and self.recorder.run_id is not None:  # a pure run's own rounding losses
            worst = sorted(((k, v) for k, v in lost.items() if k != "(all)"), key=lambda x: -x[1])
            self.recorder.set_tags({names.UPDATE_LOST_LAYERS: names.pairs(worst[:8], ".2f")})
        origin = setup.locator.origin
        if origin is None or self.recorder.run_id is None:
            return
        import tempfile

        self.recorder.set_tags(origin.tags())
        if failed:
            count = float(setup.locator.nonfinite_steps)
            self.recorder.log_metrics({names.NONFINITE_STEPS: count}, origin.step)
        with tempfile.TemporaryDirectory() as tmp:
            self.recorder.log_artifact(origin.write(Path(tmp)), "numerics")

    def _probe(self, setup) -> None:
        """diagnostics.numerics: the probe's ranges before training, as metrics at step 0,
        tags and the numerics/probe.json and .md artifacts."""
        import itertools
        import tempfile

        from ampsweep.measure.probe import probe

        n = setup.cfg.diagnostics.numerics_batches
        batches = list(itertools.islice(setup.train_batches.epoch(0), n))
        found = probe(distributed.unwrap(setup.model), batches, setup.objective,
                      setup.diagnostics.loss_weight, setup.optimizer)  # fmt: skip
        self.recorder.log_metrics(found.metrics(), 0)
        self.recorder.set_tags(found.tags())
        with tempfile.TemporaryDirectory() as tmp:
            for path in found.write(Path(tmp)):
                self.recorder.log_artifact(path, "numerics")

    def _say_numerics(self, setup) -> None:
        origin = setup.locator.origin
        if origin is None:
            return
        fix = origin.fix()
        console.note(
            f"{self.name}: {setup.locator.nonfinite_steps} non-finite step(s); "
            f"{origin.sentence()}" + (f"; fix: {fix}" if fix else "")
        )

    def _done(self, outcome: JobOutcome) -> None:
        outcome.job_num, outcome.overrides = self.ctx.job_num, self.ctx.overrides
        self.command.outcomes.append(outcome)

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
                        self._record_numerics(self.setup, failed=True)
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

    def _finished_twin(self, cfg: Config):
        """A FINISHED run of the same config in this experiment (tracking.skip_finished)."""
        from ampsweep.engine.checkpoint import config_hash

        if not cfg.tracking.skip_finished:
            return None
        client = store.client_for(self.uri)
        twin = store.finished_twin(client, cfg.tracking.experiment, config_hash(cfg))
        changed = code_changes(cfg, twin.data.tags) if twin is not None else []
        if changed:  # the same config, other code: its results are no longer this job's
            console.console.print(
                f"[bold]#{self.ctx.job_num} {self.name}[/]: runs again: the identical config "
                f"FINISHED as run {twin.info.run_name} ({twin.info.run_id}) with other code "
                f"({'; '.join(changed)})",
                soft_wrap=True,
            )
            return None
        return twin

    def _skip(self, twin) -> JobOutcome:
        """Report a skipped job and name the run standing in for it on this launch's parent."""
        run_id = twin.info.run_id
        console.console.print(
            f"[bold]#{self.ctx.job_num} {self.name}[/]: skipped, the identical config FINISHED "
            f"as run {twin.info.run_name} ({run_id}); tracking.skip_finished=false reruns it"
        )
        record_skip(self.sweep, self.ctx.job_num, run_id)
        return JobOutcome(self.name, store.FINISHED, run_id, skipped=True)

    def _resume_point(self, cfg: Config) -> dict | None:
        """Load the checkpoint trainer.resume names. In a sweep with tracking.skip_finished
        (the default), ``auto`` is implied: relaunching a sweep continues interrupted jobs."""
        from ampsweep.engine import checkpoint

        choice = cfg.trainer.resume
        implied = choice is None and self.sweep is not None and cfg.tracking.skip_finished
        if implied:
            choice = "auto"
        run_id = None
        if choice and choice != "auto" and not checkpoint.is_path(choice):
            run_id = choice  # an MLflow run id: its checkpoint folder is one of its tags
            folder = self._checkpoint_dir_of(run_id, cfg)
            paths, line = checkpoint.candidates_of_run(run_id, folder), ""
        else:
            paths, line = checkpoint.candidates(cfg, choice)
        # rank 0 takes the lease on the run: no other process trains it meanwhile
        picked = checkpoint.choose(paths, choice, console.note, claim=self.rank.is_main)
        line = picked.line or line
        if picked.ckpt is None:
            if line and not (implied and not picked.line):  # a fresh sweep job: no word
                console.console.print(line)
            return None
        self.lease = picked.lease
        ckpt = picked.ckpt
        # A refused checkpoint is refused before "resuming" is said.
        checkpoint.check(ckpt, cfg, picked.path, choice, run_id, mask=mask_text)
        if run_id is not None:
            line = f"resuming run {run_id} from {picked.path}"
        console.console.print(line)
        ckpt["path"] = str(picked.path)
        return ckpt

    def _keep_journal(self, cfg: Config) -> None:
        """The run's records go to a journal in its checkpoint folder (held by this job's
        lease) before the store; a store outage is said once, and stops training if asked."""
        from ampsweep.engine.checkpoint import folder_for

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

    def _own(self, folder: Path) -> None:
        """Hold the lease on the folder this run's checkpoints go to (a resumed run holds
        it already, unless its checkpoint came from elsewhere)."""
        from ampsweep.engine import lease

        if self.lease.folder == folder:
            return
        try:
            held = lease.take(folder)
        except lease.Owned as owned:
            raise ConfigError(
                f"trainer.checkpoint_dir: {owned}: another process trains this run; start a "
                "new run (drop trainer.resume)"
            ) from None
        self.lease.release()
        self.lease = held

    def _checkpoint_dir_of(self, run_id: str, cfg: Config) -> Path | None:
        if cfg.tracking.backend != Tracker.mlflow:
            raise ConfigError(
                f"trainer.resume={run_id}: resuming by run id needs tracking=mlflow: give the "
                "checkpoint path instead"
            )
        run = store.find_run(store.client_for(self.uri), run_id)
        if run is None:
            raise ConfigError(
                f"trainer.resume={run_id}: no such checkpoint path and no run {run_id} in the "
                f"configured store {store.describe(self.uri)}: check the id, tracking.uri or "
                "MLFLOW_TRACKING_URI"
            )
        folder = run.data.tags.get(store.CHECKPOINT_DIR)
        return Path(folder).resolve() if folder else None

    def _reattach(self, ckpt: dict, cfg: Config) -> MlflowRecorder:
        """Continue the checkpoint's MLflow run: same run id, metrics from the next step on."""
        run_id, step = ckpt["run_id"], ckpt["state"]["step"]
        run = store.find_run(store.client_for(self.uri), run_id)
        if run is None:
            raise ConfigError(
                f"trainer.resume: {ckpt['path']} belongs to run {run_id}, which is not in the "
                f"configured store {store.describe(self.uri)}: resume with the tracking.uri "
                "it was recorded in"
            )
        if run.info.status == store.FINISHED:
            raise ConfigError(
                f"trainer.resume: run {run_id} of {ckpt['path']} already FINISHED: nothing to "
                "resume; drop trainer.resume to start a new run"
            )
        recorder = MlflowRecorder.attach(
            self.uri,
            run_id,
            cfg.tracking.metrics_flush_every,
            after_step=step,
            flush_seconds=cfg.tracking.metrics_flush_seconds,
        )
        tags = {"resumed_from": ckpt["path"], "resumed_at_step": str(step),
                **self.command.extra_tags}  # fmt: skip
        if self.ctx.output_dir:
            tags["resumed_run_dir"] = str(self.ctx.output_dir.resolve())
        if self.sweep:  # a relaunched sweep: the run now belongs to this launch's parent
            tags[store.PARENT] = self.sweep.parent_run_id
        tags.update(_cluster_job_tag())  # a requeued or relaunched SLURM job continues it
        old_error = run.data.tags.get(store.ERROR)
        gone = self.lease.previous  # the owner before us died holding the run
        if gone is not None and not old_error:
            old_error = (f"its process ({gone.describe()}) ended without ending the run "
                         "(killed, or its machine lost)")  # fmt: skip
            tags[store.ENDED_BY] = f"pid {os.getpid()} on {socket.gethostname()}, resuming it"
        if old_error:  # the run is alive again: keep why it stopped, under another name
            tags[store.PREVIOUS_ERROR] = old_error
            with contextlib.suppress(Exception):  # (no error tag: nothing to delete)
                recorder.client.delete_tag(run_id, store.ERROR)
        tags[store.HOST], tags[store.PID] = socket.gethostname(), str(os.getpid())
        recorder.set_tags(tags)
        return recorder

    def _tags(self, cfg: Config) -> dict[str, str]:
        import ampsweep
        from ampsweep.app.environment import git_state

        tags = {
            store.PRECISION: cfg.precision.name,
            store.MODEL: cfg.model.name,
            store.DATASET: cfg.dataset.name,
            store.AMPSWEEP_VERSION: ampsweep.__version__,
            **git_state(),
            **self.command.extra_tags,
        }
        if self.ctx.overrides:
            tags[store.OVERRIDES] = " ".join(self.ctx.overrides)
        if self.ctx.output_dir:
            tags["run_dir"] = str(self.ctx.output_dir.resolve())
        if self.ctx.job_num is not None:
            tags[store.JOB_NUM] = str(self.ctx.job_num)
        tags[store.HOST], tags[store.PID] = socket.gethostname(), str(os.getpid())
        return {**tags, **target_tags(cfg), **_cluster_job_tag()}


def code_changes(cfg: Config, tags: dict[str, str]) -> list[str]:
    """How the code this job would run differs from the code a run of its config ran:
    ampsweep's version, and the version and module digest of each ``_target_`` component."""
    import ampsweep

    now = {store.AMPSWEEP_VERSION: ampsweep.__version__}
    now.update({k: v for k, v in target_tags(cfg).items() if k.endswith((".version", ".sha256"))})
    return [
        f"{key}: {_short(tags.get(key)) or '(not recorded)'} then, {_short(value)} now"
        for key, value in now.items()
        if tags.get(key) != value
    ]


def _short(value: str | None) -> str | None:
    return value[:12] if value and len(value) == 64 else value  # a SHA-256: its prefix


def target_tags(cfg: Config) -> dict[str, str]:
    """For each component named by ``_target_``: its path and where its code came from."""
    from ampsweep.app.environment import target_provenance
    from ampsweep.engine.components import builders

    tags = {}
    for section, builder in builders(cfg).items():
        if builder.target:
            tags[store.target_tag(section)] = builder.target
            for key, value in target_provenance(builder.fn).items():
                tags[store.target_tag(section, key)] = value
    return tags


def _cluster_job_tag() -> dict[str, str]:
    """The SLURM job training the run: what the sweep's launcher follows (and ends the run
    of, if the job dies without ending it), and what ``sacct -j`` or ``scontrol`` take."""
    job_id = slurm.job_id_from_env()
    return {store.CLUSTER_JOB: job_id} if job_id else {}


def replay_left(folder: Path, uri: str) -> None:
    """Write the journal an earlier owner of the run left in ``folder`` (the store was down
    when it ended or died) into the store, before the run is continued."""
    path = folder / journal.NAME
    if path.is_file():
        run_id, n = journal.replay(path, store.client_for(uri))
        if n:
            console.note(f"wrote {n} records of run {run_id} that waited in {path}")


def _drop_unused_run_dir(ctx: JobContext) -> None:
    """Remove the run folder Hydra made for a job that was refused before it ran (it holds
    only Hydra's .hydra/ record of the refused command)."""
    folder = ctx.output_dir
    if folder and folder.is_dir() and {p.name for p in folder.iterdir()} <= {".hydra"}:
        shutil.rmtree(folder, ignore_errors=True)
        if not any(folder.parent.iterdir()):  # the day's folder, if this was its only run
            folder.parent.rmdir()
