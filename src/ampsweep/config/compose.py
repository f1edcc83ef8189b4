"""Composing configs and turning them into the typed ``Config`` that runs.

``ampsweep train`` composes every job of a command here first (each combination of a sweep),
so a bad override fails before anything runs or touches the MLflow store. A composed
``Schema`` becomes a ``Config`` in ``to_config``: the fixed sections are typed by Hydra already;
each open component section (model, dataset, optimizer) is split into the keys its kind
shares, typed here, and the builder's own settings (``args``), which the engine checks
against the builder it names.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import fields
from enum import Enum
from pathlib import Path
from typing import Any

from ampsweep.config import messages
from ampsweep.config.schema import (
    COMPONENTS,
    Config,
    ConfigError,
    Schema,
    register_configs,
    validate,
)

CONFIG_NAME = "config"


def config_dir() -> Path:
    """The shipped conf/ folder: the top-level conf/ when running from a source checkout
    (src/ampsweep/config/../../../conf), else the package data ampsweep.conf of a wheel."""
    checkout = Path(__file__).resolve().parents[3] / "conf"
    if (checkout / f"{CONFIG_NAME}.yaml").is_file():
        return checkout
    import ampsweep.conf

    for entry in ampsweep.conf.__path__:
        if (Path(entry) / f"{CONFIG_NAME}.yaml").is_file():
            return Path(entry).resolve()
    raise RuntimeError("ampsweep's conf/ folder is missing from the installation")


def group_options(group: str, conf: Path | None = None) -> list[str]:
    return messages.group_options(group, conf or config_dir())


def compose(
    overrides: list[str],
    conf: Path | None = None,
    config_name: str = CONFIG_NAME,
    return_hydra_config: bool = False,
):
    """Compose a config with Hydra's compose API; raise ConfigError with one line on failure."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    conf = Path(conf or config_dir()).resolve()
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            return hydra_compose(
                config_name, overrides=overrides, return_hydra_config=return_hydra_config
            )
    except ConfigError:
        raise
    except Exception as err:  # Hydra/OmegaConf exceptions

        def keys_of(full_key: str) -> list[str]:
            return _keys_beside(full_key, overrides, conf, config_name)

        raise ConfigError(messages.explain(err, overrides, conf, keys_of)) from None


def _keys_beside(full_key: str, overrides: list[str], conf: Path, config_name: str) -> list[str]:
    """The valid keys beside an unknown ``full_key``. In a component section they are the keys
    every option shares and those of the option picked (its YAML file lists every setting of
    its builder), read by composing the command again without the unknown key."""
    section = full_key.split(".", 1)[0]
    if section not in COMPONENTS or full_key.count(".") != 1:
        return messages.schema_keys(full_key)
    rest = [o for o in overrides if o.lstrip("~+").split("=", 1)[0] != full_key]
    try:
        return list(compose(rest, conf, config_name)[section])
    except ConfigError:
        return []


def to_config(cfg) -> Config:
    """The typed Config of a composed one; range and cross-field checks of the shared keys
    run here (one message listing every problem)."""
    from omegaconf import OmegaConf

    try:
        if OmegaConf.get_type(cfg) is not Schema:
            # A saved config without the schema in its defaults (a run's .hydra/config.yaml,
            # used with --config-path <run dir>/.hydra): type it by merging onto the schema.
            cfg = OmegaConf.merge(OmegaConf.structured(Schema), cfg)
        sections = {f.name: cfg[f.name] for f in fields(Config)}  # Schema's sweep: the command's
        typed = {
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


def _component(section: str, node) -> Any:
    """A component section as its typed config: the shared keys typed, the rest as ``args``."""
    from omegaconf import OmegaConf

    cls = COMPONENTS[section]
    raw = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    if not raw.get("name"):
        raise ConfigError(
            f"{section}: no {section} chosen (the section has no name): pick one with "
            f"{section}=<option>, e.g. {section}={cls().name}"
        )
    shared = {f.name for f in fields(cls)} - {"args"}
    typed = OmegaConf.structured(cls)
    typed = OmegaConf.merge(typed, {k: v for k, v in raw.items() if k in shared})
    obj = OmegaConf.to_object(typed)
    obj.args = {k: v for k, v in raw.items() if k not in shared}
    return obj


def load(overrides: list[str], conf: Path | None = None, config_name: str = CONFIG_NAME) -> Config:
    """Compose and validate one job's config (the builders' own settings are checked by the
    engine: ``engine.components.resolve``)."""
    cfg = compose(overrides, conf, config_name)
    return to_config(_strip_hydra(cfg))


def _strip_hydra(cfg):
    """The config without Hydra's own node (keeping the typed root)."""
    from omegaconf import open_dict

    if "hydra" in cfg:
        cfg = copy.deepcopy(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


# ---------------------------------------------------------------- sweeps


def is_hydra_override(override: str) -> bool:
    key = override.lstrip("~+").split("=", 1)[0]
    return key.startswith(("hydra.", "hydra/")) or key == "hydra"


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Every job a ``-m`` command would launch, as plain override lists (basic sweeper
    semantics: the cartesian product of the comma/range/choice sweeps)."""
    parsed = _parse(overrides)
    axes: list[list[str]] = []
    for ov in parsed:
        key = ov.get_key_element()
        if ov.is_sweep_override():
            values = list(ov.sweep_string_iterator())
            axes.append([f"{key}={v}" for v in values])
        else:
            axes.append([f"{key}={ov.get_value_element_as_str()}"])
    return [list(combo) for combo in itertools.product(*axes)]


def sweep_params_of(conf: Path, config_name: str, overrides: list[str]) -> list[str]:
    """The ``hydra.sweeper.params`` an experiment file adds (e.g. experiment=precision_sweep),
    so validation covers the jobs the sweeper will actually build."""
    cfg = compose(overrides, conf, config_name, return_hydra_config=True)
    params = cfg.hydra.sweeper.get("params") or {}
    given = {o.lstrip("~+").split("=", 1)[0] for o in overrides}
    return [f"{k}={v}" for k, v in params.items() if k not in given]


REPEATS, SEED = "sweep.repeats", "trainer.seed"


def _key(override: str) -> str:
    return override.lstrip("~+").split("=", 1)[0]


def repeat_overrides(
    overrides: list[str], conf: Path | None = None, config_name: str = CONFIG_NAME
) -> tuple[list[str], list[str], int]:
    """A sweep's ``sweep.repeats=N`` as what Hydra's sweeper runs: a ``trainer.seed`` sweep of
    N seeds from the configured seed on (``trainer.seed=5 sweep.repeats=3``: seeds 5, 6, 7),
    crossed with the rest of the sweep. Returns the overrides to drop, those to add, and N.

    The jobs are then exactly those of an explicit ``trainer.seed=0,1,2`` sweep, and record
    the seed they ran with; so both commands give the same runs and the same report."""
    conf = Path(conf or config_dir())
    plain = [o for o in overrides if not is_hydra_override(o)]
    parsed = _parse(plain)
    swept = {ov.get_key_element() for ov in parsed if ov.is_sweep_override()}
    if REPEATS in swept:
        raise ConfigError(
            f"{_given(plain, REPEATS)}: sweep.repeats cannot itself be swept: give one number, "
            "e.g. sweep.repeats=3"
        )
    first = expand_sweep(plain)[0]
    cfg = compose(first, conf, config_name)
    repeats = _repeats_of(cfg)
    if repeats == 1:
        return [], [], 1
    params = sweep_params_of(conf, config_name, first)
    if SEED in swept or any(_key(p) == SEED for p in params):
        raise ConfigError(
            f"sweep.repeats={repeats} with a trainer.seed sweep: each sets the seeds: give "
            f"sweep.repeats={repeats} (seeds trainer.seed, trainer.seed + 1, ...) or the seeds, "
            "e.g. trainer.seed=0,1,2, not both"
        )
    base = int(cfg.trainer.seed)
    seeds = ",".join(str(base + i) for i in range(repeats))
    drop = [o for o in plain if _key(o) in (REPEATS, SEED)]
    return drop, [f"{SEED}={seeds}"], repeats


def _repeats_of(cfg) -> int:
    repeats = cfg.sweep.repeats
    if repeats < 1:
        raise ConfigError(
            f"sweep.repeats={repeats} must be >= 1: the runs of each configuration, e.g. "
            "sweep.repeats=3 for a mean with a confidence interval"
        )
    return int(repeats)


def _given(overrides: list[str], key: str) -> str:
    return next((o.lstrip("~+") for o in overrides if _key(o) == key), key)


def _parse(overrides: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception as err:
        raise ConfigError(messages.explain(err, overrides, None)) from None


def validate_command(
    overrides: list[str], multirun: bool, conf: Path | None = None, config_name: str = CONFIG_NAME
) -> list[Config]:
    """Compose and validate every job of the command (a sweep's ``sweep.repeats`` already
    turned into seeds by ``repeat_overrides``). Raises ConfigError."""
    conf = Path(conf or config_dir())
    plain = [o for o in overrides if not is_hydra_override(o)]
    if not multirun:
        cfg = compose(plain, conf, config_name)
        repeats = _repeats_of(cfg)
        if repeats > 1:
            raise ConfigError(
                f"sweep.repeats={repeats} repeats the configurations of a sweep: add -m, e.g. "
                f"ampsweep train -m sweep.repeats={repeats} precision=fp32,bf16"
            )
        return [to_config(_strip_hydra(cfg))]
    jobs = expand_sweep(plain)
    extra = sweep_params_of(conf, config_name, jobs[0])
    if extra:
        jobs = [j + e for j in jobs for e in expand_sweep(extra)]
    return [load(job, conf, config_name) for job in jobs]


def as_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain nested data, as a user writes it: Enums by name, and each
    component's ``args`` beside its shared keys (``model.width``, not ``model.args.width``)."""
    from omegaconf import OmegaConf

    out = {}
    for f in fields(Config):
        value = getattr(cfg, f.name)
        if f.name in COMPONENTS:
            shared = {k.name: getattr(value, k.name) for k in fields(value) if k.name != "args"}
            plain = OmegaConf.to_container(OmegaConf.create(_names(shared)))
            out[f.name] = {**plain, **_names(value.args)}
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
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(as_dict(cfg)))
