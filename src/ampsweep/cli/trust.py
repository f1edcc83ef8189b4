"""Which code a config that someone else wrote may make ampsweep run.

A recorded run's ``config.yaml`` (``ampsweep reproduce``) and a run dir's saved config
(``ampsweep train --config-path RUN_DIR/.hydra``) are written by whoever made the run, and
anyone who can write to a shared store can write one. Each ``_target_`` they name (the model,
data set, optimizer, task and loss, and each of ``trainer.callbacks``) is a dotted path that
ampsweep imports and calls, so before anything is imported every one of them is checked:

* ``ampsweep.*``: only a builder registered in ampsweep's registries, or one of its callback
  classes (a path through ampsweep's own imports, ``ampsweep.cli.main.os.system``, is not one);
* the packages of the current project: the top-level packages and modules in the current
  folder (and its ``src/``) and beside the ``--config-dir`` folder, and the libraries whose
  classes configs name as components (``torch.nn``, ``torchvision.models``); the object a
  path leads to must live there too (``mypkg.os.system`` leads to ``posix.system``);
* a package the user names with ``--trust PKG``: every path under it, as the user means it.

Anything else is refused in one line that names the key, the path and the ``--trust`` that
would allow it; nothing is imported, nothing runs, nothing is recorded.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ampsweep.config.schema import Config, ConfigError

SECTIONS = ("model", "dataset", "optimizer", "task", "loss")
NOUNS = {"dataset": "data set", "trainer.callbacks": "callback"}
# Libraries whose classes and functions configs name as components (a loss of torch.nn, a
# model of torchvision): they compute, they do not run commands or load files.
LIBRARIES = ("torch.nn", "torchvision.models")
TRUST_FLAG = "--trust"


@dataclass(frozen=True)
class Trust:
    """The packages whose code a stranger's config may name."""

    project: tuple[str, ...] = ()  # top-level packages and modules of the current project
    named: tuple[str, ...] = ()  # --trust PKG: what the user vouches for

    @classmethod
    def here(cls, named: Iterable[str] = (), folders: Iterable[Path] = ()) -> Trust:
        """The project of the current folder (and ``folders``: e.g. beside --config-dir)."""
        found: set[str] = set()
        for folder in [Path.cwd(), *folders]:
            for base in (folder, folder / "src"):
                found.update(_modules_in(base))
        return cls(tuple(sorted(found)), tuple(named))

    def problem(self, key: str, path: str) -> str | None:
        """Why ``key=path`` may not run, or None. Imports only trusted code."""
        if _under(path, self.named):
            return None
        root = path.split(".")[0]
        noun = NOUNS.get(key.split("[")[0].removesuffix("._target_"), key.split(".")[0])
        refusal = (
            f"{key}={path}: not a {noun} of ampsweep or of a trusted package: pass "
            f"{TRUST_FLAG} {root} if you mean it"
        )
        if root == "ampsweep":
            return None if _obj_of(key, path) in _ampsweep_components() else refusal
        if not _under(path, (*self.project, *LIBRARIES)):
            return refusal
        obj = _obj_of(key, path)
        home = getattr(obj, "__module__", None) or ""
        if _under(home, (*self.project, *LIBRARIES)):
            return None
        leads = f"{home}.{getattr(obj, '__name__', '?')}" if home else repr(obj)
        return (
            f"{key}={path}: leads to {leads}, outside the trusted packages: pass "
            f"{TRUST_FLAG} {root} if you mean it"
        )


def _under(path: str, prefixes: Iterable[str]) -> bool:
    return any(path == p or path.startswith(f"{p}.") for p in prefixes)


def _modules_in(folder: Path) -> set[str]:
    if not folder.is_dir():
        return set()
    out = set()
    for entry in folder.iterdir():
        if entry.suffix == ".py" and entry.stem.isidentifier():
            out.add(entry.stem)
        elif entry.is_dir() and entry.name.isidentifier() and (entry / "__init__.py").is_file():
            out.add(entry.name)
    return out


def _obj_of(key: str, path: str) -> Any:
    from ampsweep.engine.registry import import_target

    return import_target(key.removesuffix("._target_"), path)


def _ampsweep_components() -> list[Any]:
    """Every builder ampsweep registers, and its callback classes."""
    from ampsweep.engine import loop
    from ampsweep.engine.components import REGISTRIES

    builders = [b.fn for registry in REGISTRIES.values() for b in registry.values()]
    hooks = [c for c in vars(loop).values() if inspect.isclass(c) and issubclass(c, loop.Callback)]
    return builders + hooks


def targets(cfg: Mapping[Any, Any], skip: Sequence[str] = ()) -> list[tuple[str, str]]:
    """``(key, dotted path)`` of every ``_target_`` a plain config names, but those of the
    sections in ``skip`` (the user's own overrides replace them)."""
    out = []
    for section in SECTIONS:
        node = cfg.get(section)
        if section not in skip and isinstance(node, Mapping) and node.get("_target_"):
            out.append((f"{section}._target_", str(node["_target_"])))
    hooks = (cfg.get("trainer") or {}).get("callbacks") or []
    if "trainer.callbacks" not in skip and isinstance(hooks, Sequence):
        for i, spec in enumerate(hooks):
            if isinstance(spec, Mapping) and spec.get("_target_"):
                out.append((f"trainer.callbacks[{i}]._target_", str(spec["_target_"])))
    return out


def overridden(overrides: Sequence[str]) -> list[str]:
    """The sections whose ``_target_`` the user's overrides set (their own choice)."""
    keys = [o.lstrip("+~").partition("=")[0] for o in overrides]
    out = [s for s in SECTIONS if f"{s}._target_" in keys or s in keys]
    return out + (["trainer.callbacks"] if "trainer.callbacks" in keys else [])


def check(cfg: Mapping[Any, Any], trust: Trust, skip: Sequence[str] = ()) -> None:
    """Raise one ConfigError naming every target of ``cfg`` that ``trust`` does not allow."""
    problems = [p for key, path in targets(cfg, skip) if (p := trust.problem(key, path))]
    if problems:
        raise ConfigError("; ".join(problems))


def check_recorded(cfg: Mapping[Any, Any], source: str) -> None:
    """A recorded config is the resolved config of a run: its sections and plain values. A
    ``hydra`` or ``defaults`` section (Hydra's callbacks, plugins, other config files) or an
    interpolation (``${oc.env:...}`` reads this machine's environment) is not one."""
    known = {f.name for f in fields(Config)}
    extra = sorted(str(k) for k in cfg if k not in known)
    if extra:
        raise ConfigError(
            f"{source}: section '{extra[0]}' is not part of a run's config (sections: "
            f"{', '.join(sorted(known))}): refusing a config that ampsweep did not record"
        )
    for key, value in _leaves(cfg, ""):
        if isinstance(value, str) and "${" in value:
            raise ConfigError(
                f"{source}: {key}={value}: an interpolation, which a recorded (resolved) "
                "config never has: refusing to resolve it here (edit the file if it is yours)"
            )


def _leaves(node: Any, prefix: str) -> Iterable[tuple[str, Any]]:
    if isinstance(node, Mapping):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(node, list | tuple):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{prefix.rstrip('.')}[{i}].")
    else:
        yield prefix.rstrip("."), node


def take_trust_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """``--trust PKG`` (or ``--trust=PKG``, repeatable) taken out of a command line."""
    rest, named, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a == TRUST_FLAG and i + 1 < len(args):
            named.append(args[i + 1])
            i += 1
        elif a.startswith(f"{TRUST_FLAG}="):
            named.append(a.split("=", 1)[1])
        else:
            rest.append(a)
        i += 1
    return rest, named
