"""What a command and its jobs tell each other: the job's outcome, what the command shares
with its jobs (``CommandContext``), what Hydra tells a job about itself (``JobContext``), what
a job knows of itself while it runs (``JobState``, shared by its parts), and the exit codes a
job's end maps to."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from ampsweep.config.schema import Config, ConfigError
from ampsweep.engine.run_folder import NoLease
from ampsweep.runner.signals import StopRequest
from ampsweep.tracking import store
from ampsweep.tracking.recorder import NullRecorder
from ampsweep.tracking.sweep import SweepInfo

EXIT_CONFIG, EXIT_FAILED, EXIT_KILLED = 2, 1, 130


@dataclass
class PlannedJob:
    """One job as it will run: ``cfg`` typed, its components resolved and its precision mode
    resolved for this machine; ``refusal`` when this machine cannot run it (tf32 on a CPU):
    a sweep records such a job as a FAILED child run, a single command refuses it."""

    cfg: Config
    refusal: ConfigError | None = None


class Refused(Exception):  # noqa: N818 (what it is: the command was refused)
    """The command's checks failed (each problem already printed on its own line)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"refused (exit code {code})")
        self.code = code


def default_run_name(cfg: Config) -> str:
    """A run's name when ``tracking.run_name`` gives none (a sweep names its children so)."""
    return f"{cfg.precision.name}-{cfg.model.name}-{cfg.dataset.name}"


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
    # A KILLED job: whether training had begun, and the checkpoint it can resume from
    training_began: bool = False
    checkpoint: str | None = None

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
    plan: list[str] = field(default_factory=list)  # a sweep's modes by job number (estimates)
    # Each job as the command planned it, by job number (None: a single run), and the check
    # of each batch of a sweep's composed jobs (``runner.plan.SweepChecks``)
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


@dataclass
class JobState:
    """What one job knows of itself while it runs, shared by the ``Job`` and its parts (the
    ``Resumer`` that finds where it continues from, the ``RunEnd`` that ends its run): each
    field is set by the phase named beside it and read by the later ones."""

    ctx: JobContext
    command: CommandContext
    rank: Any  # engine.distributed.Rank: this process's place in a DDP run
    stop: StopRequest
    sweep: SweepInfo | None = None  # the sweep this job belongs to (None: a single run)
    name: str = "job"  # plan: the run's name, secrets masked
    uri: str = ""  # plan: the MLflow store
    tracked: bool = False  # plan: this process records the run
    recorder: Any = field(default_factory=NullRecorder)  # open: the run's recorder
    lease: Any = field(default_factory=NoLease)  # the run's checkpoint folder, while it trains
    setup: Any = None  # build: what the run's end records of its numerics
    checkpoints: Any = None  # train: rank 0's Checkpointer (its last file), once fit begins
    store_failed: str | None = None  # why training stopped for the store
