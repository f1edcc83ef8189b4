"""Checking a config's components against their registries, before anything is built.

``resolve`` looks up the model, data set, optimizer, task and loss a config names (a
registered builder, or the callable a ``_target_`` names, imported here) and checks each one's
settings against its signature and checks (each of ``trainer.callbacks`` too: see
``engine.callbacks``), then the rules between components (a model and a data set of the task
the config names; a component's ``fits`` rule, e.g. the GPT's block size against the data's
sequence length): every problem in one message. The config it returns has
every setting typed and every default filled in, so the logged params and the config hash say
exactly what ran.
"""

from __future__ import annotations

from dataclasses import replace

from ampsweep.config.schema import Config, ConfigError
from ampsweep.engine import callbacks
from ampsweep.engine.data import DATASETS
from ampsweep.engine.models import MODELS
from ampsweep.engine.optim import LOSSES, OPTIMIZERS
from ampsweep.engine.registry import Builder
from ampsweep.engine.tasks import TASKS, task_of

REGISTRIES = {
    "model": MODELS,
    "dataset": DATASETS,
    "optimizer": OPTIMIZERS,
    "task": TASKS,
    "loss": LOSSES,
}


def builders(cfg: Config) -> dict[str, Builder]:
    """The builder of each component of ``cfg`` (raises the first lookup or import problem)."""
    return {section: registry.builder(getattr(cfg, section)) for section, registry in
            REGISTRIES.items()}  # fmt: skip


def resolve(cfg: Config) -> Config:
    """``cfg`` with each component's settings checked, typed and completed. Idempotent."""
    problems: list[str] = []
    resolved, found_builders = {}, {}
    for section, registry in REGISTRIES.items():
        component = getattr(cfg, section)
        try:
            builder = registry.builder(component)
        except ConfigError as err:
            problems.append(str(err))
            continue
        args, found = builder.resolve(component.args)
        problems.extend(found)
        resolved[section] = replace(component, args=args)
        found_builders[section] = builder
    hooks, found = callbacks.resolve(cfg.trainer.callbacks)
    problems.extend(found)
    if problems:
        raise ConfigError("; ".join(problems))
    cfg = replace(cfg, **resolved, trainer=replace(cfg.trainer, callbacks=hooks))
    problems = task_problems(cfg, found_builders)
    for section, builder in found_builders.items():
        fits = builder.info.get("fits")  # a rule between this component and the others
        if fits and not problems:
            problems.extend(fits(getattr(cfg, section).args, cfg))
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg


def task_problems(cfg: Config, found: dict[str, Builder]) -> list[str]:
    """A registered model or data set that serves another task than the config names."""
    wanted = cfg.task.name
    serves = {s: task_of(found[s]) for s in ("model", "dataset") if s in found}
    wrong = [s for s, t in serves.items() if t is not None and t != wanted]
    if not wrong:
        return []
    said = " and ".join(
        f"{found[s].label} is a {serves[s]} {_noun(s)}" for s in serves if serves[s] is not None
    )
    choices = "; ".join(
        f"{wanted} {_noun(s)}s: {', '.join(_serving(s, wanted)) or 'none registered'}"
        for s in wrong
    )
    return [f"task={wanted}: {said}: pick a model and a data set of the same task ({choices})"]


def _noun(section: str) -> str:
    return "data set" if section == "dataset" else section


def _serving(section: str, task: str) -> list[str]:
    return sorted(n for n, b in REGISTRIES[section].items() if task_of(b) == task)
