"""Turning every way a config can fail into one line: what was wrong, the value, the fix.

Hydra's own messages span several lines and end with a hint about HYDRA_FULL_ERROR; a user who
typed ``trainer.epochs=ten`` wants one line naming the key, the value and what to type instead.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from ampsweep.config.schema import COMPONENTS, Config, Schema


def group_options(group: str, conf: Path | list[Path]) -> list[str]:
    """The options of a config group: the YAML files of its folder in each config folder
    (ampsweep's, then the user's)."""
    folders = conf if isinstance(conf, list) else [conf]
    return sorted({p.stem for folder in folders for p in (Path(folder) / group).glob("*.yaml")})


def _root(key: str) -> Any:
    """The typed config a key belongs to: a run's ``Config``, or the ``Schema`` for the
    sections only the command reads (``sweep``)."""
    return Config() if key.split(".")[0] in {f.name for f in fields(Config)} else Schema()


def _schema_default(key: str) -> Any:
    node: Any = _root(key)
    for part in key.split("."):
        if not is_dataclass(node) or part not in {f.name for f in fields(node)}:
            return None
        node = getattr(node, part)
    return node.name if isinstance(node, Enum) else node


def schema_keys(key: str) -> list[str]:
    """The keys beside ``key`` in the typed sections of the schema (empty for the open
    component sections, whose keys depend on the builder picked)."""
    node: Any = _root(key)
    for part in key.split(".")[:-1]:
        node = getattr(node, part, None)
    if not is_dataclass(node) or isinstance(node, tuple(COMPONENTS.values())):
        return []
    return [f.name for f in fields(node)]


def _override_for(key: str, overrides: list[str]) -> str:
    for o in overrides:
        if o.lstrip("~+").split("=", 1)[0] == key:
            return o.lstrip("~+")
    return key


SYNTAX = (
    "write key=value, group=option, or with -m a sweep: a,b,c, range(0,3), choice(a,b), "
    "glob(fp16*), glob(*,exclude=[fp8*])"
)
KIND_WORDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}
CALLBACKS = "trainer.callbacks"


def explain(
    err: BaseException,
    overrides: list[str],
    conf: Path | list[Path] | None,
    keys_of: Callable[[str], list[str]] = schema_keys,
) -> str:
    """One line: what was wrong, the value, and the fix. ``keys_of(full_key)`` lists the valid
    keys beside an unknown one, for the "did you mean" hint."""
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
    m = re.search(r"Could not find '([^']+)'", text) or re.search(
        r"Cannot find primary config '([^']+)'", text
    )
    if m:
        return f"--config-name {m.group(1)}: no such config: check --config-path/--config-name"
    if "Key '" in cause_text and "not in" in cause_text:
        known = keys_of(full_key)
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
        return f"{parsed}: cannot parse this override ({text.splitlines()[0]}): " + SYNTAX
    if "Error parsing override" in text:
        detail = text.splitlines()[1] if len(text.splitlines()) > 1 else ""
        bad = re.search(r"Error parsing override '([^']*)'", text)
        return (
            f"{bad.group(1) if bad else 'override'}: cannot parse this override ({detail}): "
            + SYNTAX
        )
    if "Missing mandatory value" in cause_text or "MissingMandatoryValue" in type(cause).__name__:
        return f"{full_key}: this key has no value: set it, e.g. {full_key}=..."
    merging = re.search(r"Error merging override [~+]*([^=\s]+)=", text)
    if (merging.group(1) if merging else full_key) == CALLBACKS:  # a list of a wrong shape
        shape = cause_text.rstrip(".")
        return (
            f"{_override_for(CALLBACKS, overrides)}: {shape}: write a list of mappings, each a "
            f"class and its arguments, e.g. {CALLBACKS}=[{{_target_: mypkg.hooks.Hook}}]"
        )
    if full_key:
        return f"{_override_for(full_key, overrides)}: {cause_text}"
    return " ".join(text.split())
