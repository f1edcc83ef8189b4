"""Checking a config's components against their registries, before anything is built.

``resolve`` looks up the model, data set, optimizer, task and loss a config names (a
registered builder, or the callable a ``_target_`` names, imported here) and checks each one's
settings against its signature and checks (each of ``trainer.callbacks`` too: see
below), then the rules between components (a model and a data set of the task
the config names; a component's ``fits`` rule, e.g. the GPT's block size against the data's
sequence length): every problem in one message. The config it returns has
every setting typed and every default filled in, so the logged params and the config hash say
exactly what ran.

The user's per-step hooks: ``trainer.callbacks``, a list in Hydra's instantiate form.

Each entry names a class with ``_target_`` and passes its arguments as sibling keys::

    trainer:
      callbacks:
        - {_target_: mypkg.hooks.StopAtLoss, below: 0.1}

``resolve_callbacks`` imports each class and binds its arguments to its signature before
anything runs (the same checks a ``_target_`` model gets), and refuses a class without the hooks
``fit`` calls, every problem in one message. ``instantiate_callbacks`` makes the callbacks of a
resolved list.
A callback is meant to watch or stop a run, not to change what it computes, so the config hash
leaves ``trainer.callbacks`` out: a run a callback stopped resumes without it.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

from ampsweep.config.schema import Config, ConfigError
from ampsweep.engine import tasks
from ampsweep.engine.data import DATASETS
from ampsweep.engine.models import MODELS
from ampsweep.engine.optim import LOSSES, OPTIMIZERS
from ampsweep.engine.registry import Builder, import_target
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
    return {
        section: registry.builder(getattr(cfg, section)) for section, registry in REGISTRIES.items()
    }


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
    hooks, found = resolve_callbacks(cfg.trainer.callbacks)
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
    wrong = [s for s in serves if not tasks.serves(found[s], wanted, s)]
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
    return sorted(n for n, b in REGISTRIES[section].items() if tasks.serves(b, task, section))


# ---------------------------------------------------------------- the user's callbacks

KEY = "trainer.callbacks"
TARGET = "_target_"
HOOKS = ("before_update", "after_step")  # what fit calls on every callback (loop.Callback)


def resolve_callbacks(specs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Each entry with its arguments typed and its defaults filled in, and every problem."""
    resolved, problems = [], []
    for index, spec in enumerate(specs):
        try:
            builder = builder_of(index, spec)
        except ConfigError as err:
            problems.append(str(err))
            continue
        args, found = builder.resolve(_arguments(spec))
        problems.extend(found)
        resolved.append({TARGET: builder.target, **args})
    return resolved, problems


def instantiate_callbacks(specs: list[dict[str, Any]]) -> list:
    """The callbacks of a resolved list (``resolve_callbacks`` has checked every entry)."""
    return [builder_of(i, spec).fn(**_arguments(spec)) for i, spec in enumerate(specs)]


def builder_of(index: int, spec: dict[str, Any]) -> Builder:
    """The entry's class as a Builder: its arguments are then checked like a component's."""
    key = f"{KEY}[{index}]"
    target = spec.get(TARGET)
    special = [k for k in spec if k != TARGET and k.startswith("_") and k.endswith("_")]
    if special:
        raise ConfigError(
            f"{key}.{special[0]}={spec[special[0]]}: not supported: a callback takes _target_ "
            "and its arguments by name"
        )
    if not isinstance(target, str) or not target:
        raise ConfigError(
            f"{key}={spec}: no _target_: name the callback's class, e.g. "
            f"{KEY}=[{{_target_: mypkg.hooks.MyCallback}}]"
        )
    cls = import_target(key, target)
    _check_hooks(f"{key}._target_={target}", cls)
    return Builder(key, target.rsplit(".", 1)[-1], cls, frozenset(), target=target)


def _check_hooks(label: str, cls: Any) -> None:
    if not inspect.isclass(cls):
        raise ConfigError(
            f"{label}: a {type(cls).__name__}, not a class: name a class with "
            f"{' and '.join(HOOKS)} (e.g. a subclass of ampsweep.engine.loop.Callback)"
        )
    missing = [h for h in HOOKS if not callable(getattr(cls, h, None))]
    if missing:
        raise ConfigError(
            f"{label}: {cls.__name__} has no {' or '.join(missing)} method: a callback has "
            "before_update(view) and after_step(state): subclass ampsweep.engine.loop.Callback, "
            "whose no-op hooks stand in for the ones you leave out"
        )


def _arguments(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k != TARGET}
