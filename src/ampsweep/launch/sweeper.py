"""ampsweep's sweeper and launcher for Hydra: ``hydra/sweeper=ampsweep`` and
``hydra/launcher=ampsweep``, the defaults of conf/config.yaml.

The sweeper is Hydra's basic sweeper (the same options, ``hydra.sweeper.params`` and
``max_batch_size``, and the whole override grammar: ``a,b``, ``range()``, ``choice()``,
``glob()`` read against the config groups by Hydra's config loader), with three differences:

- Its jobs run seed-major: every mode of seed 0, then every mode of seed 1, so that a change
  in the machine's load over the sweep falls on every mode alike instead of on whichever mode
  ran then (Hydra's basic sweeper varies the last override fastest). ``sweep.repeats=N``, where
  the config has it, becomes that seed sweep: seeds ``trainer.seed``, ``trainer.seed + 1``...
- Each job's config is composed once, here, and each batch of composed configs is handed to
  the task function's ``check_batch`` before it is launched (ampsweep's command types, checks
  and resolves every job there, and begins the sweep's parent run after the first batch; a
  task function without one is launched unchecked, as by Hydra's own sweeper).
- A launcher that takes composed configs (``launch_composed``: ampsweep's own) runs them as
  they are; any other is given the jobs' overrides, and composes each job where it runs it.

Whichever sweeper a command picks (ampsweep's, Hydra's basic one, optuna's), ``check_sweep``
reads its sweep first: one with no job (an empty ``range()``, a ``glob()`` that matches
nothing) or that the sweeper would refuse only once running (optuna's ``n_trials=0``, a
reversed ``interval()``) is refused with one line before the sweep dir or the parent run
exists. The values of each override come from ``config.sweeps``.

The launcher runs the jobs one after another in this process, as Hydra's basic launcher does
but from configs composed already. Given overrides (by another sweeper: optuna's trials, say)
it composes and checks each batch as it comes, as the sweeper does.

Hydra instantiates a plugin only from the ``hydra_plugins`` namespace, under the name it was
registered with: the classes say they belong to hydra_plugins.ampsweep_launcher.sweeper, which
re-exports them. Their configs: conf/hydra/sweeper/ampsweep.yaml, conf/hydra/launcher/ampsweep.yaml.
"""

from __future__ import annotations

import itertools
import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.core.config_loader import ConfigLoader
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep, ValueType
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from ampsweep.config.schema import ConfigError
from ampsweep.config.sweeps import sweep_values
from ampsweep.launch.sweep import claim_dir

PLUGIN_MODULE = "hydra_plugins.ampsweep_launcher.sweeper"
REPEATS, SEED = "sweep.repeats", "trainer.seed"
SWEEP_DIR = "hydra.sweep.dir"
log = logging.getLogger(__name__)


class AmpsweepSweeper(Sweeper):
    """Hydra's basic sweeper, seed-major, composing and checking each job once."""

    __module__ = PLUGIN_MODULE
    # Set by setup(), which Hydra calls before sweep() (Sweeper declares them Optional)
    hydra_context: HydraContext
    task_function: TaskFunction
    config: DictConfig
    launcher: Launcher

    def __init__(self, max_batch_size: int | None = None, params: dict | None = None) -> None:
        super().__init__()
        self.max_batch_size = max_batch_size  # (params: read with the sweep, by listed_jobs)

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.hydra_context, self.task_function, self.config = hydra_context, task_function, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> list[Sequence[JobReturn]]:
        jobs = listed_jobs(self.config, self.hydra_context.config_loader, arguments)
        planned = Path(str(self.config.hydra.sweep.dir)).resolve()
        made = [f for f in (planned, *planned.parents) if not f.exists()]  # what this sweep adds
        sweep_dir = self._claim_sweep_dir()
        made = [sweep_dir, *made[1:]] if made or sweep_dir != planned else []  # "-2": new
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        size = self.max_batch_size or len(jobs)
        returns: list[Sequence[JobReturn]] = []
        for start in range(0, len(jobs), size):
            batch = jobs[start : start + size]
            try:
                composed = self._compose(batch, start)  # the command's checks refuse here
            except BaseException:
                if not returns:  # refused before any job: nothing of the sweep is left
                    _remove_unused(made)
                raise
            returns.append(launch_checked(self.launcher, composed, batch, start))
        return returns

    def _compose(self, batch: list[list[str]], start: int) -> list[DictConfig]:
        return compose_batch(self.hydra_context, self.config, self.task_function, batch, start)

    def _claim_sweep_dir(self) -> Path:
        """The sweep dir, made here: unless the command names one, a sweep started in the same
        second as another (the default dir is named by the second) gets ``<dir>-2``, and every
        job is composed with it (its overrides are those of each job's composition)."""
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        hydra_overrides = self.config.hydra.overrides.hydra
        if any(str(o).startswith(f"{SWEEP_DIR}=") for o in hydra_overrides):
            sweep_dir.mkdir(parents=True, exist_ok=True)
            return sweep_dir
        sweep_dir = claim_dir(sweep_dir)
        with read_write(self.config), open_dict(self.config):
            self.config.hydra.sweep.dir = str(sweep_dir)
            hydra_overrides.append(f"{SWEEP_DIR}={sweep_dir}")
        return sweep_dir


def _remove_unused(made: list[Path]) -> None:
    """The folders this sweep made (its sweep dir first, then the parents it created), when
    no job ran in them: the sweep dir holds only multirun.yaml."""
    if not made or {p.name for p in made[0].iterdir()} > {"multirun.yaml"}:
        return
    shutil.rmtree(made[0], ignore_errors=True)
    for folder in made[1:]:  # outputs/multirun/<date>, ... while empty
        try:
            folder.rmdir()
        except OSError:  # not empty: another sweep's
            break


class AmpsweepLauncher(Launcher):
    """Hydra's basic launcher for configs composed already (and, given overrides, composing
    and checking each batch first)."""

    __module__ = PLUGIN_MODULE

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.hydra_context, self.task_function, self.config = hydra_context, task_function, config

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        batch = [list(o) for o in job_overrides]
        configs = compose_batch(
            self.hydra_context, self.config, self.task_function, batch, initial_job_idx
        )
        return self.launch_composed(configs)

    def launch_composed(self, configs: list[DictConfig]) -> list[JobReturn]:
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {len(configs)} jobs locally")
        runs = []
        for cfg in configs:
            shown = " ".join(filter_overrides(list(cfg.hydra.overrides.task)))
            log.info(f"\t#{cfg.hydra.job.num} : {shown}")
            runs.append(
                run_job(
                    hydra_context=self.hydra_context,
                    task_function=self.task_function,
                    config=cfg,
                    job_dir_key="hydra.sweep.dir",
                    job_subdir_key="hydra.sweep.subdir",
                )
            )
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs


def compose_batch(
    hydra_context: HydraContext,
    master: DictConfig,
    task_function: TaskFunction,
    batch: list[list[str]],
    start: int,
) -> list[DictConfig]:
    """Each job of a batch composed once, numbered, and handed to the task function's
    ``check_batch`` (if it has one), which may refuse the sweep by raising."""
    configs = []
    for num, overrides in enumerate(batch, start):
        cfg = hydra_context.config_loader.load_sweep_config(master, list(overrides))
        with open_dict(cfg):
            cfg.hydra.job.id = num
            cfg.hydra.job.num = num
        configs.append(cfg)
    check: Callable[[list[DictConfig]], Any] | None = getattr(task_function, "check_batch", None)
    if check is not None:
        check(configs)
    return configs


def launch_checked(
    launcher: Launcher, configs: list[DictConfig], batch: list[list[str]], start: int
) -> Sequence[JobReturn]:
    """The batch launched with its composed configs where the launcher takes them, else by
    its overrides (a launcher that runs jobs in other processes composes them there)."""
    launch_composed = getattr(launcher, "launch_composed", None)
    if launch_composed is not None:
        return launch_composed(configs)
    return launcher.launch(batch, initial_job_idx=start)


def check_sweep(cfg: DictConfig, loader: ConfigLoader) -> None:
    """The multirun of ``cfg`` checked before its sweeper starts, for any sweeper: a sweep
    that has no job, or that the sweeper would refuse only once it runs (as a traceback, after
    making its sweep dir), is refused here with one line, before anything exists. Raises
    ConfigError."""
    sweeper = cfg.hydra.sweeper
    target = str(sweeper.get("_target_", ""))
    arguments = task_overrides(cfg)
    if target == f"{PLUGIN_MODULE}.AmpsweepSweeper":
        listed_jobs(cfg, loader, arguments)
        return
    parser = OverridesParser.create(config_loader=loader)
    overrides = parser.parse_overrides([*_params(cfg), *arguments])
    if "optuna" in target:
        _check_search(overrides, sweeper)
        return
    lists = target.endswith(".BasicSweeper")  # Hydra's own; another may search an interval
    for o in overrides:
        if o.is_interval_sweep() and not lists:
            _check_interval(o)
        else:
            sweep_values(o)


def task_overrides(cfg: DictConfig) -> list[str]:
    """The command's overrides (``hydra.overrides.task``), the arguments of its sweep: as
    given, unresolved (a value may be an interpolation, ``x='${y}'``)."""
    listed = OmegaConf.to_container(cfg.hydra.overrides.task, resolve=False)
    assert isinstance(listed, list)  # a ListConfig's container
    return [str(a) for a in listed]


def listed_jobs(cfg: DictConfig, loader: ConfigLoader, arguments: list[str]) -> list[list[str]]:
    """The jobs of ampsweep's sweeper (its settings under ``hydra.sweeper`` of ``cfg``) for
    the command's sweep ``arguments``, seed-major. Raises ConfigError."""
    size = cfg.hydra.sweeper.get("max_batch_size")
    if size is not None and size < 1:
        raise ConfigError(
            f"hydra.sweeper.max_batch_size={size}: the jobs composed and checked at a time: "
            "give 1 or more, or null for all of them at once"
        )
    parser = OverridesParser.create(config_loader=loader)
    overrides = parser.parse_overrides([*_params(cfg), *arguments])
    return seed_major_jobs(with_repeats(overrides, cfg, parser))


def _params(cfg: DictConfig) -> list[str]:
    """The sweeper's own params (an experiment file's sweep) as overrides: in Hydra's order,
    they come before the command's."""
    return [f"{k}={v}" for k, v in (cfg.hydra.sweeper.get("params") or {}).items()]


def _check_search(overrides: list[Override], sweeper: DictConfig) -> None:
    """What optuna's sweeper would refuse with a traceback (or, for n_jobs=0, never end)."""
    for name, least in (("n_trials", "at least one trial"), ("n_jobs", "at least one at a time")):
        n = sweeper.get(name)
        if n is not None and n < 1:
            raise ConfigError(
                f"hydra.sweeper.{name}={n}: a search runs {least}: give 1 or more, e.g. "
                f"hydra.sweeper.{name}={20 if name == 'n_trials' else 1}"
            )
    rate = sweeper.get("max_failure_rate")
    if rate is not None and not 0 <= rate <= 1:
        raise ConfigError(
            f"hydra.sweeper.max_failure_rate={rate}: the share of trials that may fail, from 0 "
            "to 1, e.g. hydra.sweeper.max_failure_rate=0.5"
        )
    for o in overrides:
        if o.value_type == ValueType.GLOB_CHOICE_SWEEP:
            options = ",".join(v.split("=", 1)[1] for v in sweep_values(o))
            raise ConfigError(
                f"{o.input_line}: hydra/sweeper=optuna searches choice(), range() and "
                f"interval(), not glob(): list the options, e.g. {o.get_key_element()}="
                f"choice({options})"
            )
        r = o.value()
        if o.is_interval_sweep():
            _check_interval(o)
        elif isinstance(r, RangeSweep) and not r.shuffle and r.step < 0:
            raise ConfigError(
                f"{o.input_line}: a search's range() counts up: write "
                f"range({r.stop},{r.start},{-r.step})"
            )
        else:
            sweep_values(o)


def _check_interval(o: Override) -> None:
    """An ``interval(low,high)`` runs up; a log one from above 0."""
    r = o.value()
    assert isinstance(r, IntervalSweep)  # called for interval sweeps only
    assert r.start is not None and r.end is not None  # the grammar's interval(low,high)
    if r.start > r.end:
        raise ConfigError(
            f"{o.input_line}: an interval runs from its low end to its high end: write "
            f"interval({r.end:g},{r.start:g})"
        )
    if "log" in r.tags and r.start <= 0:
        raise ConfigError(
            f"{o.input_line}: a log interval needs a low end above 0, e.g. "
            f"tag(log,interval({r.end / 1000:g},{r.end:g}))"
        )


def seed_major_jobs(overrides: list[Override]) -> list[list[str]]:
    """The jobs of the basic sweeper (the product of every override's values; a key given
    twice counts once, with its last value, as in Hydra's own), with the seed's sweep as the
    slowest axis; each job's overrides stay in the order given (what its run records)."""
    axes: dict[str, list[str]] = {}
    for o in overrides:
        key = o.get_key_element()
        if o.is_interval_sweep():
            raise ConfigError(
                f"{o.input_line}: hydra/sweeper=ampsweep takes lists, range() and choice() (and "
                "glob()); interval sweeps are for a search: use hydra/sweeper=optuna"
            )
        axes[key] = sweep_values(o)
    keys = list(axes)
    order = seed_major(keys)
    combos = itertools.product(*(axes[keys[i]] for i in order))
    return [[combo[order.index(i)] for i in range(len(keys))] for combo in combos]


def seed_major(keys: Sequence[str]) -> list[int]:
    """The positions of a sweep's ``keys`` with the seed's first: the product of the axes then
    runs every mode (and every other setting) of one seed before the next seed, so the runs a
    report pairs by seed also run side by side in time."""
    return sorted(range(len(keys)), key=lambda i: keys[i] != SEED)


def with_repeats(
    overrides: list[Override], master: DictConfig, parser: OverridesParser
) -> list[Override]:
    """``sweep.repeats=N`` (read from the sweep's config, where it has that key) as a
    ``trainer.seed`` sweep of N seeds from the configured seed on (``trainer.seed=5
    sweep.repeats=3``: seeds 5, 6, 7), crossed with the rest of the sweep: the jobs are then
    exactly those of an explicit ``trainer.seed=5,6,7`` sweep, and record the seed they ran
    with. Raises ConfigError."""
    swept = {o.get_key_element() for o in overrides if o.is_sweep_override()}
    if REPEATS in swept:
        raise ConfigError(
            f"{_given(overrides, REPEATS)}: sweep.repeats cannot itself be swept: give one "
            "number, e.g. sweep.repeats=3"
        )
    repeats = OmegaConf.select(master, REPEATS, default=1)
    if repeats is None or repeats == 1:
        return overrides
    if repeats < 1:
        raise ConfigError(
            f"sweep.repeats={repeats} must be >= 1: the runs of each configuration, e.g. "
            "sweep.repeats=3 for a mean with a confidence interval"
        )
    if SEED in swept:
        raise ConfigError(
            f"sweep.repeats={repeats} with a trainer.seed sweep: each sets the seeds: give "
            f"sweep.repeats={repeats} (seeds trainer.seed, trainer.seed + 1, ...) or the seeds, "
            "e.g. trainer.seed=0,1,2, not both"
        )
    base = int(OmegaConf.select(master, SEED, default=0))
    seeds = ",".join(str(base + i) for i in range(repeats))
    kept = [o for o in overrides if o.get_key_element() not in (REPEATS, SEED)]
    return [*kept, *parser.parse_overrides([f"{SEED}={seeds}"])]


def _given(overrides: list[Override], key: str) -> str:
    line = next((o.input_line for o in overrides if o.get_key_element() == key), None)
    return line or key  # (an Override made by the parser always has its input_line)
