"""One job: config in, a trained model and a finished MLflow run out.

compose (Hydra) -> validate (``config.to_config``) -> build (``train.build``) -> train
(``train.fit``) -> evaluate -> record (``tracking``). Failures never escape as tracebacks:
the run is ended FAILED with a one-line ``error`` tag (KILLED on Ctrl-C), the message is
printed, and the outcome says how the job ended so the command can exit non-zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ampsweep import console, tracking
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


# Outcomes of the jobs this process ran (Hydra's basic launcher runs a sweep in-process).
OUTCOMES: list[JobOutcome] = []


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
    """Run one job from a composed config node (or a Config)."""
    from ampsweep import sweep  # the sweep context (parent run) when this job is part of one

    ctx = ctx or JobContext()
    end_stray_mlflow_run()
    recorder = None
    name = "job"
    sweep_info = sweep.job_sweep_info(ctx) if parent_run_id is None else None
    if sweep_info:
        parent_run_id = sweep_info.parent_run_id
    try:
        cfg = node if isinstance(node, Config) else to_config(node)
        name = cfg.tracking.run_name or default_run_name(cfg)
        use_mlflow = cfg.tracking.backend == Tracker.mlflow
        uri = tracking.resolve_uri(cfg.tracking.uri)
        if use_mlflow:
            tracking.check_store(uri)
        from ampsweep import train  # torch is imported only once the config is known good

        setup, build_error = None, None
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
        if use_mlflow:
            recorder = tracking.MlflowRecorder.start(
                cfg.tracking, name, tags=_tags(cfg, ctx), parent_run_id=parent_run_id, uri=uri
            )
            recorder.log_params(flatten(cfg))
            recorder.log_text(to_yaml(cfg), "config.yaml")
        else:
            recorder = tracking.NullRecorder()
        if build_error:
            raise build_error
        recorder.set_tags(_device_tags(setup))
        console.console.print(
            f"[bold]{name}[/]: {setup.policy.mode.name} on {setup.device}, "
            f"{setup.num_params:,} parameters, {setup.dataset_info['train_samples']} train / "
            f"{setup.dataset_info['val_samples']} val samples, {setup.total_steps} steps"
        )
        progress = console.EpochProgress(cfg.trainer.progress)
        summary = train.fit(setup, recorder.log_metrics, progress)
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
    except KeyboardInterrupt:
        if recorder:
            recorder.end(tracking.KILLED, error="interrupted (KeyboardInterrupt)")
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
                recorder.end(tracking.FAILED, error=message)
            except Exception as end_err:  # the store itself failed: say so, once
                console.error(
                    f"could not record the failure in MLflow: {tracking.one_line(end_err)}"
                )
        code = EXIT_CONFIG if isinstance(err, ConfigError) else EXIT_FAILED
        outcome = JobOutcome(
            name, tracking.FAILED, getattr(recorder, "run_id", None), error=message, exit_code=code
        )
    outcome.job_num, outcome.overrides = ctx.job_num, ctx.overrides
    OUTCOMES.append(outcome)
    return outcome


def _tags(cfg: Config, ctx: JobContext) -> dict[str, str]:
    from ampsweep.environment import git_state

    tags = {
        "precision": cfg.precision.name.name,
        "model": cfg.model.name.name,
        "dataset": cfg.dataset.name.name,
        "ampsweep_version": __import__("ampsweep").__version__,
        **git_state(),
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
    hydra_dir = ctx.output_dir / ".hydra" if ctx.output_dir else None
    if hydra_dir and hydra_dir.is_dir():
        recorder.log_artifact(hydra_dir, ".hydra")


def _where(recorder) -> str | None:
    if not recorder or recorder.run_id is None:
        return None
    return f"MLflow run {recorder.run_id} in {tracking.describe_store(recorder.uri)}"
