"""Secrets never reach the store or the console: the values of environment variables whose
names say they are secret are masked wherever ampsweep writes text (params, tags, run names,
artifacts, and every line its console prints: ``MaskedStream``).

An experiment's name is refused instead (``refuse_in_name``): it is the key runs are found by
(``--experiment``, a relaunch's skip, the report) and it names the artifact folders and every
URI under them, so a masked name would be another experiment than the one typed (and two
secrets would share one ``exp-***``)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY")
MIN_SECRET_CHARS = 4  # shorter values ("1", "true") would mask ordinary values everywhere
MASK = "***"


def secret_values() -> list[str]:
    """Values of the environment variables whose names contain a secret word, longest first."""
    found = {
        value
        for name, value in os.environ.items()
        if any(word in name.upper() for word in SECRET_WORDS) and len(value) >= MIN_SECRET_CHARS
    }
    return sorted(found, key=len, reverse=True)


def secret_names() -> dict[str, str]:
    """Each secret value and the name of (one of) the variables that hold it."""
    return {
        value: name
        for name, value in sorted(os.environ.items())
        if any(word in name.upper() for word in SECRET_WORDS) and len(value) >= MIN_SECRET_CHARS
    }


def refuse_in_name(key: str, value: str) -> str | None:
    """The one-line problem of a name (``tracking.experiment``) that holds a secret, or None."""
    held = [name for secret, name in secret_names().items() if secret in value]
    if not held:
        return None
    return (
        f"{key}={mask_text(value)}: holds the value of the secret environment variable "
        f"{held[0]}: an experiment's name is shown to everyone who reads the store and names "
        f"its artifact folders: choose a name without it"
    )


class MaskedStream:
    """A text stream that masks secrets in what is written to it, then writes it to the
    current ``sys.stdout``/``sys.stderr`` (looked up on each write: a test, or a redirect,
    may have replaced it since)."""

    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def _stream(self):
        return getattr(sys, self._name)

    def write(self, text: str) -> int:
        self._stream.write(mask_text(text))
        return len(text)

    def __getattr__(self, attr: str):  # flush, isatty, fileno, encoding: the stream's own
        return getattr(self._stream, attr)


def mask_text(text: str, secrets: list[str] | None = None) -> str:
    for secret in secret_values() if secrets is None else secrets:
        text = text.replace(secret, MASK)
    return text


def mask_values(values: dict[str, Any]) -> dict[str, str]:
    """``values`` as strings with every secret environment value replaced by ``***``."""
    secrets = secret_values()
    return {k: mask_text(str(v), secrets) for k, v in values.items()}


def mask_files(root: Path, secrets: list[str] | None = None) -> None:
    """Mask every secret in the text files under ``root`` (a file or a folder) and in their
    names, in place. Files that are not UTF-8 text (charts) are left as they are."""
    secrets = secret_values() if secrets is None else secrets
    if not secrets:
        return
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            pass
        else:
            masked = mask_text(text, secrets)
            if masked != text:
                path.write_text(masked, encoding="utf-8")
        name = mask_text(path.name, secrets)
        if name != path.name:
            path.rename(path.with_name(name))


def masked_copy(path: Path, into: Path) -> Path:
    """A copy of the file or folder ``path`` inside the folder ``into``, secrets masked (what
    is uploaded instead of ``path``; Hydra's own .hydra/ files hold overrides as typed)."""
    target = into / mask_text(path.name)
    if path.is_dir():
        shutil.copytree(path, target)
    else:
        shutil.copy2(path, target)
    mask_files(target)
    return target
