"""The configuration reference page, generated from the schema when the site is built.

Every key of ``ampsweep.config.schema.Schema`` with its type, default and meaning, read from
the dataclasses themselves: the type from the annotation, the default from an instance, the
meaning from the comments beside (or directly above) the field and the class docstring. Then
each group's options (``conf/<group>/*.yaml``) with their own keys and defaults. The page is
never written by hand, so it cannot drift from the schema; ``tests/e2e/test_docs_site.py`` checks
that every key has a meaning. mkdocs runs ``on_files`` (a hook named in mkdocs.yml).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import inspect
import io
import re
import sys
import tokenize
from enum import Enum
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PAGE = "reference/configuration.md"
sys.path.insert(0, str(ROOT / "src"))  # the checkout's schema, installed or not

from ampsweep.config import schema  # noqa: E402

# Fields of a component section that are not keys of it, and the YAML spelling of the rest.
HIDDEN = {"args"}
YAML_NAMES = {field: key for key, field in schema.TARGET_KEYS.items()}


# A key: its dotted name (as typed on the command line), type, default and meaning.
Key = collections.namedtuple("Key", "name type default meaning")


def _comments(cls: type) -> dict[str, str]:
    """Each field's meaning: the comment on its line, else the comment lines directly above."""
    text = inspect.getsource(cls)
    notes: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            notes[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = text.splitlines()
    out = {}
    for node in ast.parse(text).body[0].body:
        if isinstance(node, ast.AnnAssign):
            above, prev = [], node.lineno - 1
            while prev >= 1 and lines[prev - 1].strip().startswith("#"):
                above.insert(0, notes[prev])
                prev -= 1
            out[node.target.id] = notes.get(node.lineno) or " ".join(above)
    return out


def _annotations(cls: type) -> dict[str, str]:
    tree = ast.parse(inspect.getsource(cls))
    return {
        n.target.id: ast.unparse(n.annotation)
        for n in tree.body[0].body
        if isinstance(n, ast.AnnAssign)
    }


def _type(annotation: str, cls: type) -> str:
    module = sys.modules[cls.__module__]
    kind = getattr(module, annotation.split(" |")[0], None)
    if isinstance(kind, type) and issubclass(kind, Enum):
        return "one of " + ", ".join(m.name for m in kind)
    return annotation


def _default(value: Any) -> str:
    if isinstance(value, Enum):
        return value.name
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)) and not value:
        return "[]" if isinstance(value, list) else "{}"
    return repr(value) if isinstance(value, str) else str(value)


def keys(cls: type, prefix: str) -> list[Key]:
    """The keys of one section (a dataclass), nested sections flattened."""
    notes, annotations, obj = _comments(cls), _annotations(cls), cls()
    out = []
    for f in dataclasses.fields(cls):
        if f.name in HIDDEN:
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.extend(keys(type(value), f"{prefix}{f.name}."))
            continue
        name = prefix + YAML_NAMES.get(f.name, f.name)
        out.append(Key(name, _type(annotations[f.name], cls), _default(value), notes[f.name]))
    return out


def sections() -> list[tuple[str, type]]:
    """The top-level sections of the schema, each with the dataclass that types it."""
    typed = {f.name: f for f in dataclasses.fields(schema.Schema)}
    out = []
    for name, f in typed.items():
        cls = schema.COMPONENTS.get(name) or f.default_factory().__class__
        out.append((name, cls))
    return out


def _doc(cls: type) -> str:
    doc = cls.__doc__ or ""
    if doc.startswith(cls.__name__ + "("):  # dataclasses invent one from the signature
        return ""
    return " ".join(inspect.cleandoc(doc).split())


def _cell(text: str) -> str:
    text = text.replace("|", "\\|")
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def group_options() -> list[str]:
    """Each config group's options and the keys their YAML files set (with their comments)."""
    import yaml

    out = []
    conf = ROOT / "conf"
    for group in sorted(p for p in conf.iterdir() if p.is_dir() and p.name != "hydra"):
        files = sorted(group.glob("*.yaml"))
        if not files:
            continue
        out += [f"### `{group.name}`", "", "| option | keys it sets (default) |", "|---|---|"]
        for path in files:
            data = yaml.safe_load(path.read_text()) or {}
            data = {k: v for k, v in data.items() if k != "defaults"}
            flat = _flatten(data)
            shown = ", ".join(f"`{k}`={_short(v)}" for k, v in flat.items()) or "(none)"
            out.append(f"| `{group.name}={path.stem}` | {_cell(shown)} |")
        out.append("")
    return out


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        out = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: data}


def _short(value: Any) -> str:
    text = _default(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "<!-- generated by docs/hooks/config_reference.py from src/ampsweep/config/schema.py"
        " when the site is built: do not edit -->",
        "",
        "Every key of the schema (`src/ampsweep/config/schema.py`, and the precision section in"
        " `src/ampsweep/precision/modes.py`), with its type, its default and what it means, as"
        " the schema itself says. Set any of them on the command line as `key=value`"
        " (`trainer.max_steps=100`); a misspelt key or a wrong type is refused before anything"
        " runs. A model's, a data set's or an optimizer's own settings are the keyword arguments"
        " of its builder, listed with their defaults under [Group options](#group-options) below.",
        "",
    ]
    for name, cls in sections():
        lines += [f"## `{name}`", ""]
        doc = _doc(cls)
        if doc:
            lines += [_cell(doc), ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for k in keys(cls, f"{name}."):
            lines.append(
                f"| `{k.name}` | {_cell(k.type)} | `{_cell(k.default)}` | {_cell(k.meaning)} |"
            )
        lines.append("")
    lines += [
        "## Group options",
        "",
        "The options of each config group (`group=option`) and the keys each one's YAML file"
        " sets, from `conf/`. Experiments (`experiment=...`) set keys of several groups.",
        "",
        *group_options(),
    ]
    return "\n".join(lines) + "\n"


def on_files(files, config):
    """mkdocs hook: add the generated page to the site's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files
