"""A command's plan: each job it runs composed (by Hydra, once), typed, checked against its
builders and resolved once, precision included, before anything runs or touches the MLflow
store. The job runner (``runner.job``) and ``engine.build`` take the planned config as it is.

A sweep's jobs are planned batch by batch as the sweeper composes them (``SweepChecks``, the
task function's ``check_batch``): every job of ampsweep's sweeper at once, a search's trials
(hydra/sweeper=optuna) as each batch comes; the sweep's parent run is begun after the first
batch is checked. Every problem is said, one line each, and the command exits 2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf, open_dict

from ampsweep import console
from ampsweep.config.compose import to_config
from ampsweep.config.schema import Config, ConfigError, Tracker
from ampsweep.engine import components
from ampsweep.engine.build import preflight, resolve_precision
from ampsweep.engine.run_folder import root_of
from ampsweep.errors import FaultError
from ampsweep.runner.context import EXIT_CONFIG, PlannedJob, Refused
from ampsweep.tracking import access, journal, store
from ampsweep.tracking.secrets import refuse_in_name


def plan(configs: list[Config], record: bool = True) -> list[PlannedJob]:
    """Check the typed jobs of a command together and resolve each once; open (create or
    migrate) each MLflow store once, here, before jobs in other processes write to it.
    Raises ConfigError (a config problem) or FaultError (the store cannot be written)."""
    refused = [refuse_in_name("tracking.experiment", c.tracking.experiment) for c in configs]
    first = min((r for r in refused if r is not None), default=None)
    if first is not None:
        raise ConfigError(first)
    configs = [components.resolve(c) for c in configs]
    preflight(configs)  # e.g. fp8 without torchao, or on a model it would not change
    if record:
        _open_stores(configs)
    return [_resolved(c) for c in configs]


def plan_job(cfg: Config) -> PlannedJob:
    """One typed job resolved, where nothing planned it (a job run in its own process plans
    itself from the config it is given: precision=auto depends on the machine it runs on).
    A refusal (of a builder or of this machine) is the planned job's."""
    try:
        return _resolved(components.resolve(cfg))
    except ConfigError as err:
        return PlannedJob(cfg, err)


def _resolved(cfg: Config) -> PlannedJob:
    try:
        return PlannedJob(resolve_precision(cfg))
    except ConfigError as err:
        return PlannedJob(cfg, err)


def _open_stores(configs: list[Config]) -> None:
    stores = {
        store.resolve_uri(c.tracking.uri): store.uri_key(c.tracking.uri)
        for c in configs
        if c.tracking.backend == Tracker.mlflow
    }
    for uri, key in sorted(stores.items()):
        store.check(uri, key)  # an unreachable server fails here, before training
        store.prepare(uri)
        roots = [root_of(c) for c in configs if store.resolve_uri(c.tracking.uri) == uri]
        for line in journal.replay_all(uri, roots):  # what an outage kept, written now
            console.note(line)
    experiments = {
        (store.resolve_uri(c.tracking.uri), c.tracking.experiment)
        for c in configs
        if c.tracking.backend == Tracker.mlflow
    }
    for uri, experiment in sorted(experiments):
        access.check_write(uri, experiment, stores[uri])  # a login the server refuses


def typed(node: DictConfig) -> Config:
    """A composed job config (Hydra's node left out) as the typed Config. Raises ConfigError."""
    cfg = node.copy()
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return to_config(cfg)


@dataclass
class SweepChecks:
    """The ``check_batch`` of a sweep's task function: types, checks and plans each batch of
    composed jobs into ``planned`` (by job number); ``launch_checks(nodes, configs)`` adds
    the command's checks of the launcher (process counts, SLURM), and ``on_first(nodes,
    configs)`` begins the sweep once its first batch passed. Raises Refused."""

    record: bool
    launch_checks: Callable[[list[DictConfig], list[Config]], None]
    on_first: Callable[[list[DictConfig], list[Config]], None]
    on_more: Callable[[list[Config]], None]
    planned: dict[int | None, PlannedJob] = field(default_factory=dict)
    batches: int = 0

    def __call__(self, nodes: list[DictConfig]) -> None:
        configs, problems = [], []
        for node in nodes:
            try:
                configs.append(typed(node))
            except ConfigError as err:
                problems.append(str(err))
        try:
            if not problems:
                self.launch_checks(nodes, configs)
                jobs = plan(configs, record=self.record and not self.batches)
        except ConfigError as err:
            problems.append(str(err))
        except FaultError as err:  # the store cannot be written (locked, full)
            console.error(str(err))
            raise Refused(1) from None
        if problems:
            for line in dict.fromkeys(problems):  # each once, in order
                console.error(line)
            raise Refused(EXIT_CONFIG)
        nums = [int(OmegaConf.select(n, "hydra.job.num")) for n in nodes]
        self.planned.update(zip(nums, jobs, strict=True))
        planned = [j.cfg for j in jobs]
        if self.batches:
            self.on_more(planned)
        else:
            self.on_first(nodes, planned)
        self.batches += 1
