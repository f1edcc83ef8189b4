"""One job: config in, a trained model and a finished MLflow run out.

compose (Hydra) -> validate (``config.to_config``) -> build (``train.build``) -> train
(``train.fit``) -> evaluate -> record (``tracking``). Failures never escape as tracebacks:
the run is ended FAILED with a one-line ``error`` tag (KILLED on Ctrl-C), the message is
printed, and the outcome says how the job ended so the command can exit non-zero.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ampsweep import console, distributed, tracking
from ampsweep.config import flatten, to_config, to_yaml
from ampsweep.schema import Config, ConfigError, Tracker

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


# Outcomes of the jobs this process ran (Hydra's basic launcher runs a sweep in-process).
OUTCOMES: list[JobOutcome] = []
# Tags the command adds to every run it starts (``ampsweep reproduce`` sets reproduces=RUN_ID).
EXTRA_TAGS: dict[str, str] = {}


class StopRequest:
    """SIGTERM / Ctrl-C while a job runs.

    While the training loop runs (``deferred``), the first signal only sets ``requested``: the
    loop sees it at the next step boundary, writes a checkpoint and raises Interrupted, so a
    signal never lands in the middle of an optimizer update. Elsewhere, or on a second signal,
    it raises KeyboardInterrupt at once. The job then ends KILLED and the command exits non-zero.
    """

    def __init__(self) -> None:
        self.requested = False
        self.deferring = False
        self._previous: dict = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signal.signal's rule
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
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

    @contextlib.contextmanager
    def deferred(self):
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False


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


def default_run_name(cfg: Config) -> str:
    return f"{cfg.precision.name.name}-{cfg.model.name.name}-{cfg.dataset.name.name}"


def expected_run_name(cfg: Config) -> str:
    """The name a job's run will get, with ``precision=auto`` resolved for this machine (so a
    sweep can tell up front which names repeat). Imports torch only for ``auto``."""
    from ampsweep.schema import Mode

    if cfg.precision.name != Mode.auto:
        return default_run_name(cfg)
    from dataclasses import replace

    from ampsweep.precision import resolve_mode
    from ampsweep.train import select_device

    try:
        mode = resolve_mode(cfg.precision.name, select_device(cfg.trainer.device))
    except ConfigError:  # the job itself will report it
        return default_run_name(cfg)
    return default_run_name(replace(cfg, precision=replace(cfg.precision, name=mode)))


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


def hydra_task(node) -> JobOutcome:
    """The function Hydra calls for each job."""
    return run_job(node, JobContext.from_hydra())


def run_job(node, ctx: JobContext | None = None, parent_run_id: str | None = None) -> JobOutcome:
    """Run one job from a composed config node (or a Config); under DDP, this rank's part."""
    ctx = ctx or JobContext()
    distributed.export_submitit_env()  # a submitit task array: one task per rank
    rank = distributed.from_env()
    outcome = None
    with distributed.quiet_unless_main(rank):
        try:
            outcome = _run_job(node, ctx, parent_run_id, rank)
            return outcome
        finally:
            distributed.shutdown(wait_for_all=outcome is not None and outcome.exit_code == 0)


def _run_job(node, ctx: JobContext, parent_run_id: str | None, rank) -> JobOutcome:
    from ampsweep import sweep  # the sweep context (parent run) when this job is part of one

    end_stray_mlflow_run()
    recorder = None
    name = "job"
    sweep_info = sweep.job_sweep_info(ctx) if parent_run_id is None else None
    if sweep_info:
        parent_run_id = sweep_info.parent_run_id
    stop = StopRequest().install()
    try:
        cfg = node if isinstance(node, Config) else to_config(node)
        base_name = name = tracking.mask_text(cfg.tracking.run_name or default_run_name(cfg))
        # Only rank 0 records: one training across N processes is one MLflow run.
        use_mlflow = cfg.tracking.backend == Tracker.mlflow and rank.is_main
        uri = tracking.resolve_uri(cfg.tracking.uri)
        if use_mlflow:
            tracking.check_store(uri)
        from ampsweep import checkpoint, train  # torch is imported once the config is good

        # A relaunched sweep skips a job whose identical config already FINISHED.
        twin = _finished_twin(cfg, uri) if sweep_info and use_mlflow else None
        if twin is not None:
            return _skip(twin, sweep_info, ctx, base_name)
        setup, build_error = None, None
        if rank.enabled:
            cfg = _with_world_size(cfg, rank.world_size)
            distributed.init(rank, train.select_device(cfg.trainer.device).type)
        try:
            setup = train.build(cfg)
            cfg = setup.cfg
            name = cfg.tracking.run_name or default_run_name(cfg)
        except ConfigError as err:
            if not (use_mlflow and parent_run_id):
                raise  # a bad single command leaves nothing in the store
            build_error = err  # in a sweep, the job is recorded as a FAILED child run
        if sweep_info and not cfg.tracking.run_name:
            name = sweep_info.run_name(name, ctx.job_num)
        name = tracking.mask_text(name)  # a run name may interpolate a secret: never show it
        # trainer.resume (or a relaunched sweep): the checkpoint to continue from, if any.
        # Every DDP rank loads the same checkpoint; only rank 0 records and writes them.
        tracked = cfg.tracking.backend == Tracker.mlflow
        ckpt = _resume_point(cfg, sweep_info, uri if tracked else None) if setup else None
        if use_mlflow and ckpt and ckpt["run_id"]:
            recorder = _reattach(ckpt, cfg, uri, parent_run_id, ctx)
        elif use_mlflow:
            tags = _tags(cfg, ctx)
            if setup:
                tags[checkpoint.HASH_TAG] = checkpoint.config_hash(cfg)
            recorder = tracking.MlflowRecorder.start(
                cfg.tracking, name, tags=tags, parent_run_id=parent_run_id, uri=uri
            )
            recorder.log_params({**flatten(cfg), "world_size": rank.world_size})
            recorder.log_text(to_yaml(cfg), "config.yaml")
        else:
            recorder = tracking.NullRecorder()
        if build_error:
            raise build_error
        recorder.set_tags(_device_tags(setup))
        state = checkpoint.restore(setup, ckpt) if ckpt else None
        folder = checkpoint.folder_for(cfg, recorder.run_id)
        checkpoints = None
        if rank.is_main:
            checkpoints = checkpoint.Checkpointer(folder, cfg, recorder.run_id, recorder.flush)
            recorder.set_tags({checkpoint.RUN_DIR_TAG: str(folder)})
        console.console.print(
            f"[bold]{name}[/]: {setup.policy.mode.name} on {setup.device}, "
            f"{setup.num_params:,} parameters, {setup.dataset_info['train_samples']} train / "
            f"{setup.dataset_info['val_samples']} val samples, {setup.total_steps} steps"
        )
        if rank.is_main:
            console.console.print(f"checkpoints: {folder}")
        progress = console.EpochProgress(cfg.trainer.progress and rank.is_main)
        with stop.deferred():  # a signal during training stops at a step boundary
            summary = train.fit(setup, recorder.log_metrics, progress, state, checkpoints, stop)
        final_step = int(summary["train/steps"])
        recorder.log_metrics(
            {k: v for k, v in summary.items() if not k.startswith(("val/", "train/"))},
            final_step,
        )
        _log_artifacts(recorder, ctx, summary, setup)
        recorder.end(tracking.FINISHED)
        where = _where(recorder)
        console.print_summary(f"{name} finished", summary, where)
        outcome = JobOutcome(name, tracking.FINISHED, recorder.run_id, summary=summary)
    except KeyboardInterrupt as err:
        if recorder:
            recorder.end(tracking.KILLED, error=f"interrupted ({err or 'KeyboardInterrupt'})")
        OUTCOMES.append(
            JobOutcome(
                name,
                tracking.KILLED,
                getattr(recorder, "run_id", None),
                exit_code=EXIT_KILLED,
                job_num=ctx.job_num,
                overrides=ctx.overrides,
            )
        )
        raise
    except Exception as err:  # every failure becomes one line and a FAILED run
        message = tracking.one_line(err)
        console.error(f"{name}: {message}" if ctx.job_num is not None else message)
        if recorder:
            try:
                recorder.set_tags(getattr(err, "tags", {}))  # e.g. diverged=true
                recorder.end(tracking.FAILED, error=message)
            except Exception as end_err:  # the store itself failed: say so, once
                console.error(
                    f"could not record the failure in MLflow: {tracking.one_line(end_err)}"
                )
        code = EXIT_CONFIG if isinstance(err, ConfigError) else EXIT_FAILED
        if recorder is None and ctx.job_num is None:
            _drop_unused_run_dir(ctx)  # a refused command leaves nothing behind
        outcome = JobOutcome(
            name, tracking.FAILED, getattr(recorder, "run_id", None), error=message, exit_code=code
        )
    finally:
        stop.uninstall()
    outcome.job_num, outcome.overrides = ctx.job_num, ctx.overrides
    OUTCOMES.append(outcome)
    if stop.requested:  # the signal came after the last step: the run finished; stop the sweep
        raise KeyboardInterrupt("SIGTERM after the last step")
    return outcome


def _drop_unused_run_dir(ctx: JobContext) -> None:
    """Remove the run folder Hydra made for a job that was refused before it ran (it holds
    only Hydra's .hydra/ record of the refused command)."""
    import shutil

    folder = ctx.output_dir
    if folder and folder.is_dir() and {p.name for p in folder.iterdir()} <= {".hydra"}:
        shutil.rmtree(folder, ignore_errors=True)
        if not any(folder.parent.iterdir()):  # the day's folder, if this was its only run
            folder.parent.rmdir()


def _finished_twin(cfg: Config, uri: str):
    """A FINISHED run of the same config in this experiment (tracking.skip_finished)."""
    from ampsweep import checkpoint

    if not cfg.tracking.skip_finished:
        return None
    try:
        resolved = checkpoint.resolve(cfg)
    except ConfigError:
        return None  # build will refuse the config with its own message
    return tracking.find_finished(uri, cfg.tracking.experiment, checkpoint.config_hash(resolved))


def _skip(twin, sweep_info, ctx: JobContext, name: str) -> JobOutcome:
    """Report a skipped job, name the run standing in for it on this launch's parent."""
    from ampsweep import sweep

    run_id = twin.info.run_id
    console.console.print(
        f"[bold]#{ctx.job_num} {name}[/]: skipped, the identical config FINISHED as run "
        f"{run_id} (tracking.skip_finished=false reruns it)"
    )
    sweep.record_skip(sweep_info, ctx.job_num, run_id)
    outcome = JobOutcome(name, tracking.FINISHED, run_id, skipped=True)
    outcome.job_num, outcome.overrides = ctx.job_num, ctx.overrides
    OUTCOMES.append(outcome)
    return outcome


def _with_world_size(cfg: Config, world_size: int) -> Config:
    """Record the processes that actually ran (torchrun may start more than trainer.nproc)."""
    from dataclasses import replace

    return replace(cfg, trainer=replace(cfg.trainer, nproc=world_size))


def _resume_point(cfg: Config, sweep_info, uri: str | None) -> dict | None:
    """Load the checkpoint trainer.resume names. In a sweep with tracking.skip_finished (the
    default), ``auto`` is implied: relaunching a sweep continues its interrupted jobs."""
    from ampsweep import checkpoint

    choice = cfg.trainer.resume
    implied = choice is None and sweep_info is not None and cfg.tracking.skip_finished
    if implied:
        choice = "auto"
    path, line, run_id = checkpoint.locate(cfg, choice, uri)
    if line and (path is not None or not implied):  # a fresh sweep job needs no word on it
        console.console.print(line)
    if path is None:
        return None
    ckpt = checkpoint.load(path)
    checkpoint.check(ckpt, cfg, path, choice, run_id)
    ckpt["path"] = str(path)
    return ckpt


def _reattach(ckpt: dict, cfg: Config, uri: str, parent_run_id: str | None, ctx: JobContext):
    """Continue the checkpoint's MLflow run: same run id, metrics from the next step on."""
    run_id, step = ckpt["run_id"], ckpt["state"]["step"]
    run = tracking.find_run(uri, run_id)
    if run is None:
        raise ConfigError(
            f"trainer.resume: {ckpt['path']} belongs to run {run_id}, which is not in the "
            f"configured store {tracking.describe_store(uri)}: resume with the tracking.uri "
            "it was recorded in"
        )
    if run.info.status == tracking.FINISHED:
        raise ConfigError(
            f"trainer.resume: run {run_id} of {ckpt['path']} already FINISHED: nothing to "
            "resume; drop trainer.resume to start a new run"
        )
    recorder = tracking.MlflowRecorder.attach(
        uri,
        run_id,
        cfg.tracking.metrics_flush_every,
        after_step=step,
        flush_seconds=cfg.tracking.metrics_flush_seconds,
    )
    tags = {"resumed_from": ckpt["path"], "resumed_at_step": str(step), **EXTRA_TAGS}
    if ctx.output_dir:
        tags["resumed_run_dir"] = str(ctx.output_dir.resolve())
    if parent_run_id:  # a relaunched sweep: the run now belongs to this launch's parent
        tags[tracking.PARENT_TAG] = parent_run_id
    old_error = run.data.tags.get("error")
    if old_error:  # the run is alive again: keep why it stopped, under another name
        tags["previous_error"] = old_error
        recorder.client.delete_tag(run_id, "error")
    recorder.set_tags(tags)
    return recorder


def _tags(cfg: Config, ctx: JobContext) -> dict[str, str]:
    from ampsweep.environment import git_state

    tags = {
        "precision": cfg.precision.name.name,
        "model": cfg.model.name.name,
        "dataset": cfg.dataset.name.name,
        "ampsweep_version": __import__("ampsweep").__version__,
        **git_state(),
        **EXTRA_TAGS,
    }
    if ctx.overrides:
        tags["overrides"] = " ".join(ctx.overrides)
    if ctx.output_dir:
        tags["run_dir"] = str(ctx.output_dir.resolve())
    if ctx.job_num is not None:
        tags["job_num"] = str(ctx.job_num)
    return tags


def _device_tags(setup) -> dict[str, str]:
    from ampsweep.environment import run_tags

    tags = run_tags(setup.device)
    tags.update({f"data.{k}": str(v) for k, v in setup.dataset_info.items()})
    tags["model.num_params"] = str(setup.num_params)
    return tags


def _log_artifacts(recorder, ctx: JobContext, summary: dict, setup) -> None:
    if isinstance(recorder, tracking.NullRecorder):
        return
    recorder.log_json(summary, "summary.json")
    setup.diagnostics.log_artifacts(recorder)  # per-layer gradient-underflow tables, if measured
    hydra_dir = ctx.output_dir / ".hydra" if ctx.output_dir else None
    if hydra_dir and hydra_dir.is_dir():
        recorder.log_artifact(hydra_dir, ".hydra")


def _where(recorder) -> str | None:
    if not recorder or recorder.run_id is None:
        return None
    return f"MLflow run {recorder.run_id} in {tracking.describe_store(recorder.uri)}"
