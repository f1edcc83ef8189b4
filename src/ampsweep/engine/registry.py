"""Registries: a model, a data set or an optimizer is one function registered by name.

A registry is a plain dict from a name to a ``Builder`` (the function and what it says about
itself), filled by a decorator next to the function::

    @MODELS.register("cnn", check=...)
    def cnn(input_shape, num_classes, *, width: int = 32, depth: int = 2) -> nn.Module: ...

The function's signature is its config. Parameters whose names the registry ``provides``
(for a model: ``input_shape``, ``num_classes``, ...) are filled in by ampsweep; every other
keyword parameter is a setting the user sets as ``<section>.<name>`` (``model.width=16``),
typed by its annotation and defaulting to its default. ``resolve`` checks a section's settings
against the signature before anything is built and reports every problem at once.

A section may instead name any callable with ``_target_: package.module.name`` (Hydra's
``instantiate`` form). ``Registry.builder`` then imports it and makes a ``Builder`` of it, so
its arguments are checked against its signature in exactly the same way.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, make_dataclass
from typing import Any

from omegaconf import OmegaConf

from ampsweep.config.messages import KIND_WORDS
from ampsweep.config.schema import ConfigError

# A check of a builder's settings: its problems, each "key=value ...: fix" without the section.
Check = Callable[[dict[str, Any]], list[str]]


@dataclass(frozen=True)
class Builder:
    kind: str  # "model", "dataset", "optimizer", "task", "loss": also the config section
    name: str
    fn: Callable
    provided: frozenset[str]  # parameters ampsweep fills in itself
    check: Check | None = None  # range and cross-field rules: (settings) -> problems
    info: dict[str, Any] = field(default_factory=dict)  # what the builder says of itself
    target: str | None = None  # the dotted path of a ``_target_`` callable
    partial: bool = False  # ``_partial_``: the callable's own inputs come at call time

    @property
    def label(self) -> str:
        """How messages name it: ``model=cnn``, or ``model._target_=mypkg.nets.make_net``."""
        return f"{self.kind}._target_={self.target}" if self.target else f"{self.kind}={self.name}"

    def parameters(self) -> dict[str, inspect.Parameter]:
        """The callable's parameters (none known for one without a signature, e.g. a C
        function: it then takes any keyword)."""
        return _parameters(self.fn) or {}

    def settings(self) -> dict[str, inspect.Parameter]:
        """The parameters a user sets: every named parameter ampsweep does not provide."""
        return {
            n: p
            for n, p in self.parameters().items()
            if n not in self.provided
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY)
        }

    def wants(self) -> set[str]:
        """The values ampsweep provides that this callable's signature asks for by name."""
        return {n for n in self.parameters() if n in self.provided}

    def takes_any(self) -> bool:
        """Whether the function takes ``**kwargs`` (then any extra setting is passed on)."""
        params = _parameters(self.fn)
        return params is None or any(p.kind == p.VAR_KEYWORD for p in params.values())

    def resolve(self, given: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """``given`` settings typed and completed with the defaults, and every problem."""
        params = self.settings()
        hints = _type_hints(self.fn)
        section = self.kind
        problems, out = [], {}
        for key, value in given.items():
            if key in self.wants():
                problems.append(
                    f"{section}.{key}={value}: ampsweep passes {key} to {self.label} from the "
                    f"data: remove {section}.{key}"
                )
                continue
            if key not in params:
                if self.takes_any():
                    out[key] = value
                    continue
                close = difflib.get_close_matches(key, list(params), n=1)
                hint = f"did you mean {section}.{close[0]}?; " if close else ""
                listing = ", ".join(params) or "none"
                problems.append(
                    f"{section}.{key}={value}: unknown key '{key}' for {self.label}: "
                    f"{hint}valid keys in {section}: {listing}"
                )
                continue
            typed, problem = _typed(section, key, value, hints.get(key, Any), params[key].default)
            if problem:
                problems.append(problem)
            else:
                out[key] = typed
        for key, p in params.items():
            if key in out or key in given:
                continue
            if p.default is inspect.Parameter.empty:
                if self.partial:  # a bound loss: its inputs (logits, targets) come at call time
                    continue
                problems.append(
                    f"{section}.{key}: {self.label} needs this setting: set it, e.g. "
                    f"{section}.{key}=..."
                )
            else:  # typed like a given value, so a default and its restatement hash alike
                typed, problem = _typed(section, key, p.default, hints.get(key, Any), p.default)
                out[key] = p.default if problem else typed
        if not problems and self.check:  # a check names keys without the section
            problems.extend(f"{section}.{p}" for p in self.check(out))
        return out, problems


def _parameters(fn: Callable) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # no signature to read (some builtins and C types)
        return None


def _type_hints(fn: Callable) -> dict[str, Any]:
    """The annotations of ``fn`` (strings under ``from __future__ import annotations``)."""
    target = fn.__init__ if inspect.isclass(fn) else fn
    try:
        return typing.get_type_hints(target)
    except Exception:  # an annotation that does not resolve here: leave the value untyped
        return {}


def _typed(section: str, key: str, value: Any, hint: Any, default: Any) -> tuple[Any, str | None]:
    """``value`` converted to ``hint`` as OmegaConf converts config values (``"3"`` -> 3), or
    the one-line problem. Annotations OmegaConf cannot type are taken as they are."""
    try:
        # Optional: the node starts empty (None) before the value is assigned and converted.
        optional = typing.Optional[hint]  # noqa: UP045 - hint may be typing.Any (no | on 3.10)
        node_type = make_dataclass("Setting", [(key, optional, field(default=None))])
        node = OmegaConf.structured(node_type)
    except Exception:  # not a type OmegaConf knows (a module, a callable): untyped
        return value, None
    try:
        setattr(node, key, value)
    except Exception as err:
        text = str(err).splitlines()[0]
        m = re.search(r"could not be converted to (\w+)", text)
        want = KIND_WORDS.get(m.group(1), m.group(1)) if m else text
        example = ""
        if default is None:  # e.g. the cnn's depth: null follows the input
            example = f", or null for the default ({section}.{key}=null)"
        elif default is not inspect.Parameter.empty:
            example = f", e.g. {section}.{key}={default}"
        return None, f"{section}.{key}={value}: expected {want}{example}"
    converted = OmegaConf.to_container(node, resolve=True)
    assert isinstance(converted, dict)  # a structured config's container
    return converted[key], None


class Registry(dict[str, Builder]):
    """Builders of one kind by name. ``provided``: the parameter names ampsweep fills in for a
    registered builder; ``target_provided``: those it fills in for a ``_target_`` callable
    (by default the same), when the callable's signature asks for them."""

    def __init__(
        self, kind: str, provided: tuple[str, ...], target_provided: tuple[str, ...] | None = None
    ):
        super().__init__()
        self.kind, self.provided = kind, frozenset(provided)
        self.target_provided = frozenset(provided if target_provided is None else target_provided)

    def builder(self, component) -> Builder:
        """The builder a config section names: its ``_target_`` callable if it has one, else
        the registered builder of its ``name``."""
        target = getattr(component, "target", None)
        if target:
            return self.for_target(target, getattr(component, "partial", False))
        return self.lookup(component.name)

    def for_target(self, target: str, partial: bool = False) -> Builder:
        fn = import_target(self.kind, target)
        provided = frozenset() if partial else self.target_provided
        return Builder(
            self.kind, target.rsplit(".", 1)[-1], fn, provided, target=target, partial=partial
        )

    def register(self, name: str, *, check: Check | None = None, **info) -> Callable:
        """Decorator: register ``fn`` under ``name`` (``info``: facts about it, e.g. a task)."""

        def add(fn: Callable) -> Callable:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self[name] = Builder(self.kind, name, fn, self.provided, check, info)
            return fn

        return add

    def lookup(self, name: str) -> Builder:
        if name not in self:
            raise ConfigError(
                f"{self.kind}.name={name}: invalid value: choose one of {', '.join(sorted(self))}"
            )
        return self[name]


# ---------------------------------------------------------------- callables named by path


def import_target(section: str, target: str) -> Callable:
    """The callable at a dotted path, imported from the installed packages or the current
    folder (as ``python -m`` would see it). One line naming which part failed otherwise."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # after the installed packages: never shadows them
    key = f"{section}._target_={target}"
    parts = target.split(".")
    module, found = None, 0
    for i in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module
        name = ".".join(parts[:i])
        try:
            module, found = importlib.import_module(name), i
            break
        except ModuleNotFoundError as err:
            if err.name is None or not (name == err.name or name.startswith(f"{err.name}.")):
                raise ConfigError(f"{key}: importing {name} failed: {err}") from None
        except Exception as err:  # the user's module raised while importing
            raise ConfigError(
                f"{key}: importing {name} failed ({type(err).__name__}: "
                f"{' '.join(str(err).split())}): fix that module"
            ) from None
    if module is None:
        raise ConfigError(
            f"{key}: no module named '{parts[0]}' (looked in the installed packages and the "
            f"current folder {os.getcwd()}): check the spelling, install the package, or run "
            "from the folder that holds it"
        )
    obj: Any = module
    for i, attr in enumerate(parts[found:], start=found):
        if not hasattr(obj, attr):
            where = ".".join(parts[:i])
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(attr, names, n=1)
            hint = f"did you mean {where}.{close[0]}?" if close else "check the name"
            raise ConfigError(f"{key}: {where} has no attribute '{attr}': {hint}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ConfigError(
            f"{key}: {target} is a {type(obj).__name__}, not a callable: name a class or a function"
        )
    return obj


# ---------------------------------------------------------------- checks builders share


def positive(*keys: str) -> Check:
    """A check that each of ``keys`` is > 0."""

    def check(settings: dict[str, Any]) -> list[str]:
        return [
            f"{k}={settings[k]} must be > 0"
            for k in keys
            if settings.get(k) is not None and not settings[k] > 0
        ]

    return check


def fraction(key: str) -> Check:
    """A check that ``key`` is in [0, 1) (a dropout probability)."""

    def check(settings: dict[str, Any]) -> list[str]:
        v = settings.get(key)
        return [] if v is None or 0.0 <= v < 1.0 else [f"{key}={v} must be in [0, 1)"]

    return check


def all_of(*checks: Check) -> Check:
    def check(settings: dict[str, Any]) -> list[str]:
        return [p for c in checks for p in c(settings)]

    return check
