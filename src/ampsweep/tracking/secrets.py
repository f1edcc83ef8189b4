"""Secrets never reach the store or the console: the values of environment variables whose
names say they are secret are masked wherever ampsweep writes text (params, tags, run names,
artifacts, messages)."""

from __future__ import annotations

import os
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


def mask_text(text: str, secrets: list[str] | None = None) -> str:
    for secret in secret_values() if secrets is None else secrets:
        text = text.replace(secret, MASK)
    return text


def mask_values(values: dict[str, Any]) -> dict[str, str]:
    """``values`` as strings with every secret environment value replaced by ``***``."""
    secrets = secret_values()
    return {k: mask_text(str(v), secrets) for k, v in values.items()}
