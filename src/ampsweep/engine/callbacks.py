"""The user's per-step hooks: ``trainer.callbacks``, a list in Hydra's instantiate form.

Each entry names a class with ``_target_`` and passes its arguments as sibling keys::

    trainer:
      callbacks:
        - {_target_: mypkg.hooks.StopAtLoss, below: 0.1}

``resolve`` imports each class and binds its arguments to its signature before anything runs
(the same checks a ``_target_`` model gets), and refuses a class without the hooks ``fit``
calls, every problem in one message. ``instantiate`` makes the callbacks of a resolved list.
A callback is meant to watch or stop a run, not to change what it computes, so the config hash
leaves ``trainer.callbacks`` out: a run a callback stopped resumes without it.
"""

from __future__ import annotations

import inspect
from typing import Any

from ampsweep.config.schema import ConfigError
from ampsweep.engine.registry import Builder, import_target

KEY = "trainer.callbacks"
TARGET = "_target_"
HOOKS = ("before_update", "after_step")  # what fit calls on every callback (loop.Callback)


def resolve(specs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
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


def instantiate(specs: list[dict[str, Any]]) -> list:
    """The callbacks of a resolved list (``resolve`` has checked every entry)."""
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
