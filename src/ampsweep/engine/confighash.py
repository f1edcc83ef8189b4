"""A run's config identity: the keys that may differ on resume (``NOT_HASHED``), the hash of
the rest, and the checkpoint folder it keys; how a checkpoint's stored config differs from
this one.

Where: ``<trainer.checkpoint_dir or outputs/checkpoints>/<config hash>/<run id>/step-N.pt``.
Keying the folder by the config hash lets ``trainer.resume=auto`` find the newest checkpoint of
the same config after a relaunch, and lets sweep jobs with different configs never collide.
No torch here: it is plain config.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from ampsweep.config.compose import flatten
from ampsweep.config.schema import Config

DEFAULT_ROOT = Path("outputs") / "checkpoints"
# Keys that say only where things are written, how often, how they are shown, or what
# watches the run (trainer.callbacks: a run a callback stopped resumes without it): they may
# differ between a checkpoint and the command resuming it, and they are left out of the hash.
NOT_HASHED = (
    "trainer.resume",
    "trainer.callbacks",
    "trainer.checkpoint_dir",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.progress",
    "tracking.uri",
    "tracking.artifact_root",
    "tracking.metrics_flush_every",
    "tracking.metrics_flush_seconds",
    "tracking.skip_finished",
    "tracking.log_model",
    "tracking.register_model",
    "tracking.system_metrics",
    "tracking.system_metrics_interval",
    "tracking.on_store_failure",
)


class _ComparableByValue:
    """``comparable`` of the last few configs, by value. A job asks for its config's hash
    about seven times (its tags, the finished-twin look-up, the checkpoint folder twice, each
    save), and each is a flatten through OmegaConf (slow, as OmegaConf is) of a config that
    does not change. The key is the config's repr: a dataclass's repr spells every field's
    value, so a config changed in between is a new key, never a stale hash."""

    def __init__(self, size: int = 16):
        self.size = size
        self._seen: dict[str, dict[str, str]] = {}

    def __call__(self, cfg: Config) -> dict[str, str]:
        key = repr(cfg)
        if key not in self._seen:
            if len(self._seen) >= self.size:
                self._seen.pop(next(iter(self._seen)))  # the oldest
            self._seen[key] = {k: v for k, v in flatten(cfg).items() if k not in NOT_HASHED}
        return dict(self._seen[key])  # a copy: callers may change theirs


_comparable = _ComparableByValue()  # a memo of a pure function: no state a caller sees


def comparable(cfg: Config) -> dict[str, str]:
    """The flattened config without the keys that may differ on resume."""
    return _comparable(cfg)


def config_hash(cfg: Config) -> str:
    """A short hash of what determines the result (resolved precision included)."""
    text = json.dumps(comparable(cfg), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def root_of(cfg: Config) -> Path:
    return Path(cfg.trainer.checkpoint_dir or DEFAULT_ROOT).expanduser().resolve()


def folder_for(cfg: Config, run_id: str | None) -> Path:
    """This run's checkpoint folder (absolute)."""
    name = run_id or f"untracked-{datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"
    return root_of(cfg) / config_hash(cfg) / name


def unmasked(text: str) -> str:
    return text


def differences(saved: dict[str, str], cfg: Config, mask: Callable[[str], str] = unmasked):
    """Where the config stored in a checkpoint (masked by ``mask``) differs from ``cfg``."""
    now = {k: mask(v) for k, v in comparable(cfg).items()}
    keys = sorted(set(saved) | set(now))
    return [
        f"{k}={saved.get(k, '<absent>')} in the checkpoint, {now.get(k, '<absent>')} now"
        for k in keys
        if saved.get(k) != now.get(k) and k not in NOT_HASHED
    ]
