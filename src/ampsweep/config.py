"""Composing configs, and turning every way composition can fail into one line with a fix.

Hydra's own messages span several lines and end with a hint about HYDRA_FULL_ERROR; a user who
typed ``trainer.epochs=ten`` wants one line naming the key, the value and what to type instead.
``ampsweep train`` composes every job of a command here first (each combination of a sweep), so
a bad override fails before anything runs or touches the MLflow store.
"""

from __future__ import annotations

import difflib
import itertools
import re
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from ampsweep.schema import Config, ConfigError, register_configs

CONFIG_NAME = "config"


def config_dir() -> Path:
    """The shipped conf/ folder: the top-level conf/ when running from a source checkout
    (src/ampsweep/../../conf), else the package data ampsweep.conf of an installed wheel."""
    checkout = Path(__file__).resolve().parents[2] / "conf"
    if (checkout / f"{CONFIG_NAME}.yaml").is_file():
        return checkout
    import ampsweep.conf

    for entry in ampsweep.conf.__path__:
        if (Path(entry) / f"{CONFIG_NAME}.yaml").is_file():
            return Path(entry).resolve()
    raise RuntimeError("ampsweep's conf/ folder is missing from the installation")


def group_options(group: str, conf: Path | None = None) -> list[str]:
    folder = (conf or config_dir()) / group
    return sorted(p.stem for p in folder.glob("*.yaml"))


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
        raise ConfigError(explain(err, overrides, conf)) from None


def to_config(cfg) -> Config:
    """The typed Config (range and cross-field checks run in Config.__post_init__)."""
    from omegaconf import OmegaConf

    try:
        if OmegaConf.get_type(cfg) is not Config:
            # A saved config without the schema in its defaults (a run's .hydra/config.yaml,
            # used with --config-path <run dir>/.hydra): type it by merging onto the schema.
            cfg = OmegaConf.merge(OmegaConf.structured(Config), cfg)
        obj = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(explain(err, [], None)) from None
    if not isinstance(obj, Config):
        raise ConfigError("the composed config is not an ampsweep config: check --config-name")
    return obj


def load(overrides: list[str], conf: Path | None = None, config_name: str = CONFIG_NAME) -> Config:
    """Compose and validate one job's config."""
    cfg = compose(overrides, conf, config_name)
    cfg = _strip_hydra(cfg)
    return to_config(cfg)


def _strip_hydra(cfg):
    """The config without Hydra's own node (keeping the typed root)."""
    import copy

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
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as err:
        raise ConfigError(explain(err, overrides, None)) from None
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


def validate_command(
    overrides: list[str], multirun: bool, conf: Path | None = None, config_name: str = CONFIG_NAME
) -> list[Config]:
    """Compose and validate every job of the command. Raises ConfigError."""
    conf = Path(conf or config_dir())
    plain = [o for o in overrides if not is_hydra_override(o)]
    if not multirun:
        return [load(plain, conf, config_name)]
    jobs = expand_sweep(plain)
    extra = sweep_params_of(conf, config_name, jobs[0])
    if extra:
        jobs = [j + e for j in jobs for e in expand_sweep(extra)]
    return [load(job, conf, config_name) for job in jobs]


# ---------------------------------------------------------------- messages


def _schema_default(key: str) -> Any:
    node: Any = Config()
    for part in key.split("."):
        if not is_dataclass(node) or part not in {f.name for f in fields(node)}:
            return None
        node = getattr(node, part)
    return node.name if isinstance(node, Enum) else node


def _keys_of(key: str) -> list[str]:
    node: Any = Config()
    for part in key.split(".")[:-1]:
        node = getattr(node, part, None)
    return [f.name for f in fields(node)] if is_dataclass(node) else []


def _override_for(key: str, overrides: list[str]) -> str:
    for o in overrides:
        if o.lstrip("~+").split("=", 1)[0] == key:
            return o.lstrip("~+")
    return key


KIND_WORDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}


def explain(err: BaseException, overrides: list[str], conf: Path | None) -> str:
    """One line: what was wrong, the value, and the fix."""
    text = str(err)
    cause = err.__cause__ or err
    cause_text = str(getattr(cause, "msg", None) or cause).splitlines()[0] if str(cause) else ""
    full_key = getattr(cause, "full_key", None) or ""

    m = re.search(r"Could not find '([^']+)/([^']+)'", text)
    if m:
        group, option = m.groups()
        options = group_options(group, conf) if conf else []
        hint = f": choose one of {', '.join(options)}" if options else ""
        return f"{group}={option}: no such option in config group '{group}'{hint}"
    m = re.search(r"Could not find '([^']+)'", text)
    if m:
        return f"--config-name {m.group(1)}: no such config: check --config-path/--config-name"
    if "Key '" in cause_text and "not in" in cause_text:
        known = _keys_of(full_key)
        last = full_key.split(".")[-1]
        close = difflib.get_close_matches(last, known, n=1)
        section = full_key.rsplit(".", 1)[0] if "." in full_key else "the config"
        hint = f"did you mean {section}.{close[0]}?" if close else ""
        listing = f"valid keys in {section}: {', '.join(known)}" if known else ""
        fix = "; ".join(x for x in (hint, listing) if x) or "check the spelling"
        return f"{_override_for(full_key, overrides)}: unknown key '{last}': {fix}"
    m = re.search(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", cause_text)
    if m:
        want = KIND_WORDS.get(m.group(2), m.group(2))
        default = _schema_default(full_key)
        example = f", e.g. {full_key}={default}" if default is not None else ""
        return f"{full_key}={m.group(1)}: expected {want}{example}"
    m = re.search(r"Invalid value '(.*)', expected one of \[(.*)\]", cause_text)
    if m:
        return f"{full_key}={m.group(1)}: invalid value: choose one of {m.group(2)}"
    # Hydra's compose() raises OverrideParseException carrying the override itself; its
    # message alone ("no viable alternative at input '[1'") does not say which one was bad.
    parsed = getattr(err, "override", None)
    if isinstance(parsed, str):
        return (
            f"{parsed}: cannot parse this override ({text.splitlines()[0]}): "
            "write key=value, group=option, or a sweep a,b,c with -m"
        )
    if "Error parsing override" in text:
        detail = text.splitlines()[1] if len(text.splitlines()) > 1 else ""
        bad = re.search(r"Error parsing override '([^']*)'", text)
        return (
            f"{bad.group(1) if bad else 'override'}: cannot parse this override ({detail}): "
            "write key=value, group=option, or a sweep a,b,c with -m"
        )
    if "Missing mandatory value" in cause_text or "MissingMandatoryValue" in type(cause).__name__:
        return f"{full_key}: this key has no value: set it, e.g. {full_key}=..."
    if full_key:
        return f"{_override_for(full_key, overrides)}: {cause_text}"
    return " ".join(text.split())


def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """A resolved config as flat ``a.b.c -> str`` params (lists stay one value)."""
    from omegaconf import OmegaConf

    if not isinstance(obj, dict):
        obj = OmegaConf.to_container(OmegaConf.structured(obj), enum_to_str=True, resolve=True)
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

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
