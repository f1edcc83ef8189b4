"""Composing configs and turning them into the typed ``Config`` that runs.

``ampsweep train`` composes a single run's job here first, so a bad override fails before
anything runs or touches the MLflow store (a sweep's jobs are composed by Hydra's sweeper:
``launch.sweeper``). A composed
``Schema`` becomes a ``Config`` in ``to_config``: the fixed sections are typed by Hydra already
(and a key added to them with ``+``, which nothing would read, is refused); each open component
section (model, dataset, optimizer, task, loss) is split into the keys its kind shares, typed
here, its ``_target_`` (and ``_partial_``) if it names a callable, and the builder's own
settings (``args``), which the engine checks against the builder or callable it names.

The user's config folders (``--config-dir``, ``hydra.searchpath``) are search path entries
passed to every composition, so their group files sit beside ampsweep's.
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import re
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig, OmegaConf, open_dict

import ampsweep.conf
from ampsweep.config import messages
from ampsweep.config.schema import (
    COMPONENT_META,
    COMPONENTS,
    TARGET_KEYS,
    Config,
    ConfigError,
    Schema,
    register_configs,
    validate,
)

CONFIG_NAME = "config"
META = (*(f for f in COMPONENT_META if f != "name"),)  # "name" is shown with the shared keys


def config_dir() -> Path:
    """The shipped conf/ folder: the top-level conf/ when running from a source checkout
    (src/ampsweep/config/../../../conf), else the package data ampsweep.conf of a wheel."""
    checkout = Path(__file__).resolve().parents[3] / "conf"
    if (checkout / f"{CONFIG_NAME}.yaml").is_file():
        return checkout
    for entry in ampsweep.conf.__path__:
        if (Path(entry) / f"{CONFIG_NAME}.yaml").is_file():
            return Path(entry).resolve()
    raise RuntimeError("ampsweep's conf/ folder is missing from the installation")


def group_options(group: str, conf: Path | None = None, search: Sequence[str] = ()) -> list[str]:
    """The options of a config group: ampsweep's files and those of the user's folders."""
    return messages.group_options(group, [conf or config_dir(), *search_folders(search)])


# ---------------------------------------------------------------- the user's config folders


def search_entry(folder: str | Path) -> str:
    """A folder as an entry of Hydra's search path (``file:///abs/path``)."""
    text = str(folder)
    if "://" in text:
        return text
    return f"file://{Path(text).expanduser().resolve()}"


def search_folders(search: Sequence[str]) -> list[Path]:
    """The folders of search path entries (``file://`` ones, and ``pkg://`` ones whose
    package imports), for listing a group's options."""
    out = []
    for entry in search:
        scheme, _, rest = entry.rpartition("://")
        if scheme in ("", "file"):
            out.append(Path(rest))
        elif scheme == "pkg":
            try:
                spec = importlib.util.find_spec(rest.replace("/", "."))
            except (ImportError, ValueError):
                spec = None
            out += [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return out


def searchpath_of(overrides: list[str]) -> list[str]:
    """The entries of a ``hydra.searchpath=[a,b]`` override, if the command has one."""
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key == "hydra.searchpath":
            items = value.strip().strip("[]")
            return [search_entry(i.strip().strip("'\"")) for i in items.split(",") if i.strip()]
    return []


def saved_config_overrides(conf: Path, config_name: str, given: Sequence[str]) -> list[str]:
    """For a primary config that is a run's saved job config (``--config-path RUN_DIR/.hydra
    --config-name config``: no defaults list, no hydra section), what ampsweep's own primary
    config adds to a run, as overrides read from it: ampsweep's conf/ on the search path (its
    groups and sweeper), its logging, and its run and sweep dirs. Without them Hydra would use
    its own defaults (a run dir under outputs/<date>/<time>/ with a job log file, a logging
    handler on the console). None for any other primary config, or those ``given`` already."""
    path = Path(conf) / f"{config_name}.yaml"
    ours = config_dir() / f"{CONFIG_NAME}.yaml"
    if not path.is_file() or path.resolve() == ours.resolve():
        return []
    saved = OmegaConf.load(path)
    if "defaults" in saved or "hydra" in saved:
        return []
    primary = OmegaConf.load(ours)
    out = [] if searchpath_of(list(given)) else [f"hydra.searchpath=[{search_entry(config_dir())}]"]
    for entry in primary.defaults:
        for key, option in entry.items() if not isinstance(entry, str) else ():
            if key.startswith("override hydra/"):
                out.append(f"{key.removeprefix('override ')}={option}")
    settings = flatten(OmegaConf.to_container(primary.hydra, resolve=False), "hydra.")
    out += [f"{key}={_quoted(value)}" for key, value in settings.items()]
    taken = {override_key(o) for o in given}
    return [o for o in out if override_key(o) not in taken]


def override_key(override: str) -> str:
    """The key an override sets, adds or deletes (``+a.b=1``, ``~a.b``: ``a.b``)."""
    return override.lstrip("~+").split("=", 1)[0]


def _quoted(value: str) -> str:
    """A value as Hydra's override grammar reads it back (interpolations kept)."""
    if re.fullmatch(r"[\w./-]+", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


# A builder's free-form settings (e.g. ``model.args`` of model=timm) take keys no YAML file
# lists: ``model.args.drop_rate=0.1`` is written without Hydra's ``+`` and means "add or set".
_FREE_FORM = re.compile(rf"^({'|'.join(COMPONENTS)})\.args\.[\w.]+=")


def normalise_overrides(args: list[str]) -> list[str]:
    """The command line with each ``<section>.args.<key>=value`` made Hydra's add-or-set
    ``++<section>.args.<key>=value``."""
    return [f"++{a}" if _FREE_FORM.match(a) else a for a in args]


def compose(
    overrides: list[str],
    conf: Path | None = None,
    config_name: str = CONFIG_NAME,
    return_hydra_config: bool = False,
    search: Sequence[str] = (),
):
    """Compose a config with Hydra's compose API; raise ConfigError with one line on failure.
    ``search``: more config folders (Hydra search path entries, e.g. the user's --config-dir),
    whose group files sit beside ampsweep's."""
    register_configs()
    conf = Path(conf or config_dir()).resolve()
    search = [*search, *searchpath_of(overrides)]
    given = [o for o in normalise_overrides(overrides) if not _is_searchpath(o)]
    hydra_overrides = [f"hydra.searchpath=[{','.join(search)}]"] if search else []
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            return hydra_compose(
                config_name,
                overrides=[*given, *hydra_overrides],
                return_hydra_config=return_hydra_config,
            )
    except ConfigError:
        raise
    except Exception as err:  # Hydra/OmegaConf exceptions
        raise composition_error(err, given, conf, config_name, search) from None


def composition_error(
    err: Exception, overrides: list[str], conf: Path, config_name: str, search: Sequence[str]
) -> ConfigError:
    """Hydra's (or OmegaConf's) error composing ``overrides`` as one line: the override, the
    value and the fix (``search``: the search path entries beside ``conf``)."""
    given = [o for o in overrides if not _is_searchpath(o)]

    def keys_of(full_key: str) -> list[str]:
        return _keys_beside(full_key, given, conf, config_name, search)

    folders = [Path(conf), *search_folders(search)]
    return ConfigError(messages.explain(err, given, folders, keys_of))


def _is_searchpath(override: str) -> bool:
    return override_key(override) == "hydra.searchpath"


def _keys_beside(
    full_key: str, overrides: list[str], conf: Path, config_name: str, search: Sequence[str]
) -> list[str]:
    """The valid keys beside an unknown ``full_key``. In a component section they are the keys
    every option shares and those of the option picked (its YAML file lists every setting of
    its builder), read by composing the command again without the unknown key."""
    section = full_key.split(".", 1)[0]
    if section not in COMPONENTS or full_key.count(".") != 1:
        return messages.schema_keys(full_key)
    rest = [o for o in overrides if o.lstrip("~+").split("=", 1)[0] != full_key]
    try:
        return list(compose(rest, conf, config_name, search=search)[section])
    except ConfigError:
        return []


def to_config(cfg) -> Config:
    """The typed Config of a composed one; range and cross-field checks of the shared keys
    run here (one message listing every problem)."""
    try:
        if OmegaConf.get_type(cfg) is not Schema:
            # A saved config without the schema in its defaults (a run's .hydra/config.yaml,
            # used with --config-path <run dir>/.hydra): type it by merging onto the schema.
            cfg = OmegaConf.merge(OmegaConf.structured(Schema), cfg)
        _refuse_unknown_keys(cfg)
        sections = {f.name: cfg[f.name] for f in fields(Config)}  # Schema's sweep: the command's
        typed: dict[str, Any] = {
            name: _component(name, node) if name in COMPONENTS else OmegaConf.to_object(node)
            for name, node in sections.items()
        }
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(messages.explain(err, [], None)) from None
    config = Config(**typed)
    problems = validate(config)
    if problems:
        raise ConfigError("; ".join(problems))
    return config


def _refuse_unknown_keys(cfg) -> None:
    """A key added with ``+`` to a typed section (``+trainer.epochz=3``) or to the root is
    kept by Hydra and would be silently ignored: refuse it, naming the keys that exist. (The
    component sections are open: their keys are checked against the builder they name.)"""

    def walk(node, cls: type, prefix: str) -> None:
        known = {f.name: f for f in fields(cls)}
        for key in node.keys():
            if key == "hydra" and not prefix:
                continue
            if key not in known:
                close = [f"{prefix}{c}" for c in difflib.get_close_matches(str(key), known, n=1)]
                if not prefix:  # at the top: perhaps a section's key without its section
                    inner: dict[str, str] = {}  # a typed section's key -> section.key
                    for f in fields(Schema):
                        sub = f.default_factory
                        if isinstance(sub, type) and is_dataclass(sub) and f.name not in COMPONENTS:
                            inner.update({g.name: f"{f.name}.{g.name}" for g in fields(sub)})
                    close = [inner[c] for c in difflib.get_close_matches(str(key), inner, n=1)]
                hint = f"did you mean {close[0]}?; " if close else ""
                where = f"in {prefix.rstrip('.')}" if prefix else "at the top"
                raise ConfigError(
                    f"{prefix}{key}={node.get(key)}: unknown key '{key}': "
                    f"{hint}valid keys {where}: {', '.join(known)}"
                )
            value, sub = node.get(key), known[key].default_factory
            if cls is not Schema or key not in COMPONENTS:
                if isinstance(value, DictConfig) and is_dataclass(sub):
                    walk(value, sub, f"{prefix}{key}.")

    walk(cfg, Schema, "")


def _component(section: str, node) -> Any:
    """A component section as its typed config: the shared keys typed, ``_target_`` (and
    ``_partial_``) kept apart, the rest as ``args``."""
    cls = COMPONENTS[section]
    raw = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{section}={raw}: not a section of settings: pick one with {section}=<option>"
        )
    own = {f.name for f in fields(cls)}
    meta = {}
    for key in [k for k in raw if isinstance(k, str) and k.startswith("_") and k.endswith("_")]:
        field_name = TARGET_KEYS.get(key)
        if field_name not in own:
            takes = [k for k, f in TARGET_KEYS.items() if f in own]
            fix = (
                f"{section} takes {' and '.join(takes)} (Hydra's other special keys are not "
                "used: pass arguments by name)"
                if takes
                else f"pick a registered {section} with {section}=<option>"
            )
            raise ConfigError(f"{section}.{key}={raw[key]}: not supported: {fix}")
        meta[field_name] = raw.pop(key)
    target = meta.get("target")
    if target is not None and not _is_dotted_path(target):
        raise ConfigError(
            f"{section}._target_={target}: not a dotted path to a callable: write it as "
            "package.module.name, e.g. torchvision.models.resnet18"
        )
    if meta.get("partial") and target is None:
        raise ConfigError(f"{section}._partial_: has no _target_ to bind: add {section}._target_")
    if target is not None and not raw.get("name"):
        raw["name"] = target.rsplit(".", 1)[-1]  # the label of runs, tags and params
    if not raw.get("name"):
        raise ConfigError(
            f"{section}: no {section} chosen (the section has no name): pick one with "
            f"{section}=<option>, e.g. {section}={cls().name}"
        )
    shared = own - {"args", *TARGET_KEYS.values()}
    typed = OmegaConf.structured(cls)
    typed = OmegaConf.merge(typed, {k: v for k, v in raw.items() if k in shared})
    obj: Any = OmegaConf.to_object(typed)  # an instance of cls
    obj.args = {k: v for k, v in raw.items() if k not in shared}
    for field_name, value in meta.items():
        setattr(obj, field_name, value)
    return obj


def _is_dotted_path(target: Any) -> bool:
    parts = target.split(".") if isinstance(target, str) else []
    return len(parts) >= 2 and all(p.isidentifier() for p in parts)


def load(
    overrides: list[str],
    conf: Path | None = None,
    config_name: str = CONFIG_NAME,
    search: Sequence[str] = (),
) -> Config:
    """Compose and validate one job's config (the builders' own settings are checked by the
    engine: ``engine.components.resolve``)."""
    cfg = compose(overrides, conf, config_name, search=search)
    return to_config(_strip_hydra(cfg))


def _strip_hydra(cfg):
    """The config without Hydra's own node (keeping the typed root)."""
    if "hydra" in cfg:
        cfg = copy.deepcopy(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


def as_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain nested data, as a user writes it: Enums by name, and each
    component's ``args`` beside its shared keys (``model.width``, not ``model.args.width``),
    with its ``_target_`` (and ``_partial_``) when it names a callable."""
    out: dict[str, Any] = {}
    for f in fields(Config):
        value = getattr(cfg, f.name)
        if f.name in COMPONENTS:
            shared = {k.name: getattr(value, k.name) for k in fields(value) if k.name not in META}
            plain = OmegaConf.to_container(OmegaConf.create(_names(shared)))
            assert isinstance(plain, dict)  # made from a dict
            special = {
                key: getattr(value, name)
                for key, name in TARGET_KEYS.items()
                if getattr(value, name, None)  # only when set: _target_, _partial_: true
            }
            out[f.name] = {**special, **plain, **_names(value.args)}
        else:
            out[f.name] = OmegaConf.to_container(OmegaConf.structured(value), enum_to_str=True)
    return out


def _names(value: Any) -> Any:
    """Enums by name, recursively (OmegaConf.create keeps Enum members as they are)."""
    if isinstance(value, Enum):
        return value.name
    if isinstance(value, dict):
        return {k: _names(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_names(v) for v in value]
    return value


def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """A config as flat ``a.b.c -> str`` params (lists stay one value)."""
    if isinstance(obj, Config):
        obj = as_dict(obj)
    out: dict[str, str] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = "null" if value is None else str(value)
    return out


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(as_dict(cfg)))
